"""Fit by layers: choose the layout from the expected bytes, check it by the core's exact
projection (which teaches the compute buffers, so a wrong guess is corrected and searched again),
take on copies and interleave where they fit too, and write the Placement with its reasons."""
from __future__ import annotations

from typing import Dict

from . import split as splitting
from .budgets import host_record
from .costs import model_record
from .data import DevicePlacement, Placement
from .explain import decisions, fit_error, left_out_reason
from .layer_problem import ROUNDS, LayerProblem, Layout
from .layer_search import choose
from .projection import overrides, project, short, used
from .rules import layer_devices
from .upgrades import with_copies, with_interleave


def fit_layers(p: LayerProblem) -> Placement:
    for _ in range(ROUNDS):
        ctx, layout, _ideal = choose(p)
        if layout is None:
            raise fit_error(p, ctx)
        proj = project(p, layout, ctx)
        if not short(p, proj):
            proj = with_copies(p, layout, ctx, proj)
            return _placement(p, layout, ctx, with_interleave(p, layout, ctx, proj))
    raise RuntimeError(f"fit: no placement settled after {ROUNDS} projections; please report this")


def _placement(p: LayerProblem, layout: Layout, ctx: int, proj: Dict[int, dict]) -> Placement:
    rules = overrides(p, layout)
    devices_used = used(p, layout)
    owner = [devices_used[i] for i in layer_devices([layout.count(d) for d in devices_used], p.interleave)[0]]
    expert_home: Dict[int, set] = {}  # layer -> devices holding its experts
    for l in range(p.L):
        homes = set(p.costs.pinned_experts.get(l, ()))
        if l in p.costs.moe_layers:
            homes.add(p.spill_dev if l in layout.spill else owner[l])
        expert_home[l] = homes
    devices = []
    for d in layout.order:
        dev = p.devs[d]
        dp = DevicePlacement(spec=str(dev.spec), layers=splitting.runs([l for l in range(p.L) if owner[l] == d]),
                             expert_layers=[l for l in range(p.L) if d in expert_home[l]],
                             overrides=[o for o, name in rules if name == dev.name], free=dev.free, margin=dev.margin)
        if d in devices_used:
            dp.projected = {k: proj[d][k] for k in dp.projected}
        else:
            dp.note = left_out_reason(p, d, layout, ctx)
        devices.append(dp)
    host = host_record([p.devs[d] for d in devices_used], [proj[d]["total"] for d in devices_used], p.host_free,
                       p.host_margin)
    pl = Placement(model=model_record(p.path, p.projector, p.costs.fingerprint), n_ctx=ctx, n_ubatch=p.n_ubatch,
                   n_outputs=p.n_outputs, kv_type=p.kv_type, devices=devices,
                   tensor_overrides=[f"{o}={name}" for o, name in rules], host=host, n_copies=p.n_copies,
                   n_seq=p.n_seq, pipeline=dict(p.pipeline), interleave=p.interleave,
                   moe_offload_min=p.moe_offload_min)
    pl.decisions = decisions(p, layout, ctx, pl)
    return pl
