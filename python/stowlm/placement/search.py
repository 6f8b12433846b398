"""The searches every fitter shares: the largest value that still fits (bisection over a test
that holds up to some point and fails above it), and the context to try first and last."""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

from .rules import slot_context


def largest(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
    """The largest x in [lo, hi] with ok(x), lo taken to hold (ok fails above some point)."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def smallest(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
    """The smallest x in [lo, hi] with ok(x), hi taken to hold (ok fails below some point)."""
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def largest_fitting(steps: Sequence[int], probe) -> Optional[Tuple[int, object]]:
    """(step, probe(step)) for the largest of the ascending `steps` whose probe is not None (the
    probe fails above some step and succeeds below it), by bisection; None when none succeeds."""
    best, a, b = None, 0, len(steps) - 1
    while a <= b:
        mid = (a + b) // 2
        got = probe(steps[mid])
        if got is not None:
            best, a = (steps[mid], got), mid + 1
        else:
            b = mid - 1
    return best


def context_range(n_ctx_train: int, max_ctx: int, fit_ctx: int, n_seq: int) -> Tuple[int, int]:
    """(floor, start) of the contexts fit tries when none is set: from the training context capped
    at max_ctx down to fit_ctx, as the contexts n_seq slots make of them."""
    hi = max(1, min(n_ctx_train, max_ctx))
    lo = min(fit_ctx, hi)
    return slot_context(max(lo, n_seq), n_seq), slot_context(max(hi, n_seq), n_seq)


def largest_context(lo: int, hi: int, step: int, probe) -> Optional[Tuple[int, object]]:
    """(context, probe(context)) for `hi` if its probe succeeds, else for the largest of lo, lo +
    step, ... below hi whose probe does; None when none does."""
    got = probe(hi)
    if got is not None:
        return hi, got
    steps: List[int] = list(range(lo, hi, step))
    return largest_fitting(steps, probe)
