"""Why: the decisions a layer placement records (Placement.decisions, shown by explain()), why a
device was left out, and what a FitError says is short."""
from __future__ import annotations

import os
from typing import List

from . import layer_costs as cost
from . import split as splitting
from .budgets import FitError, ctx_given, shortfalls
from .data import Placement, format_size
from .layer_problem import TIER_NAMES, LayerProblem, Layout
from .layer_search import ctx_range, forced, largest_ctx, pipeline_order, search
from .projection import project, short
from .rules import CTX_STEP


def fit_error(p: LayerProblem, ctx: int) -> FitError:
    """What is short in the layout that comes closest, and the largest context that would fit."""
    layout = forced(p, ctx)
    proj = project(p, layout, ctx)
    lack = short(p, proj)
    parts = shortfalls(((p.devs[d], r) for d, r in proj.items()), lack, p.host_free, p.host_margin)
    if not parts:
        parts.append("no contiguous split of the layers fits the devices' free memory less their margins")
    head = {p.devs[d].name: cost.total(p, ctx, d, p.L - 1, p.L, True, layout.spill, layout.embd_to_spill)
            - p.devs[d].room for d in layout.order}
    if min(head.values()) > 0:
        parts.append("no device has room for the output head with the last layer (the closest, " +
                     min(head, key=head.get) + f", lacks {format_size(min(head.values()))})")
    largest = largest_ctx(p, ctx)
    msg = f"{os.path.basename(p.path)} does not fit with {ctx_given(ctx, p.set_by, p.fit_ctx)}: " + \
        "; ".join(parts) + ". "
    fixed = [f"{k} ({v})" for k, v in p.set_by.items() if k != "n_ctx"]
    others = (" with the other settings as given" + (f" ({', '.join(fixed)})" if fixed else ""))
    if largest is not None:
        msg += f"The largest context that fits{others} is n_ctx {largest}."
    else:
        msg += f"No context fits{others}."
    return FitError(msg, lack, largest)


def left_out_reason(p: LayerProblem, d: int, layout: Layout, ctx: int) -> str:
    dev = p.devs[d]
    other = p.devs[next(x for x in layout.order if x != d)]

    def alone(split, i):  # exactly what the device takes with `split` over [it, other] or [other, it]
        specs = [dev.spec, other.spec] if i == 0 else [other.spec, dev.spec]
        row = p.projector.project([s.as_tuple() for s in specs], split, [], ctx, p.n_ubatch, p.kv_type,
                                  p.n_outputs, p.n_copies, p.n_seq, interleave=1,
                                  moe_offload_min=p.moe_offload_min)["devices"][i]
        p.projections += 1
        return row["total"]

    first = alone([1, p.L - 1], 0)
    if first > dev.room:
        return (f"left out: too small for one layer plus its buffers (layer 0 needs {format_size(first)} there, "
                f"it has {format_size(dev.room)} after its margin)")
    tier = [x for x in pipeline_order(p) if p.devs[x].tier == dev.tier]
    if p.layer_split is None and tier and tier[-1] == d and p.devs[d].tier == min(x.tier for x in p.devs):
        last = alone([p.L - 1, 1], 1)
        if last > dev.room:
            return (f"left out: the last device of the fastest tier holds the output head, and the last layer with "
                    f"it needs {format_size(last)} there; it has {format_size(dev.room)} after its margin")
    return "left out: not needed (the layers fit on faster devices)"


def _memory(p: LayerProblem, pl: Placement) -> List[str]:
    """The room each device offers, and the order they are filled in."""
    out = []
    for dev in p.devs:
        out.append(f"{dev.name}: {format_size(dev.free)} free ({dev.free_source}), margin {format_size(dev.margin)}"
                   + (f" ({p.set_by['margin']})" if "margin" in p.set_by else " (default: min(1 GiB, memory/16))"))
    if pl.host is not None:
        out.append(f"host RAM: {format_size(p.host_free)} available for all CPU devices together, margin "
                   f"{format_size(p.host_margin)}; weights on a CPU device are read in place from the mapped "
                   "file and count in full")
    if len(p.tiers) > 1:
        out.append("fill order: " + ", then ".join(
            f"{' '.join(p.devs[d].name for d in tier)} ({TIER_NAMES[p.devs[tier[0]].tier]})"
            for tier in p.tiers) + "; dense weights go first on the fastest"
            + (f", experts spill to {p.devs[p.spill_dev].name}" if p.spill_dev is not None
               and p.costs.moe_layers else ""))
    return out


