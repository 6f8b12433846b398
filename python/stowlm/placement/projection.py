"""The core's exact projection of a layer layout, and what the search learns from it: each
device's compute buffer in its role (layer_costs.compute_estimate), with a check that fit's own
weight and KV accounting agrees with the core's."""
from __future__ import annotations

import re
from typing import Dict, List, Tuple

from . import layer_costs as cost
from .budgets import over
from .layer_problem import LayerProblem, Layout
from .rules import _tensor_overrides


def used(p: LayerProblem, layout: Layout) -> List[int]:
    """The devices the model loads onto: those with layers, pinned weights or spilled ones."""
    hosts = set(p.costs.pinned)
    if p.spill_dev is not None and (layout.spill or layout.embd_to_spill):
        hosts.add(p.spill_dev)
    return [d for d, c in zip(layout.order, layout.counts) if c or d in hosts]


def overrides(p: LayerProblem, layout: Layout) -> List[Tuple[str, str]]:
    """(REGEX, device name) in the order they apply: the user's, then fit's."""
    out = [(spec.rpartition("=")[0], spec.rpartition("=")[2].strip()) for spec in p.user_overrides]
    if p.spill_dev is not None:
        host = p.devs[p.spill_dev].name
        if layout.spill:
            out.append((r"^blk\.(?:" + "|".join(str(l) for l in layout.spill) + r")\.[a-z0-9_]*_exps\.", host))
        if layout.embd_to_spill:
            out += [("^" + re.escape(n) + "$", host) for n in p.costs.first_names]
    return out


def project(p: LayerProblem, layout: Layout, ctx: int, interleave: int = 1) -> Dict[int, dict]:
    """The core's rows per used device; contiguous ranges teach the compute buffer of each role."""
    devices = used(p, layout)
    specs = [p.devs[d].spec for d in devices]
    native = _tensor_overrides([f"{rx}={dev}" for rx, dev in overrides(p, layout)], specs, p.names)
    result = p.projector.project([s.as_tuple() for s in specs], [layout.count(d) for d in devices], native,
                                 ctx, p.n_ubatch, p.kv_type, p.n_outputs, p.n_copies, p.n_seq, interleave=interleave,
                                 moe_offload_min=p.moe_offload_min)
    p.projections += 1
    p.pipeline = dict(result["pipeline"])
    out = {d: dict(r) for d, r in zip(devices, result["devices"])}
    if interleave > 1:  # the accounting below is of contiguous ranges
        return out
    last = layout.last_device()
    for d in devices:  # what the search will expect of this device's role from now on
        start, end = layout.range_of(d)
        key = cost.role(p, ctx, d, start, end, d == last, layout.spill,
                        cost.hosts_spill(p, d, layout.spill, layout.embd_to_spill))
        p.observed[key] = max(p.observed.get(key, 0), out[d]["compute"])
        expect_w = cost.weights(p, d, start, end, d == last, layout.spill, layout.embd_to_spill)
        expect_kv = cost.kv(p, ctx, start, end)
        if (expect_w, expect_kv) != (out[d]["weights"], out[d]["kv"]):
            raise RuntimeError(f"fit: its accounting of {p.devs[d].name} (weights {expect_w}, KV "
                               f"{expect_kv}) differs from the core's ({out[d]['weights']}, "
                               f"{out[d]['kv']}); please report this")
    return out


def short(p: LayerProblem, proj: Dict[int, dict]) -> Dict[str, int]:
    """Device name -> bytes over its room, for every device (and the host) short."""
    return over([p.devs[d] for d in proj], [r["total"] for r in proj.values()], p.host_free, p.host_margin)
