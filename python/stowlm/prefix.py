"""How much of a cached prefix a new prompt keeps, and in which passes the rest goes, so that
the cache afterwards holds the bits a fresh evaluation of the prompt would.

A token's product depends on its pass only through which kernels the pass's size selects (the
model's batch_bounds: below the first, the row kernels; from it, the batched ones, whose result
for a token is the same in any batch that takes them). A fresh evaluation goes in chunks that end
at multiples of `chunk` positions, so every token has the kernel class of its chunk's pass; a
cached token is reused only where it was made with that class, and the rest of its chunk goes in
one pass that takes it too (forced onto the batched kernels however short, where the context
offers that: CPU devices). With routed experts an expert's kernels follow how many tokens of the
pass picked it, and a GPU context of one sequence splits the KV cells by the call's size, so there
a prefix is reused at whole chunks only, whose passes depend on the prompt alone. LLM and the
batching engine share this.
"""
from __future__ import annotations

import bisect
from typing import List, Sequence, Tuple

from .text.stream import common_prefix

__all__ = ["PrefixReuse"]


class PrefixReuse:
    """The reuse rules of one context: chunk (positions per fresh pass), bounds (the model's
    batch_bounds), forced (a short pass may take the batched kernels), whole_chunks (reuse only at
    chunk boundaries)."""

    def __init__(self, chunk: int, bounds: Sequence[int], forced: bool, whole_chunks: bool):
        self.chunk, self.bounds = int(chunk), list(bounds)
        self.forced, self.whole_chunks = bool(forced), bool(whole_chunks)

    @classmethod
    def of(cls, ctx, model, chunk: int) -> "PrefixReuse":
        """The rules for `ctx` over `model`, in chunks of `chunk` positions."""
        can_force = ctx.can_force_batched
        # routed experts, or one sequence on a GPU (whose attention splits the cells by the call's size)
        whole = model.n_expert > 0 or (ctx.n_seq == 1 and not can_force)
        return cls(chunk, model.batch_bounds, can_force and not whole, whole)

    def kernels(self, n: int) -> int:
        """Which kernels a pass of n tokens takes: the number of batch bounds it reaches."""
        return bisect.bisect_right(self.bounds, n)

    def reusable(self, cached: Sequence[int], kernels: Sequence[int], tokens: Sequence[int]) -> int:
        """How many cached tokens (kernels: each one's pass's kernel class) a prompt `tokens`
        keeps: a common prefix of tokens made by the kernels that a fresh evaluation would use for
        them, cut so that the rest of its chunk, evaluated in one pass, still takes the same
        kernels. At least one token is left to evaluate."""
        k = min(common_prefix(cached, tokens), len(kernels), len(tokens) - 1)
        if self.whole_chunks:
            return k - k % self.chunk
        for c in range(0, k, self.chunk):
            want = self.kernels(min(self.chunk, len(tokens) - c))
            bad = next((i for i in range(c, min(c + self.chunk, k)) if kernels[i] != want), None)
            if bad is not None:
                k = bad
                break
        c0 = k - k % self.chunk
        size = min(self.chunk, len(tokens) - c0)  # the fresh pass of k's chunk
        cls = self.kernels(size)
        if self.forced and cls == len(self.bounds):
            return k  # the rest goes in a pass forced onto the batched kernels, however short
        smallest = self.bounds[cls - 1] if cls else 1  # the smallest pass taking the same kernels
        return min(k, c0 + size - smallest)

    def next_pass(self, pos: int, end: int) -> Tuple[int, int, bool]:
        """The pass of prompt positions from pos (up to end, the prompt's length): (tokens, kernel
        class of its chunk, whether it must be forced onto the batched kernels)."""
        n = min(end, (pos // self.chunk + 1) * self.chunk) - pos  # up to the next chunk boundary
        cls = self.kernels(pos % self.chunk + n)  # the class of the chunk's fresh pass
        forced = self.forced and cls == len(self.bounds) and self.kernels(n) < cls
        return n, cls, forced

    def classes(self, start: int, end: int) -> List[int]:
        """The kernel class of each position in [start, end) when evaluated from a chunk boundary
        `start` in one call (which splits it at chunk boundaries)."""
        out: List[int] = []
        for c in range(start, end, self.chunk):
            n = min(self.chunk, end - c)
            out += [self.kernels(n)] * n
        return out
