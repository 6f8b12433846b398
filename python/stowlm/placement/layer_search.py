"""The layer layout: which device holds which layers, which experts spill, and the context, from
the expected bytes of layer_costs (no projection here but in largest_ctx's check).

Dense weights first on the fastest memory: devices are filled in tiers, GPU memory first, then
CPU devices with a budget, then the host's RAM. Experts of mixture-of-experts layers spill first,
whole layers at a time, to the spill device; then whole layers move to the slowest tier.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from . import layer_costs as cost
from . import split as splitting
from .layer_problem import ROUNDS, LayerProblem, Layout
from .projection import project, short
from .rules import CTX_STEP
from .search import context_range, largest_context, largest_fitting, smallest


def ctx_step(p: LayerProblem) -> int:
    return CTX_STEP * p.n_seq  # every slot's share moves by CTX_STEP


def ctx_range(p: LayerProblem) -> Tuple[int, int]:
    return context_range(p.projector.n_ctx_train, p.max_ctx, p.fit_ctx, p.n_seq)


def fill(p: LayerProblem, group: List[int], ctx: int, start_min: int, end: int, output_open: bool,
         spill: Tuple[int, ...]) -> Tuple[List[int], int]:
    """Layers ending at `end` over a group of devices, balanced by speed within their rooms."""
    def fits(i, start, stop, holds_output):
        d = group[i]
        return cost.total(p, ctx, d, start, stop, holds_output, spill, p.embd_to_spill) <= p.devs[d].room

    return splitting.balanced([p.devs[d].speed for d in group], start_min, end, fits, output_open,
                              p.costs.work_sum)


def pipeline_order(p: LayerProblem) -> Tuple[int, ...]:
    if p.layer_split is not None:
        return tuple(range(len(p.devs)))
    return tuple(d for tier in reversed(p.tiers) for d in tier)


def layout_of(p: LayerProblem, counts: Dict[int, int], spill: Tuple[int, ...]) -> Layout:
    order = pipeline_order(p)
    return Layout(order, tuple(counts.get(d, 0) for d in order), tuple(spill), p.embd_to_spill)


def fill_fast(p: LayerProblem, ctx: int, h: int, spill: Tuple[int, ...]) -> Tuple[Dict[int, int], int]:
    """Layers [h, L) over the faster tiers, the fastest taking the last layers and the most."""
    counts: Dict[int, int] = {}
    end, output_open = p.L, True
    for tier in p.tiers[:-1]:
        c, start = fill(p, tier, ctx, h, end, output_open, spill)
        counts.update(zip(tier, c))
        output_open = output_open and start == end
        end = start
    return counts, end


def tiered(p: LayerProblem, ctx: int, h: int, spill: Tuple[int, ...]) -> Optional[Layout]:
    """Layers [h, L) on the faster tiers, [0, h) on the slowest; None if that does not fit."""
    counts, reached = fill_fast(p, ctx, h, spill)
    if reached > h:
        return None
    slow = p.tiers[-1]
    c, start = fill(p, slow, ctx, 0, h, h == p.L, spill)
    if start > 0:
        return None
    counts.update(zip(slow, c))
    layout = layout_of(p, counts, spill)
    return layout if cost.fits(p, layout, ctx) else None


def min_spill(candidates: List[int], works) -> Optional[Tuple[int, ...]]:
    """The fewest of `candidates` (a prefix) whose experts spill for `works` to accept."""
    if works(tuple(candidates)) is None:
        return None
    n = smallest(0, len(candidates), lambda k: works(tuple(candidates[:k])) is not None)
    return tuple(candidates[:n])


def search(p: LayerProblem, ctx: int, ideal: bool) -> Optional[Layout]:
    """The preferred layout at this context, from the current estimates; None if none fits.
    ideal: nothing moves to the slowest tier (no experts spilled, no layers there)."""
    moe, user_spill = p.costs.moe_layers, p.user_spill
    if p.layer_split is not None:
        counts = dict(zip(range(len(p.devs)), p.layer_split))

        def check(spill):
            lay = layout_of(p, counts, spill)
            return lay if cost.fits(p, lay, ctx) else None

        if user_spill is not None or p.spill_dev is None or not moe or ideal:
            return check(user_spill or ())
        start, end = layout_of(p, counts, ()).range_of(p.spill_dev)
        spill = min_spill([l for l in moe if not start <= l < end], check)
        return None if spill is None else check(spill)
    if len(p.tiers) == 1:
        spill = user_spill or ()
        counts, start = fill(p, p.tiers[0], ctx, 0, p.L, True, spill)
        if start > 0:
            return None
        layout = layout_of(p, dict(zip(p.tiers[0], counts)), spill)
        return layout if cost.fits(p, layout, ctx) else None
    if ideal:
        return tiered(p, ctx, 0, user_spill or ())
    # The fewest whole layers on the slowest tier, with every expert of the rest spilled ...
    spill_for = (lambda h: user_spill) if user_spill is not None else \
        (lambda h: tuple(l for l in moe if l >= h))
    lo = smallest(0, p.L, lambda h: fill_fast(p, ctx, h, spill_for(h))[1] <= h)
    for h in range(lo, p.L + 1):
        if tiered(p, ctx, h, spill_for(h)) is None:
            continue
        if user_spill is not None or not moe:
            return tiered(p, ctx, h, spill_for(h))
        # ... then the fewest experts spilled.
        spill = min_spill([l for l in moe if l >= h], lambda s: tiered(p, ctx, h, s))
        return tiered(p, ctx, h, spill)
    return None


def choose(p: LayerProblem) -> Tuple[int, Optional[Layout], bool]:
    """(context, layout, whether it is the ideal layout) from the current estimates."""
    if p.n_ctx is not None:
        return p.n_ctx, search(p, p.n_ctx, False), False
    lo, hi = ctx_range(p)
    best = largest_context(lo, hi, ctx_step(p), lambda c: search(p, c, True))
    if best is not None:
        return best[0], best[1], True
    return lo, search(p, lo, False), False


def largest_ctx(p: LayerProblem, below: int) -> Optional[int]:
    """The largest context below `below` (in steps of CTX_STEP) that fits with everything else
    as set, checked by projecting its layout."""
    steps = list(range(ctx_step(p), below, ctx_step(p)))
    for _ in range(ROUNDS):
        best = largest_fitting(steps, lambda c: search(p, c, False))
        if best is None or not short(p, project(p, best[1], best[0])):
            return None if best is None else best[0]
    return None


def forced(p: LayerProblem, ctx: int) -> Layout:
    """The layout that comes closest: every device as full as it goes, the rest of the layers on
    the first device of the pipeline (whose shortfall that is)."""
    if p.layer_split is not None:
        counts = dict(zip(range(len(p.devs)), p.layer_split))
        spill = p.user_spill if p.user_spill is not None else ()
        if p.user_spill is None and p.spill_dev is not None:
            start, end = layout_of(p, counts, ()).range_of(p.spill_dev)
            spill = tuple(l for l in p.costs.moe_layers if not start <= l < end)
        return layout_of(p, counts, spill)
    spill = p.user_spill if p.user_spill is not None else \
        (tuple(p.costs.moe_layers) if len(p.tiers) > 1 else ())
    if len(p.tiers) > 1:
        counts, end = fill_fast(p, ctx, 0, spill)
        slow = p.tiers[-1]
        c, start = fill(p, slow, ctx, 0, end, end == p.L, spill)
        counts.update(zip(slow, c))
    else:
        c, start = fill(p, p.tiers[0], ctx, 0, p.L, True, spill)
        counts = dict(zip(p.tiers[0], c))
    first = pipeline_order(p)[0]
    counts[first] = counts.get(first, 0) + start
    return layout_of(p, counts, spill)
