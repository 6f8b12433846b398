"""Fit for a tensor split: the devices' shares of every layer, and the context, from the core's
exact projections (fit.fit routes here for split_mode="tensor" or "tensor-sum").

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

from . import _core
from .engine import SHARD_FIELDS
from .placement import DevicePlacement, Placement, format_size, slot_context

_ROUNDS = 8  # share corrections per context


def fit_tensor(path: str, devs, host_free: int, host_margin: int, **kw):
    """The placement (see the module's text); FitError when no shares fit. The first device holds
    the whole input embedding and the last gathers the logits: when the user's order does not
    fit, the roomiest device goes first."""
    from .fit import FitError

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


def _fit_tensor(path: str, devs, host_free: int, host_margin: int, *, split_mode: str, shares: Optional[Sequence[float]],
                n_ctx: Optional[int], n_ubatch: int, n_outputs: int, kv_type: str, n_seq: int, max_ctx: int,
                fit_ctx: int, set_by: Dict[str, str], fingerprint: str, ctx_step: int):
    from .fit import FitError, largest_fitting

    projector = _core.engine.Projector(os.fspath(path))
    tensor_sum = split_mode == "tensor-sum"
    specs = [d.spec.as_tuple() for d in devs]
    decisions: List[str] = []
    given = shares is not None
    if given:
        base = [float(s) for s in shares]
        decisions.append("shares " + ":".join(f"{s:g}" for s in base) + " (set by the user)")
    else:
        rooms = [max(d.room, 0) for d in devs]
        base = [r / sum(rooms) for r in rooms]
        decisions.append("shares from the devices' room (free less margin): " +
                         ", ".join(f"{d.name} {format_size(d.room)} -> {s:.1%}" for d, s in zip(devs, base)))
    n_proj = 0

    def project(ctx: int, sh: List[float]) -> List[dict]:
        nonlocal n_proj
        n_proj += 1
        return projector.project(specs, [], [], ctx, n_ubatch, kv_type, n_outputs, 1, n_seq, tensor_split=sh,
                                 tensor_sum=tensor_sum)["devices"]

    def over(proj: List[dict]) -> Dict[str, int]:
        short = {d.name: p["total"] - d.room for d, p in zip(devs, proj) if p["total"] > d.room}
        host = sum(p["total"] for d, p in zip(devs, proj) if d.cpu) - (host_free - host_margin)
        if host > 0 and not short:
            short["host RAM"] = host
        return short

    def settle(ctx: int):
        """Shares with which every device fits at ctx (None: none found), and the projection."""
        sh = list(base)
        seen = []  # (shares as fractions, totals) of the rounds so far
        for _ in range(_ROUNDS):
            proj = project(ctx, sh)
            short = over(proj)
            if not short:
                return sh, proj
            if given or "host RAM" in short or all(d.name in short for d in devs):
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

    lo_hi = None
    if n_ctx is not None:
        ctx = n_ctx
        sh, proj = settle(ctx)
    else:
        hi = slot_context(max(min(projector.n_ctx_train, max_ctx), n_seq), n_seq)
        lo = slot_context(max(min(fit_ctx, hi), n_seq), n_seq)
        lo_hi = (lo, hi)
        ctx = hi
        sh, proj = settle(hi)
        if sh is None:
            def probe(c):
                s2, p2 = settle(c)
                return None if s2 is None else (s2, p2)

            best = largest_fitting(list(range(lo, hi, ctx_step)), probe)
            if best is not None:
                ctx, (sh, proj) = best
            else:
                ctx = lo
                sh, proj = settle(lo)
    if sh is None:
        short = over(proj)
        parts = [f"{d.name} is short by {format_size(short[d.name])} (it would need {format_size(p['total'])}: "
                 f"weights {format_size(p['weights'])}, KV {format_size(p['kv'])}, compute {format_size(p['compute'])}; "
                 f"it has {format_size(d.free)} free ({d.free_source}) with a {format_size(d.margin)} margin)"
                 for d, p in zip(devs, proj) if d.name in short]
        if "host RAM" in short:
            parts.append(f"the CPU devices together are short of the host's RAM by {format_size(short['host RAM'])}")
        what = f"n_ctx {ctx}" + (f" ({set_by['n_ctx']})" if "n_ctx" in set_by else f" (the floor fit_ctx={fit_ctx})")
        raise FitError(f"{os.path.basename(path)} does not fit with a tensor split and {what}: " + "; ".join(parts) +
                       ".", {k: v for k, v in short.items()})
    if not given and sh != base:
        decisions.append("shares corrected to " + ", ".join(f"{d.name} {s / sum(sh):.1%}" for d, s in zip(devs, sh)) +
                         " so that every device holds its part with what it cannot split")
    if lo_hi is not None:
        lo, hi = lo_hi
        decisions.append(f"n_ctx {ctx}: " + ("the training context (capped at max_ctx)" if ctx == hi else
                                             f"the largest in steps of {ctx_step} from {hi} that fits (floor {lo})"))
    else:
        decisions.append(f"n_ctx {ctx} ({set_by.get('n_ctx', 'set')})")
    decisions.append(f"{n_proj} projections by the core's planner; the last one is this placement")

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
    host = None
    if any(d.cpu for d, p in zip(devs, proj) if p["total"]):
        host = {"free": host_free, "margin": host_margin,
                "projected": sum(p["total"] for d, p in zip(devs, proj) if d.cpu)}
    used = [x / norm for x, d in zip(sh, devs) if by_dev.get(devs.index(d)) is not None]
    return Placement(model={"path": os.path.abspath(path), "arch": projector.arch, "n_layer": projector.n_layer,
                            "fingerprint": fingerprint},
                     n_ctx=ctx, n_ubatch=n_ubatch, n_outputs=n_outputs, kv_type=kv_type, devices=devices, host=host,
                     n_copies=1, n_seq=n_seq, pipeline={"n_copies": 1, "reason": "a tensor split runs every device "
                                                                                  "on every token"},
                     split_mode=split_mode, tensor_split=used, decisions=decisions)
