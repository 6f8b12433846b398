"""Fit for a tensor split: the devices' shares of every layer, and the context, from the core's
exact projections (fit routes here for split_mode="tensor" or "tensor-sum").

1. Shares: as the user gave them, or in proportion to each device's room (free memory less its
   margin). What the shares cannot move (the whole input embedding on the first device, the
   small tensors every device keeps, head and block granularity) can push a device over: then
   its share shrinks by the ratio of its room to what it would take, and the others grow, until
   every device fits (a few projections).
2. The context: as given, or the largest from the training context (capped at max_ctx) down in
   steps of 256 per sequence to fit_ctx whose projection fits.
Every device draws its KV share from its own memory; CPU devices together must also fit the
host's available RAM.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence

from .. import _core
from .budgets import FitError, ctx_given, host_record, over, shares_of, shortfalls
from .costs import model_record
from .data import DevicePlacement, Placement, format_size
from .rules import SHARD_FIELDS
from .search import context_range, largest_context

ROUNDS = 8  # share corrections per context


def fit_tensor(path: str, devs, host_free: int, host_margin: int, **kw) -> Placement:
    """The placement (see the module's text); FitError when no shares fit. The first device holds
    the whole input embedding and the last gathers the logits: when the user's order does not
    fit, the roomiest device goes first."""
    try:
        return _fit_tensor(path, devs, host_free, host_margin, **kw)
    except FitError:
        order = sorted(range(len(devs)), key=lambda i: -devs[i].room)
        if order == list(range(len(devs))) or kw.get("shares") is not None:
            raise
        try:
            p = _fit_tensor(path, [devs[i] for i in order], host_free, host_margin, **kw)
        except FitError:
            pass
        else:
            p.decisions.insert(0, "devices reordered, the roomiest first: the first device holds the whole input "
                                  "embedding")
            return p
        raise


class _Shares:
    """Projections of one device order with shares, and the shares that make every device fit."""

    def __init__(self, projector, devs, host_free: int, host_margin: int, base: List[float], given: bool, *,
                 split_mode: str, n_ubatch: int, n_outputs: int, kv_type: str, n_seq: int):
        self.projector, self.devs, self.base, self.given = projector, devs, base, given
        self.host_free, self.host_margin = host_free, host_margin
        self.specs = [d.spec.as_tuple() for d in devs]
        self.args = (n_ubatch, kv_type, n_outputs, 1, n_seq)
        self.tensor_sum = split_mode == "tensor-sum"
        self.projections = 0

    def project(self, ctx: int, sh: List[float]) -> List[dict]:
        self.projections += 1
        return self.projector.project(self.specs, [], [], ctx, *self.args, tensor_split=sh,
                                      tensor_sum=self.tensor_sum)["devices"]

    def short(self, proj: List[dict]) -> Dict[str, int]:
        return over(self.devs, [p["total"] for p in proj], self.host_free, self.host_margin)

    def settle(self, ctx: int):
        """Shares with which every device fits at ctx (None: none found), and the projection."""
        devs, sh = self.devs, list(self.base)
        seen = []  # (shares as fractions, totals) of the rounds so far
        for _ in range(ROUNDS):
            proj = self.project(ctx, sh)
            short = self.short(proj)
            if not short:
                return sh, proj
            if self.given or "host RAM" in short or all(d.name in short for d in devs):
                return None, proj
            frac = [s / sum(sh) for s in sh]
            totals = [p["total"] for p in proj]
            nxt = []
            for i, (f, d, t) in enumerate(zip(frac, devs, totals)):
                if t <= d.room:
                    nxt.append(f)
                    continue
                # A device's total is what it holds whatever its share (the gathered activations,
                # the input embedding) plus bytes in proportion to its share: the line through an
                # earlier round with another share says where it meets the room (a step at most
                # twice the proportional one); without one, shrink in proportion to how far over.
                prev = next(((pf[i], pt[i]) for pf, pt in reversed(seen) if pf[i] != f), None)
                slope = (t - prev[1]) / (f - prev[0]) if prev else 0.0
                step = f * d.room / t
                nxt.append(max(step * d.room / t, f - (t - d.room) / slope * 1.02) if slope > 0 else step)
            seen.append((frac, totals))
            sh = nxt
            if sum(sh) <= 0:
                return None, proj
        return None, proj


def _fit_tensor(path: str, devs, host_free: int, host_margin: int, *, split_mode: str,
                shares: Optional[Sequence[float]], n_ctx: Optional[int], n_ubatch: int, n_outputs: int, kv_type: str,
                n_seq: int, max_ctx: int, fit_ctx: int, set_by: Dict[str, str], fingerprint: str,
                ctx_step: int) -> Placement:
    projector = _core.engine.Projector(os.fspath(path))
    decisions: List[str] = []
    given = shares is not None
    if given:
        base = [float(s) for s in shares]
        decisions.append("shares " + ":".join(f"{s:g}" for s in base) +
                         f" ({set_by.get('tensor_split', 'set by the user')})")
    else:
        base = shares_of([d.room for d in devs])
        decisions.append("shares from the devices' room (free less margin): " +
                         ", ".join(f"{d.name} {format_size(d.room)} -> {s:.1%}" for d, s in zip(devs, base)))
    fitter = _Shares(projector, devs, host_free, host_margin, base, given, split_mode=split_mode, n_ubatch=n_ubatch,
                     n_outputs=n_outputs, kv_type=kv_type, n_seq=n_seq)
    lo_hi = None
    if n_ctx is not None:
        ctx = n_ctx
        sh, proj = fitter.settle(ctx)
    else:
        lo, hi = lo_hi = context_range(projector.n_ctx_train, max_ctx, fit_ctx, n_seq)

        def probe(c):
            s, p = fitter.settle(c)
            return None if s is None else (s, p)

        best = largest_context(lo, hi, ctx_step, probe)
        if best is not None:
            ctx, (sh, proj) = best
        else:
            ctx = lo
            sh, proj = fitter.settle(lo)
    if sh is None:
        lack = fitter.short(proj)
        raise FitError(f"{os.path.basename(path)} does not fit with a tensor split and "
                       f"{ctx_given(ctx, set_by, fit_ctx)}: " +
                       "; ".join(shortfalls(zip(devs, proj), lack, host_free, host_margin)) + ".", lack)
    if not given and sh != base:
        decisions.append("shares corrected to " + ", ".join(f"{d.name} {s / sum(sh):.1%}" for d, s in zip(devs, sh)) +
                         " so that every device holds its part with what it cannot split")
    if lo_hi is not None:
        lo, hi = lo_hi
        decisions.append(f"n_ctx {ctx}: " + ("the training context (capped at max_ctx)" if ctx == hi else
                                             f"the largest in steps of {ctx_step} from {hi} that fits (floor {lo})"))
    else:
        decisions.append(f"n_ctx {ctx} ({set_by.get('n_ctx', 'set')})")
    decisions.append(f"{fitter.projections} projections by the core's planner; the last one is this placement")
    return _placement(path, projector, devs, sh, proj, ctx, host_free, host_margin, decisions, fingerprint=fingerprint,
                      split_mode=split_mode, n_ubatch=n_ubatch, n_outputs=n_outputs, kv_type=kv_type, n_seq=n_seq)


def _placement(path, projector, devs, sh, proj, ctx, host_free, host_margin, decisions, *, fingerprint, split_mode,
               n_ubatch, n_outputs, kv_type, n_seq) -> Placement:
    """Each device's shard (its part of every kind of tensor against the model's) and bytes."""
    tensor_sum = split_mode == "tensor-sum"
    specs = [d.spec.as_tuple() for d in devs]
    shards = projector.shards(specs, sh, tensor_sum)
    whole = projector.shards(specs[:1], [1.0], tensor_sum)[0]
    total = {k: sum(l[i] for l in whole["layers"]) for i, k in enumerate(SHARD_FIELDS)}
    total["vocab"] = whole["vocab"]
    by_dev = {s["device"]: s for s in shards}
    devices = []
    norm = sum(sh)
    for i, (d, p) in enumerate(zip(devs, proj)):
        dp = DevicePlacement(spec=str(d.spec), layers=None, free=d.free, margin=d.margin)
        s = by_dev.get(i)
        if s is None:
            dp.note = "share 0"
        else:
            dp.projected = {k: p[k] for k in dp.projected}
            part = {k: sum(l[j] for l in s["layers"]) for j, k in enumerate(SHARD_FIELDS)}
            part["vocab"] = s["vocab"]
            dp.shard = {"share": sh[i] / norm, **{k: (part[k], total[k]) for k in part}}
        devices.append(dp)
    loaded = [(d, p["total"]) for d, p in zip(devs, proj) if p["total"]]
    host = host_record([d for d, _ in loaded], [t for _, t in loaded], host_free, host_margin)
    used = [x / norm for x, d in zip(sh, devs) if by_dev.get(devs.index(d)) is not None]
    return Placement(model=model_record(path, projector, fingerprint), n_ctx=ctx, n_ubatch=n_ubatch,
                     n_outputs=n_outputs, kv_type=kv_type, devices=devices, host=host, n_copies=1, n_seq=n_seq,
                     pipeline={"n_copies": 1, "reason": "a tensor split runs every device on every token"},
                     split_mode=split_mode, tensor_split=used, decisions=decisions)