def _context(p: LayerProblem, ctx: int) -> str:
    lo, hi = ctx_range(p)
    if p.n_ctx is not None:
        return f"n_ctx {ctx}: {p.set_by['n_ctx']}"
    if ctx == hi:
        return (f"n_ctx {ctx}: the model's training context ({p.projector.n_ctx_train})"
                + (f" capped at max_ctx {p.max_ctx}" if p.projector.n_ctx_train > p.max_ctx else ""))
    fast = ", ".join(p.devs[d].name for t in (p.tiers[:-1] if len(p.tiers) > 1 else p.tiers) for d in t)
    if ctx == lo and search(p, lo, True) is None:
        return (f"n_ctx {hi} -> {ctx}: every layer with its KV cache did not fit on {fast} (margins kept) "
                f"even at the floor fit_ctx {lo}, so weights move to slower memory instead")
    return (f"n_ctx {hi} -> {ctx}: the largest context (in steps of {CTX_STEP}, floor fit_ctx {lo}) "
            f"with which every layer and its KV cache fit on {fast} (margins kept)")


def _where(p: LayerProblem, layout: Layout) -> List[str]:
    """What moved to slower memory, and the layers of each tier."""
    out = []
    if layout.spill:
        host = p.devs[p.spill_dev].name
        why = (p.set_by.get("cpu_moe") or p.set_by.get("n_cpu_moe") or
               f"dense weights first: with them on {', '.join(p.devs[d].name for t in p.tiers[:-1] for d in t)} "
               f"the experts of these layers did not fit there")
        out.append(f"experts of layers {splitting.describe_layers(layout.spill)} -> {host}: {why}")
    if layout.embd_to_spill:
        out.append(f"{', '.join(p.costs.first_names)} -> {p.devs[p.spill_dev].name}: only the prompt's "
                   "rows are read, so it leaves room on the faster devices")
    if p.layer_split is not None:
        out.append(f"layer split {list(p.layer_split)}: {p.set_by.get('layer_split', 'set by the user')}")
        return out
    for tier in p.tiers:
        got = [(p.devs[d], layout.count(d)) for d in tier if layout.count(d)]
        if not got:
            continue
        speeds = "/".join(str(dev.speed) for dev, _ in got)
        desc = ", ".join(f"{dev.name} {c}" for dev, c in got)
        slow_tier = len(p.tiers) > 1 and tier is p.tiers[-1]
        out.append(f"layers of {TIER_NAMES[p.devs[tier[0]].tier]}: {desc}"
                   + (" (whole layers: they did not fit on the faster devices" +
                      (" even with every expert spilled" if p.costs.moe_layers else "") + ")"
                      if slow_tier else "")
                   + (f"; stages balanced by speed ({speeds}) within each device's room" if len(got) > 1 else ""))
    return out


def _pipeline(p: LayerProblem, layout: Layout, pl: Placement) -> List[str]:
    """Copies, interleave and the expected stage times, where several devices hold layers."""
    holders = [d for d in layout.order if layout.count(d)]
    if len(holders) <= 1:
        return []
    out = []
    if p.pipeline["n_copies"] > 1:
        extra = sum(d.projected["copies"] for d in pl.devices) * (p.n_copies - 1) // p.n_copies
        out.append(f"pipeline parallelism on: {p.n_copies} copies of the tensors that cross devices "
                   f"({format_size(extra)} more than one copy), so each device works on its own "
                   "micro-batch of a long prompt")
    else:
        out.append(f"pipeline parallelism off: {p.pipeline['reason']}")
    if p.interleave > 1:
        out.append(f"interleave {p.interleave}: each device's layers in {p.interleave} ranges that take "
                   "turns with the other devices', so a pipeline stage, and the devices' wait while the "
                   f"pipeline fills and drains, is 1/{p.interleave} as long "
                   f"({p.set_by.get('interleave', 'the default')})")
    elif p.interleave_reason or "interleave" in p.set_by:
        out.append("interleave 1: one range of layers per device "
                   f"({p.interleave_reason or p.set_by['interleave']})")
    work = p.costs.work_sum
    times = {d: sum(work[b + 1] - work[a] for a, b in pl.devices[layout.order.index(d)].layers)
             / p.devs[d].speed for d in holders}
    slowest = max(times.values())
    out.append("expected time per stage (its layers' weights read per token / its speed, slowest = 1.00): " +
               ", ".join(f"{p.devs[d].name} {times[d] / slowest:.2f}" for d in holders))
    return out


def decisions(p: LayerProblem, layout: Layout, ctx: int, pl: Placement) -> List[str]:
    out = _memory(p, pl)
    out.append(_context(p, ctx))
    out += _where(p, layout)
    last = layout.last_device()
    if last is not None:
        out.append(f"output head -> {p.devs[last].name}: it stays with the last layer")
    out += _pipeline(p, layout, pl)
    for d in pl.devices:
        if d.note:
            out.append(f"{d.name} {d.note}")
    for o in p.user_overrides:
        out.append(f"override {o}: {p.set_by.get('tensor_overrides', 'set by the user')}")
    out.append(f"{p.projections} projection{'s' if p.projections > 1 else ''} by the core's planner; the "
               "last one is this placement")
    return out
