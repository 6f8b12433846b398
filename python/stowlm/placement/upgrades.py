"""What a layer placement takes on after its layout is chosen, only where the exact projection
of it fits too: the pipeline's copies, then interleaved layer ranges."""
from __future__ import annotations

from typing import Dict

from .data import format_size
from .layer_problem import LayerProblem, Layout
from .projection import project, short, used
from .rules import layer_devices


def _short_text(s: Dict[str, int]) -> str:
    return ", ".join(f"{name} by {format_size(b)}" for name, b in s.items())


def with_copies(p: LayerProblem, layout: Layout, ctx: int, proj: Dict[int, dict]) -> Dict[int, dict]:
    """Pipelining's copies never displace weights or context: unless the user set n_copies,
    the layout is chosen with one copy, then takes the default copies if they fit too."""
    if "n_copies" in p.set_by or p.wanted_copies == 1:
        return proj
    p.n_copies = p.wanted_copies
    more = project(p, layout, ctx)
    if not short(p, more):
        return more
    why = _short_text(short(p, more))
    p.n_copies = 1
    proj = project(p, layout, ctx)
    p.pipeline["reason"] = (f"its {p.wanted_copies} copies of the tensors that cross devices did not fit "
                            f"with this placement (short: {why})")
    return proj


def with_interleave(p: LayerProblem, layout: Layout, ctx: int, proj: Dict[int, dict]) -> Dict[int, dict]:
    """Each device's layers in chunks that take turns (shorter pipeline stages), when the exact
    projection of that fits too: they hold other layers than the contiguous ranges searched."""
    devices = used(p, layout)
    cpu_only = all(p.devs[d].cpu for d in devices if layout.count(d))
    _, v = layer_devices([layout.count(d) for d in devices], p.wanted_interleave, cpu_only)
    if v == 1:
        return proj
    pipeline = p.pipeline
    more = project(p, layout, ctx, v)
    if not short(p, more):
        p.interleave = v
        return more
    p.interleave_reason = (f"interleave {v} did not fit (short: {_short_text(short(p, more))}), so each device "
                           "keeps one range")
    p.pipeline = pipeline
    return proj
