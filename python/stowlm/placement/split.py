"""How a run of consecutive layers is cut into contiguous ranges over devices.

Pure functions over a room test ``fits(i, start, end, holds_output)``: can device ``i`` (an index
into the device list given) hold layers ``[start, end)``, and the output head too when
``holds_output``? The cost behind it (weights, KV cache, compute buffer) is fit's business
(layer_costs.py); here only the cutting is decided. Devices are given in pipeline order: layers flow
from the first to the last, and the last one that holds layers holds the output head.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

from .search import largest

Fits = Callable[[int, int, int, bool], bool]


def fill_from_end(n_devices: int, start_min: int, end: int, fits: Fits, output_open: bool,
                  limit: Optional[Callable[[int, int], int]] = None) -> Tuple[List[int], int]:
    """Greedy from the end: the last device takes as many of the layers that end at ``end`` as
    it has room for (at most ``limit(i, end_of_its_range)``), then the device before it, and so
    on, never below ``start_min``. Returns (layers per device, the first layer covered). Taking
    the most at each device covers the longest run a contiguous cut can cover in this order."""
    counts = [0] * n_devices
    pos = end
    for i in reversed(range(n_devices)):
        hi = pos - start_min
        if limit is not None:
            hi = min(hi, limit(i, pos))
        if hi <= 0 or not fits(i, pos - 1, pos, output_open):
            continue
        # the most layers ending at pos with room for them: costs grow with the count
        took = largest(1, hi, lambda c: fits(i, pos - c, pos, output_open))
        counts[i] = took
        pos -= took
        output_open = False
    return counts, pos


def balanced(speeds: Sequence[float], start_min: int, end: int, fits: Fits, output_open: bool,
             work: Optional[Sequence[float]] = None, steps: int = 24) -> Tuple[List[int], int]:
    """The longest run of layers ending at ``end`` the devices have room for, cut so that the
    slowest stage (its layers' work / its speed) is as short as the room allows. ``work`` holds
    prefix sums of each layer's work (default: 1 per layer). The stage time is found by
    bisection: each device takes at most the layers whose work fits ``t * speed``."""
    n = len(speeds)
    counts, start = fill_from_end(n, start_min, end, fits, output_open)
    if end == start or n == 1:
        return counts, start
    w = work if work is not None else list(range(end + 1))

    def limit_at(t):
        def limit(i, pos):
            budget = t * speeds[i]  # the most layers ending at pos within it
            return largest(0, pos - start_min, lambda c: w[pos] - w[pos - c] <= budget)
        return limit

    lo, hi = 0.0, (w[end] - w[start]) / min(speeds)
    best = counts
    for _ in range(steps):
        mid = (lo + hi) / 2
        trial, trial_start = fill_from_end(n, start_min, end, fits, output_open, limit_at(mid))
        if trial_start <= start:
            best, hi = trial, mid
        else:
            lo = mid
    return best, start


def ranges(counts: Sequence[int], first: int = 0) -> List[Optional[Tuple[int, int]]]:
    """Layer counts per device -> (first, last) inclusive per device, None where it has none."""
    out: List[Optional[Tuple[int, int]]] = []
    pos = first
    for c in counts:
        out.append((pos, pos + c - 1) if c else None)
        pos += c
    return out


def runs(layers: Sequence[int]) -> List[Tuple[int, int]]:
    """[0, 1, 2, 5, 7, 8] -> [(0, 2), (5, 5), (7, 8)]."""
    out: List[Tuple[int, int]] = []
    for layer in sorted(layers):
        if out and layer == out[-1][1] + 1:
            out[-1] = (out[-1][0], layer)
        else:
            out.append((layer, layer))
    return out


def describe_runs(ranges: Sequence[Tuple[int, int]]) -> str:
    """[(0, 2), (5, 5), (7, 8)] -> "0-2, 5, 7-8"."""
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in ranges)


def describe_layers(layers: Sequence[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    return describe_runs(runs(layers))
