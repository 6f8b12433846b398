"""Speculative decoding: draft several tokens cheaply, check them all in one pass of the model.

Generation reads every weight once per token; a pass over k + 1 tokens reads them once for all,
so every draft token the model agrees with is a token for (almost) free. Drafts come from the
text itself (:class:`NgramDrafter`: the tokens that followed the last occurrence of the latest
n-gram in the prompt and the text so far; code edits repeat what they were shown) or from a
smaller model with the same vocabulary (:class:`ModelDrafter`).

Exactness: a pass over several tokens gives each the logits of a one-token step (the CPU's row
kernels below the batch bound and its fixed attention splits; tests/test_speculative.py), so
greedy output is token for token the output without drafts. With temperature > 0 a draft token d
is kept with the probability p(d) the sampler gives it, and on rejection the token is drawn from
p without d, renormalised: the standard scheme for a deterministic draft, whose output follows
the target's distribution.

:class:`Speculator` keeps each request's drafts as long as they pay: their length follows the
share of draft tokens kept, and where almost none are it waits a growing number of steps before
drafting again, so open-ended text is not slowed.
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["NgramDrafter", "ModelDrafter", "Speculator", "verify", "DRAFT_MAX", "parse_spec"]

DRAFT_MAX = 7   # draft tokens per step (one pass checks them with the pending token: 8 rows, two tiles)
MAX_BACKOFF = 16  # steps without drafting after repeated misses, at most


class NgramDrafter:
    """Prompt lookup: the tokens after the most recent earlier occurrence of the text's last n
    tokens (n from the longest size down), up to k of them."""

    kind = "ngram"

    def __init__(self, sizes: Sequence[int] = (4, 3, 2, 1)):
        self.sizes = sorted({int(n) for n in sizes}, reverse=True)
        if not self.sizes or self.sizes[-1] < 1:
            raise ValueError(f"n-gram sizes must be >= 1, got {list(sizes)}")

    def draft(self, history: Sequence[int], k: int) -> List[int]:
        if k <= 0 or len(history) < self.sizes[-1] + 1:
            return []
        h = np.asarray(history, dtype=np.int64)
        for n in self.sizes:
            if len(h) <= n:
                continue
            tail = h[-n:]
            # windows h[i:i+n] for i < len - n (an occurrence with at least one token after it)
            win = np.lib.stride_tricks.sliding_window_view(h[:-1], n)
            hits = np.flatnonzero((win == tail).all(axis=1))
            if hits.size:
                i = int(hits[-1]) + n
                return h[i:i + k].tolist()
        return []

    def accepted(self, history: Sequence[int]) -> None:
        """The text now is `history` (nothing to keep in step)."""


class ModelDrafter:
    """Greedy drafts from a smaller model with the same vocabulary, in a context of its own that
    follows the accepted text (its cache keeps the common prefix, the rest is re-evaluated)."""

    kind = "model"

    def __init__(self, llm):
        self.llm = llm
        self._cached: List[int] = []

    def draft(self, history: Sequence[int], k: int) -> List[int]:
        if k <= 0:
            return []
        ctx, hist = self.llm.ctx, list(history)
        if len(hist) + k >= ctx.n_ctx:
            return []
        keep = 0
        for a, b in zip(self._cached, hist):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(hist) - 1)
        ctx.kv_truncate(keep)
        logits = ctx.eval(hist[keep:], logits="last")
        self._cached = hist
        out: List[int] = []
        for _ in range(k):
            t = int(np.argmax(logits))
            out.append(t)
            if len(out) == k:
                break
            logits = ctx.eval([t], logits="last")
        self._cached = hist + out[:-1]  # the last draft token's K/V is not in the cache
        return out

    def accepted(self, history: Sequence[int]) -> None:
        pass


def parse_spec(spec) -> Optional[object]:
    """None, "ngram", a .gguf path / model name of a draft model (loaded here), an LLM, or any
    object with draft(history, k) -> tokens."""
    if spec is None or spec is False or spec == "none":
        return None
    if hasattr(spec, "draft") and not isinstance(spec, (str, os.PathLike)):  # a drafter of one's own
        return spec
    if spec == "ngram":
        return NgramDrafter()
    if isinstance(spec, (str, os.PathLike)):
        from .llm import LLM

        return ModelDrafter(LLM(spec, progress=False))
    if hasattr(spec, "ctx") and hasattr(spec, "tokenizer"):  # an LLM
        return ModelDrafter(spec)
    raise ValueError(f"speculative: 'ngram', a draft model's .gguf path or name, or None; got {spec!r}")


class Speculator:
    """One request's drafting: how many tokens to draft next, and what drafting has earned.

    The length follows the recent acceptance rate of draft tokens (a moving average): a pass of
    up to 4 tokens costs a CPU little more than one (its weights stream once and the row kernels
    take 4 tokens per tile), so short drafts pay even when most fail, and drafts grow past the
    first tile only while nearly every token is kept. Below a floor of acceptance it skips steps.
    """

    def __init__(self, drafter, draft_max: int = DRAFT_MAX):
        if not isinstance(draft_max, int) or draft_max < 1:
            raise ValueError(f"draft_max must be an integer >= 1, got {draft_max!r}")
        self.drafter, self.draft_max = drafter, draft_max
        self.rate = 0.5      # moving average of the share of draft tokens kept
        self.wait = 0        # steps left without drafting
        self.backoff = 1     # the next wait while acceptance stays under the floor
        self.drafted = self.accepted = 0

    @property
    def length(self) -> int:
        a = self.rate
        k = 7 if a >= 0.85 else 3 if a >= 0.45 else 2 if a >= 0.25 else 1
        return min(k, self.draft_max)

    def draft(self, history: Sequence[int], budget: int) -> List[int]:
        """Up to min(length, budget) tokens to follow `history` ([] when waiting or none found)."""
        if self.wait > 0:
            self.wait -= 1
            return []
        return self.drafter.draft(history, min(self.length, budget))

    def record(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.drafted += drafted
        self.accepted += accepted
        self.rate += 0.3 * (accepted / drafted - self.rate)
        if self.rate < 0.1:
            self.wait, self.backoff = self.backoff, min(MAX_BACKOFF, self.backoff * 2)
        else:
            self.backoff = 1


def verify(sampler, rows: np.ndarray, drafts: Sequence[int], history: Sequence[int]) -> Tuple[List[int], int]:
    """Checks drafts against the model's rows (row i: the logits after the pending token and the
    first i drafts; history: the text up to the pending token). Returns (the drafts kept, the
    token drawn after them): the one that replaced the first rejected draft, or the next one."""
    hist = list(history)
    for i, d in enumerate(drafts):
        tok, ok = sampler.sample_draft(rows[i], hist, d)
        if not ok:
            return list(drafts[:i]), tok
        hist.append(d)
    return list(drafts), sampler.sample(rows[len(drafts)], hist)
