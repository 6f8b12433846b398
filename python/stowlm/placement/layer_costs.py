"""A device's bytes in a layer layout: its weights and KV cache exactly (from the costs), its
compute buffer as learnt from the projections made so far (projection.project teaches it).
The layer search tests its candidates with these; the chosen one is then projected exactly."""
from __future__ import annotations

from typing import Dict, Tuple

from .budgets import over
from .layer_problem import LayerProblem, Layout


def role(p: LayerProblem, ctx: int, d: int, start: int, end: int, holds_output: bool, spill: Tuple[int, ...],
         hosts_spill: bool):
    """What a device's compute buffer depends on: the micro-batch (n_ubatch, at most n_ctx),
    the kinds of its layers, whether it holds the output head or spilled experts, and whether
    the micro-batches are likely pipelined (copy slots; spilled or pinned weights stop it)."""
    n_moe = p.costs.n_moe(start, end)
    count = p.costs.spilled(spill)[1]
    n_spilled = count[end] - count[start]
    kinds = frozenset(k for k, n in (("dense", end - start - n_moe), ("moe", n_moe - n_spilled),
                                     ("moe-spilled", n_spilled)) if n > 0)
    pipelined = p.n_copies > 1 and len(p.devs) > 1
    return d, min(p.n_ubatch, ctx), holds_output, kinds, hosts_spill, pipelined


def hosts_spill(p: LayerProblem, d: int, spill: Tuple[int, ...], embd_to_spill: bool) -> bool:
    return d == p.spill_dev and (bool(spill) or embd_to_spill)


def compute_estimate(p: LayerProblem, key) -> int:
    """A device's compute buffer in a role: the largest seen in a projection, 0 before one is
    seen. Never guessing high means fit never refuses a layout it has not projected; a low
    guess is caught by the projection of the layout chosen, which teaches the real size."""
    return p.observed.get(key, 0)


def weights(p: LayerProblem, d: int, start: int, end: int, holds_output: bool, spill: Tuple[int, ...],
            embd_to_spill: bool) -> int:
    c, cpu = p.costs, p.devs[d].cpu
    spilled = c.spilled(spill)[0][cpu]
    w = c.layers_bytes(cpu, start, end) - (spilled[end] - spilled[start])
    w += c.pinned.get(d, {True: 0, False: 0})[cpu]
    if holds_output:
        w += c.last[cpu]
    if start == 0 and end > 0 and not embd_to_spill:
        w += c.first[cpu]
    if d == p.spill_dev:
        w += spilled[-1]
        if embd_to_spill:
            w += c.first[cpu]
    return w


def kv(p: LayerProblem, ctx: int, start: int, end: int) -> int:
    s = p.costs.kv_sum(ctx)
    return s[end] - s[start]


def total(p: LayerProblem, ctx, d, start, end, holds_output, spill, embd_to_spill) -> int:
    key = role(p, ctx, d, start, end, holds_output, spill, hosts_spill(p, d, spill, embd_to_spill))
    return weights(p, d, start, end, holds_output, spill, embd_to_spill) + kv(p, ctx, start, end) + \
        compute_estimate(p, key)


def totals(p: LayerProblem, layout: Layout, ctx: int) -> Dict[int, int]:
    """Each device's expected bytes in the layout."""
    last = layout.last_device()
    out = {}
    for d in layout.order:
        start, end = layout.range_of(d)
        out[d] = total(p, ctx, d, start, end, d == last, layout.spill, layout.embd_to_spill)
    return out


def fits(p: LayerProblem, layout: Layout, ctx: int) -> bool:
    """Every device within its room and the CPU devices within the host's RAM, as expected."""
    expect = totals(p, layout, ctx)
    return not over([p.devs[d] for d in expect], list(expect.values()), p.host_free, p.host_margin)
