"""The context every rank of a job makes: an LLM's default, or (as fit chooses it) the largest
whose layer split fits the job's devices."""
from __future__ import annotations

from typing import Callable, List

from ..placement.rules import CTX_STEP, DEFAULT_FIT_CTX, DEFAULT_MAX_CTX, DEFAULT_N_CTX, slot_context
from ..placement.search import context_range, largest_context


def trained_ctx(path: str) -> int:
    from ..gguffile import GGUFFile

    with GGUFFile(path) as f:
        meta = f.metadata
    return int(meta.get(f"{meta['general.architecture']}.context_length", DEFAULT_N_CTX))


def llm_ctx(path: str, n_seq: int) -> int:
    """The context an LLM makes when given none (in whole slots)."""
    from ..loading import _default_ctx

    return slot_context(_default_ctx(trained_ctx(path), None, n_seq), n_seq)


def fit_ctx(path: str, n_seq: int, split_at: Callable, decisions: List[str]):
    """As fit does when the user set no context: each slot's context from the trained one (capped at
    DEFAULT_MAX_CTX) down to DEFAULT_FIT_CTX in steps of CTX_STEP, the largest whose layer split
    fits (split_at(n_ctx, steps) raises MemoryError when none does). Returns (n_ctx of all slots, split)."""
    trained = trained_ctx(path)
    floor, top = context_range(trained, DEFAULT_MAX_CTX, DEFAULT_FIT_CTX, 1)  # one slot's range
    total = lambda per: slot_context(per * n_seq, n_seq)  # noqa: E731 - what the context will make
    tried: dict = {}

    def attempt(per):
        if per not in tried:
            steps: List[str] = []
            try:
                tried[per] = (split_at(total(per), steps), steps)
            except MemoryError as e:
                tried[per] = (None, e)
        return tried[per]

    best = largest_context(floor, top, CTX_STEP, lambda per: attempt(per)[0])
    if best is None:
        raise attempt(floor)[1]
    lo = best[0]
    split, steps = attempt(lo)
    why = f"the training context {trained}" + (f" capped at max_ctx {DEFAULT_MAX_CTX}" if trained > top else "")
    decisions.append(f"n_ctx {total(lo)}: {why}" + (f" per slot x {n_seq} slots" if n_seq > 1 else "") if lo == top else
                     f"n_ctx {total(top)} -> {total(lo)}: the largest (steps of {CTX_STEP} per slot, floor {floor}) "
                     f"whose layers fit the job's devices ({why})")
    decisions += steps
    return total(lo), split
