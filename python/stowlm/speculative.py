"""Speculative decoding: draft several tokens cheaply, check them all in one pass of the model.

Generation reads every weight once per token; a pass over k + 1 tokens reads them once for all,
so every draft token the model agrees with is a token for (almost) free. Drafts come from the
text itself (:class:`NgramDrafter`: the tokens that followed the last occurrence of the latest
n-gram in the prompt and the text so far; code edits repeat what they were shown) or from a
smaller model with the same vocabulary (:class:`ModelDrafter`, with prompt lookup beside it: each
step drafts from whichever of the two yields more).

Exactness: a pass over several tokens gives each the logits of a one-token step (the CPU's row
kernels below the batch bound and its fixed attention splits; tests/test_speculative.py), so
greedy output is token for token the output without drafts. With temperature > 0 a draft token d
is kept with the probability p(d) the sampler gives it, and on rejection the token is drawn from
p without d, renormalised: the standard scheme for a deterministic draft, whose output follows
the target's distribution.

:class:`Speculator` keeps each request's drafts as long as they pay: their length follows the
share of draft tokens kept, and where almost none are it waits a growing number of steps before
drafting again, so open-ended text is not slowed. A draft model's drafts are weighed by their
acceptance at each draft position against its timed steps, and stop for the rest of a request
once they no longer pay (drafting again would first cost a catch-up of all the text since); while
they pay, a draft runs as long as the draft model is sure of it (P_CHAIN).
"""
from __future__ import annotations

import os
import time
from typing import List, Optional, Sequence, Tuple

import numpy as np

from .text.stream import common_prefix

__all__ = ["NgramDrafter", "ModelDrafter", "Speculator", "PassCosts", "verify", "DRAFT_MAX", "parse_spec",
           "drafter_for"]

DRAFT_MAX = 7   # draft tokens per step (one pass checks them with the pending token: 8 rows, two tiles)
MAX_BACKOFF = 16  # steps without drafting after repeated misses, at most
# What a pass of several tokens costs, in one-token steps (PassCosts): the CPU's row kernels
# stream the weights once per pass and take tokens 4 to a tile (qwen2.5-coder-0.5b, 2 Zen 4 threads, one-row decode kernels: 1.30x for 2 tokens, 1.55x for 4,
# 2.6x for 8, 3.7x for 12). A draft token past the first tile must earn MARGIN times its cost:
# the acceptance it is judged by is an estimate, and a pass already full of sequences loses by
# every token that is not kept.
TILE, IN_TILE, PAST_TILE, MARGIN = 4, 0.18, 0.26, 1.5
# With the weights repacked into 16-row groups (csrc/cpu/repack.h: Model.repacked) a pass's
# extra tokens cost far less (same model and machine, `stowlm-bench -p 1,2,3,4,5,6,8,12 -n 0
# -d 256`: 0.99x for 2 tokens, 1.12x for 4, 1.62x for 8, 2.26x for 12).
IN_TILE_R16, PAST_TILE_R16 = 0.04, 0.13
# On AVX2 CPUs (maddubs + madd where AVX-512 has one vpdpbusd) the repacked kernels are
# compute-bound sooner: qwen2.5-coder-0.5b forced onto AVX2 on the same machine (`STOWLM_ISA=avx2
# stowlm-bench -p 1,2,3,4,6,8,12 -n 0 -d 256 -r 3`, two runs): 1.25x for 2 tokens, 1.68x for 4,
# 2.38x for 8, 3.49x for 12 (the GGUF layout there: 1.23x, 1.73x, 3.0x, 4.4x).
IN_TILE_R16_AVX2, PAST_TILE_R16_AVX2 = 0.23, 0.2
# A pass's attention grows with the context, the weights' part does not: a pass token's attention
# over n cells costs what streaming ATTN_BYTES_PER_MAC bytes of weights per multiply-add would,
# a one-token step's STEP_ATTN times that (its cells come from memory, a pass's tokens share
# them in cache). Fitted on two cores (`stowlm-bench -p 1,2,4,8 -n 0 -d 1024,2048,4096`, Intel
# Xeon): a pass of 8 in steps, measured / modelled, qwen2.5-coder-0.5b 1.78-1.93 / 2.12 at 2048,
# 2.64-2.88 / 2.55 at 4096; smollm2-135m 2.43 / 2.41 at 1024, 2.35 / 2.97 at 2048, 3.64 / 3.66 at
# 4096 (the tile model alone: 1.64 at any depth).
ATTN_BYTES_PER_MAC, STEP_ATTN = 0.5, 1.4
# The tile model's passes were measured on qwen2.5-coder-0.5b at depth 256: a token's attention
# there (256 cells x 43008 multiply-adds, against 391.9 MB of weights a token) is in its constants.
TILE_ATTN = 256 * 43008 * ATTN_BYTES_PER_MAC / 391.9e6
# A draft model's drafts must yield this many times the tokens per second of no draft to start
# (its acceptance and step time are estimates), and drafting stops below MODEL_KEEP times: the
# estimates swing with the text, and a stop ends the request's drafts (Speculator.draft).
MODEL_GAIN, MODEL_KEEP = 1.05, 0.95
# A draft model's draft runs while the product of the probabilities it gives its tokens (its
# chance that all are the model's: on code edits it is calibrated, 0.9-1.0 kept above 0.9) stays
# above P_CHAIN, up to draft_max: replaying qwen2.5-coder-0.5b's drafts of the edits
# (bench/draft_replay.py, a draft step of 0.45 model steps) gave 1.33x against 1.28x for lengths
# from the positions' average acceptance (docs/speculative.md; measured, within the VM's noise).
P_CHAIN = 0.85


def chain_holds(chain: float) -> bool:
    """Whether a draft model's draft goes on past a token: `chain` is the product of the
    probabilities it gave its tokens so far (bench/draft_replay.py replays the same rule)."""
    return chain >= P_CHAIN
POSITION_WINDOW, PRIOR_TRIALS = 20, 5  # a draft position's acceptance: its recent trials and the prior's weight


def tile_costs(repacked: bool = False, isa: str = "avx512") -> tuple:
    """What a pass's extra tokens cost in one-token steps, within the first tile and past it, for
    the CPU kernels that run (`isa`: ops.cpu_info()['active'])."""
    if not repacked:
        return IN_TILE, PAST_TILE
    return (IN_TILE_R16_AVX2, PAST_TILE_R16_AVX2) if isa in ("avx2", "scalar") else (IN_TILE_R16, PAST_TILE_R16)


def prior_cost(n: int, repacked: bool = False, isa: str = "avx512") -> float:
    """A pass of n tokens in one-token steps."""
    inside, past = tile_costs(repacked, isa)
    return 1.0 + inside * (min(n, TILE) - 1) + past * max(0, n - TILE)


class PassCosts:
    """What a pass of n tokens costs in one-token steps at the same depth: the tile model above
    (TILE, IN_TILE, PAST_TILE) for the weights and, given the model's `attention` (a token's
    attention over d cells in one-token steps of depth 0: for_model), each token's attention.
    Fixed, so that which tokens are drafted does not depend on timing noise (a single slow pass
    once learnt made passes of that size look dear for good: they were never timed again, and
    seeded sampling stopped being reproducible). The passes are timed all the same, for the
    one-token step's seconds that a draft model's steps are weighed against. One per LLM or
    batching engine."""

    ALPHA = 0.1

    def __init__(self, repacked: bool = False, isa: str = "avx512", attention=None):
        self.seconds: dict = {}  # tokens in the pass -> moving average of its seconds
        self.repacked = repacked  # the model's CPU weights are in 16-row groups (the cheaper tiles)
        self.isa = isa  # the CPU kernels' instruction set (AVX2's repacked tiles cost more)
        self.attention = attention  # depth -> a pass token's attention in depth-0 steps (None: none)
        self.step: Optional[float] = None  # moving average of a one-token step's seconds, from every pass

    @classmethod
    def for_model(cls, model, repacked: bool = False, isa: str = "avx512") -> "PassCosts":
        """The costs of `model`'s passes (an engine.Model: its attention's multiply-adds against
        the weight bytes a token reads)."""
        per_token, macs = getattr(model, "weight_bytes_per_token", 0), getattr(model, "attention_macs", None)
        attention = (lambda d: macs(d) * ATTN_BYTES_PER_MAC / per_token) if macs and per_token > 0 else None
        return cls(repacked, isa, attention)

    def observe(self, n: int, seconds: float, depth: int = 0) -> None:
        if n < 1 or not seconds > 0:
            return
        old = self.seconds.get(n)
        self.seconds[n] = seconds if old is None else old + self.ALPHA * (seconds - old)
        # every pass says what a step costs: one size alone (while drafts run, no pass is of one
        # token) kept the first steps' time, slow with the graphs still being built, for long
        one = seconds / self.cost(n, depth)
        self.step = one if self.step is None else self.step + self.ALPHA * (one - self.step)

    def cost(self, n: int, depth: int = 0) -> float:
        """A pass of n tokens whose context holds `depth` cells, in one-token steps there."""
        if n <= 1:
            return 1.0
        if self.attention is None:
            return prior_cost(n, self.repacked, self.isa)
        a = float(self.attention(depth)) if depth > 0 else 0.0
        # the weights' part: the tile model less the attention it was measured with, then this
        # model's attention at this depth
        weights = prior_cost(n, self.repacked, self.isa) * (1.0 + STEP_ATTN * TILE_ATTN) - n * TILE_ATTN
        return (weights + n * a) / (1.0 + STEP_ATTN * a)

    def token(self, j: int, depth: int = 0) -> float:
        """What a pass's j-th token (1-based) adds, with the margin it must earn past a tile."""
        if j <= 1:
            return 1.0
        d = self.cost(j, depth) - self.cost(j - 1, depth)
        return d * MARGIN if j > TILE else d

    def step_seconds(self) -> Optional[float]:
        """A one-token step's seconds, from the recent passes of every size."""
        return self.step


class NgramDrafter:
    """Prompt lookup: the tokens after the most recent earlier occurrence of the text's last n
    tokens (n from the longest size down), up to k of them."""

    kind = "ngram"
    cheap = True  # offering more tokens than are checked costs nothing

    def __init__(self, sizes: Sequence[int] = (4, 3, 2, 1)):
        self.sizes = sorted({int(n) for n in sizes}, reverse=True)
        if not self.sizes or self.sizes[-1] < 1:
            raise ValueError(f"n-gram sizes must be >= 1, got {list(sizes)}")

    def draft(self, history: Sequence[int], k: int) -> Tuple[List[int], object]:
        """(up to k tokens, the source: the n-gram size that matched)."""
        if k <= 0 or len(history) < self.sizes[-1] + 1:
            return [], None
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
                return h[i:i + k].tolist(), n
        return [], None

    def accepted(self, history: Sequence[int]) -> None:
        """The text now is `history` (nothing to keep in step)."""


class ModelDrafter:
    """Greedy drafts from a smaller model with the same vocabulary (or the first part of it:
    stowlm.draftmodel --vocab), in a context of its own that follows the accepted text (its cache
    keeps the common prefix, the rest is re-evaluated)."""

    kind = "model"
    cheap = False  # each draft token is a step of the draft model

    def __init__(self, llm, lookup: bool = True):
        from .draftmodel import TOKEN_IDS_KEY

        self.llm = llm
        # Prompt lookup beside the model: where the text repeats what came before (code edits) its
        # drafts are kept as often and cost no draft steps (Speculator.draft weighs the two).
        self.lookup = NgramDrafter() if lookup else None
        ids = (getattr(llm, "metadata", None) or {}).get(TOKEN_IDS_KEY)
        self.to_target = None if ids is None else np.asarray(ids, dtype=np.int64)  # draft id -> target id
        self.to_draft: Optional[np.ndarray] = None  # target id -> draft id (follow() makes it)
        self._cached: List[int] = []  # draft ids
        self.seconds = None  # moving average of one draft step's time
        self.catch_up_seconds = None  # moving average of a catch-up's time per token read

    def follow(self, target) -> None:
        """Checks that the draft's tokens are the target LLM's (all, or those of to_target) and maps
        the target's ids onto the draft's: a token the draft lacks reads as its first character's."""
        mine, theirs = self.llm.tokenizer._tokens, target.tokenizer._tokens
        ids = np.arange(len(mine)) if self.to_target is None else self.to_target
        same = len(ids) == len(mine) == self.llm.model.n_vocab and (self.to_target is not None or
                                                                   len(mine) == len(theirs))
        same = same and target.model.n_vocab == len(theirs) and (len(ids) == 0 or 0 <= ids.min() <= ids.max() <
                                                                 len(theirs))
        if not same or any(mine[i] != theirs[j] for i, j in enumerate(ids.tolist())):
            name = os.path.basename(os.fspath(getattr(self.llm, "path", "draft")))
            raise ValueError(f"the draft model {name} has another vocabulary ({self.llm.model.n_vocab} tokens) than "
                             f"{os.path.basename(os.fspath(target.path))} ({target.model.n_vocab}): its token ids "
                             f"would mean other text")
        if self.to_target is None:
            return
        index = self.llm.tokenizer._token_to_id
        to_draft = np.array([index.get(t[:1], 0) for t in theirs], dtype=np.int64)
        to_draft[ids] = np.arange(len(ids))
        self.to_draft = to_draft

    def _ids(self, history: Sequence[int]) -> List[int]:
        return list(history) if self.to_draft is None else self.to_draft[np.asarray(history)].tolist()

    def _catch_up(self, hist: List[int]) -> Tuple[np.ndarray, int]:
        """The draft's cache brought to `hist` (draft ids): its last logits and how many tokens that took."""
        keep = min(common_prefix(self._cached, hist), len(hist) - 1)
        self.llm.ctx.kv_truncate(keep)
        t0 = time.perf_counter()
        logits = self.llm.ctx.eval(hist[keep:], logits="last")
        n = len(hist) - keep
        if n > 2:  # a catch-up, not a step
            per = (time.perf_counter() - t0) / n
            c = self.catch_up_seconds
            self.catch_up_seconds = per if c is None else c + 0.2 * (per - c)
        self._cached = hist
        return logits, n

    def behind(self, history: Sequence[int]) -> int:
        """Tokens of `history` the draft must read before it can draft (its catch-up)."""
        hist = self._ids(history)
        return len(hist) - min(common_prefix(self._cached, hist), len(hist) - 1)

    def ready(self, prompt: Sequence[int]) -> None:
        """Reads the prompt with the target's prompt (the first draft then costs a step, not a prompt)."""
        hist = self._ids(prompt)
        if 0 < len(hist) < self.llm.ctx.n_ctx:
            self._catch_up(hist)

    def draft(self, history: Sequence[int], k: int) -> Tuple[List[int], object]:
        if k <= 0:
            return [], None
        hist = self._ids(history)
        if len(hist) + k >= self.llm.ctx.n_ctx:
            return [], None
        ctx = self.llm.ctx
        t0 = time.perf_counter()
        logits, n_new = self._catch_up(hist)
        # a step's time: a catch-up of the text after drafts were skipped is not one
        steps = 1 if n_new <= 2 else 0
        seconds = time.perf_counter() - t0 if steps else 0.0
        out: List[int] = []
        chain = 1.0  # the draft's own chance that every token so far is the model's
        for _ in range(k):
            t = int(np.argmax(logits))
            out.append(t)
            chain *= _top_share(logits, t)
            if len(out) == k or not chain_holds(chain):
                break  # a token the draft doubts is checked (almost free) but not built on
            t0 = time.perf_counter()
            logits = ctx.eval([t], logits="last")
            seconds, steps = seconds + time.perf_counter() - t0, steps + 1
        self._cached = hist + out[:-1]  # the last draft token's K/V is not in the cache
        if steps:
            per = seconds / steps
            self.seconds = per if self.seconds is None else self.seconds + 0.2 * (per - self.seconds)
        return (out if self.to_target is None else self.to_target[out].tolist()), "model"


def _top_share(logits: np.ndarray, t: int) -> float:
    """The softmax probability of token t (the largest logit)."""
    return float(1.0 / np.exp(logits - logits[t]).sum())


def parse_spec(spec, lookup: bool = True) -> Optional[object]:
    """None, "ngram", a loaded LLM of a draft model (LLM loads one named by path itself, before
    its target, so that fit counts it; with prompt lookup beside it unless lookup=False), or any
    object with draft(history, k) -> (tokens, source) and `cheap` (True: offering k tokens costs
    no more than offering fewer)."""
    if spec is None or spec is False or spec == "none":
        return None
    if hasattr(spec, "draft") and not isinstance(spec, (str, os.PathLike)):  # a drafter of one's own
        return spec
    if spec == "ngram":
        return NgramDrafter()
    if hasattr(spec, "ctx") and hasattr(spec, "tokenizer"):  # an LLM
        return ModelDrafter(spec, lookup=lookup)
    raise ValueError(f"speculative: 'ngram', a draft model's .gguf path or name, or None; got {spec!r}")


def drafter_for(llm, spec, draft, draft_max: Optional[int], lookup: bool):
    """(drafter, draft_max) of an LLM asked for `spec` (`draft`: the draft model it loaded for it),
    draft_max checked against what one pass of the LLM may check."""
    n = DRAFT_MAX if draft_max is None else draft_max
    if spec is None:
        return None, n
    drafter = parse_spec(draft if draft is not None else spec, lookup=lookup)
    if not isinstance(n, int) or not 1 <= n <= llm._max_draft():
        raise ValueError(f"draft_max must be an integer in [1, {llm._max_draft()}] (a draft and its token stay below "
                         f"the batch bound), got {draft_max!r}")
    if hasattr(drafter, "follow"):  # a draft model: its vocabulary must be ours
        drafter.follow(llm)
    return drafter, n


class Speculator:
    """One request's drafting: how many tokens to draft next, and what drafting has earned.

    The length weighs each further draft token's chance to be kept (the recent acceptance rate,
    a moving average, to the power of its place) against what it adds to the pass (PassCosts.token),
    in tokens a step of the pass without drafts yields per unit of cost: a pass of one sequence
    takes short drafts even when most fail and long ones only while nearly every token is kept;
    in a pass already carrying several sequences only drafts likely to be kept pay. Below a floor
    of acceptance it skips steps."""

    # A first guess at each source's acceptance, kept until its own drafts say otherwise: a longer
    # n-gram match continues right more often.
    PRIOR = {4: 0.8, 3: 0.65, 2: 0.45, 1: 0.25, "model": 0.8}
    PROBE = 8  # a source worth no draft still gets a one-token probe this often, to learn it changed

    def __init__(self, drafter, draft_max: int = DRAFT_MAX, costs: Optional[PassCosts] = None):
        if not isinstance(draft_max, int) or draft_max < 1:
            raise ValueError(f"draft_max must be an integer >= 1, got {draft_max!r}")
        self.drafter, self.draft_max = drafter, draft_max
        self.costs = costs if costs is not None else PassCosts()  # shared by the LLM's requests
        self.rates: dict = {}  # draft source -> moving estimate of P(a draft token is kept | the one before was)
        self.skipped: dict = {}  # draft source -> offers passed over since its last draft
        # A draft model's P(draft j kept | draft j - 1 kept) for each position j: the first token
        # after a miss is kept far less often than one inside a run the draft has right, so one
        # rate for all either drafts long runs that fail or stops drafting where single tokens pay.
        # Each from the last ~POSITION_WINDOW trials of its position and the prior counted as
        # PRIOR_TRIALS of them: a request's first misses move it fast (a few in a row stop a draft
        # that fails from the start), later it keeps steady through the text's swings.
        self.position_kept = [0.0] * draft_max
        self.position_trials = [0.0] * draft_max
        self.model_drafting = False  # the last step's model draft paid (not the first, timing step)
        self.wait = 0        # steps left without drafting
        self.backoff = 1     # the next wait while acceptance stays under the floor
        self.source = None   # of the draft in flight
        self.depth = 0       # cells of context the next pass attends to (its cost grows with them)
        self.drafted = self.accepted = 0

    def rate(self, source) -> float:
        """The source's acceptance: this request's, else the prior."""
        return self.rates.get(source, self.PRIOR.get(source, 0.5))

    def model_rates(self) -> List[float]:
        """A draft model's acceptance per draft position: this request's, from the prior. (Not
        carried from the last request: its text, an open question, says little of this one's, an
        edit, and a request starts with the draft in step, having read the prompt, so its first
        drafts cost no catch-up.)"""
        prior = self.PRIOR["model"]
        return [(k + PRIOR_TRIALS * prior) / (n + PRIOR_TRIALS) for k, n in zip(self.position_kept, self.position_trials)]

    def length(self, rate, n_base: int = 1) -> int:
        """Draft tokens worth checking in a pass that carries n_base tokens without them, each kept
        with probability `rate` given the one before (a draft model's: one rate, or one per position)."""
        if not getattr(self.drafter, "cheap", True):
            return self._model_length(rate, n_base)
        return self._cheap_length(rate, n_base)

    def _cheap_length(self, rate, n_base: int) -> int:
        """length() for drafts that cost nothing to offer (prompt lookup): each further token while
        its chance to be kept is worth what it adds to the pass (past a tile, MARGIN times that)."""
        value = self.costs.cost(n_base, self.depth) / n_base  # of one token, in the pass's own terms
        k, kept = 0, 1.0
        while k < self.draft_max:
            kept *= rate
            if kept * value < self.costs.token(n_base + k + 1, self.depth):
                break
            k += 1
        return k

    def _model_length(self, rate, n_base: int) -> int:
        """A draft model's length: the one that yields the most tokens per unit of time, its steps
        counted in target steps (each draft token is a step of it, so a draft that is cheap per
        token but rarely kept pays only short), if that beats no draft by MODEL_GAIN (MODEL_KEEP
        while drafting)."""
        return self._model_plan(rate, n_base)[0]

    def _model_plan(self, rate, n_base: int, behind: int = 0) -> Tuple[int, float]:
        """(k, tokens per one-token step's time) of the model's draft length that yields the most,
        its draft steps and the catch-up of `behind` tokens (text it has not read: a lookup's)
        counted in target steps; (0, no draft's yield times the gain to beat) when none beats that."""
        step = self.costs.step_seconds()
        d = getattr(self.drafter, "seconds", None)
        c = getattr(self.drafter, "catch_up_seconds", None)
        draft_cost = d / step if d and step else 0.0
        # charged in full to the draft that needs it: spread over the 16 steps after, the model
        # resumed after long lookup runs and did not pay it back (docs/speculative.md)
        catch_up = behind * c / step if behind > 2 and c and step else 0.0
        gain = MODEL_KEEP if self.model_drafting else MODEL_GAIN
        rates = [float(rate)] * self.draft_max if np.isscalar(rate) else list(rate)
        best_k, best, tokens, kept = 0, n_base / self.costs.cost(n_base, self.depth) * gain, float(n_base), 1.0
        for k in range(1, self.draft_max + 1):
            kept *= rates[min(k, len(rates)) - 1]
            tokens += kept
            r = tokens / (self.costs.cost(n_base + k, self.depth) + k * draft_cost + catch_up)
            if r > best:
                best_k, best = k, r
        return best_k, best

    def _lookup_instead(self, history: Sequence[int], budget: int, n_base: int, behind: int) -> List[int]:
        """A draft model's prompt lookup: its draft where that yields more than the model's would
        (the lookup's source's acceptance, no draft steps; against the positions' acceptance at
        the draft's step cost and its catch-up of `behind` tokens), else []."""
        toks, src = self.drafter.lookup.draft(history, min(self.draft_max, budget))
        if not toks:
            return []
        k, model = self._model_plan(self.model_rates(), n_base, behind)
        if k == 0:  # the model would not draft: the lookup is weighed against no draft
            model = n_base / self.costs.cost(n_base, self.depth)
        # its length by the lookup's own rule (as with --spec ngram), its yield against the model's
        k = min(len(toks), self._cheap_length(self.rate(src), n_base))
        r, tokens = self.rate(src), float(n_base)
        for j in range(1, k + 1):
            tokens += r ** j
        if k == 0 or tokens / self.costs.cost(n_base + k, self.depth) <= model:
            return []
        self.source = src
        return toks[:k]

    def ready(self, prompt: Sequence[int]) -> None:
        """The prompt is in the target's cache: a draft model reads it now too."""
        if hasattr(self.drafter, "ready"):
            self.drafter.ready(prompt)

    def timed_pass(self, seconds: float, n_tokens: int) -> None:
        """A pass of the target over n_tokens took this long (what drafts and a draft model's
        steps are weighed against)."""
        self.costs.observe(n_tokens, seconds, self.depth)

    def draft(self, history: Sequence[int], budget: int, n_base: int = 1) -> List[int]:
        """Tokens to follow `history`, as many as pay, at most budget ([] when none do or waiting)."""
        self.source, self.depth = None, len(history)
        if self.wait > 0 or budget <= 0:
            self.wait = max(0, self.wait - 1)
            return []
        if not getattr(self.drafter, "cheap", True):
            behind = 0
            if getattr(self.drafter, "lookup", None) is not None:
                behind = self.drafter.behind(history)
                toks = self._lookup_instead(history, budget, n_base, behind)
                if toks:
                    return toks
            # the positions' acceptance (and the catch-up a lookup left) says whether drafting
            # pays; how far is the draft's own confidence, token by token (P_CHAIN), up to draft_max
            self.model_drafting = self._model_plan(self.model_rates(), n_base, behind)[0] > 0
            k = min(self.draft_max, budget) if self.model_drafting else 0
            if k == 0 and getattr(self.drafter, "seconds", None) is None:
                k = min(1, budget)  # a first draft step learns its cost
            # Once stopped, a request drafts no more with the model, not even a probe: the draft
            # must first read every token since it stopped (a batched catch-up, ~0.1-0.15 of a
            # target step a token on two cores), so probes cost that share of the skipped text
            # whether or not they find drafting paying again (they lost 8-16% on open questions).
            toks, self.source = self.drafter.draft(history, k) if k > 0 else ([], None)
            return toks
        if n_base >= TILE and self.length(max([*self.PRIOR.values(), *self.rates.values()]), n_base) == 0:
            return []  # no draft could pay in this pass and none is probed: skip the lookup itself
        toks, src = self.drafter.draft(history, min(self.draft_max, budget))
        if not toks:
            return []
        k = self.length(self.rate(src), n_base)
        if k == 0:
            self.skipped[src] = self.skipped.get(src, 0) + 1
            if self.skipped[src] < self.PROBE or n_base >= TILE:  # a full tile: no probe is cheap
                return []
            k = 1
        self.skipped[src] = 0
        self.source = src
        return toks[:k]

    def check(self, sampler, rows: np.ndarray, drafts: Sequence[int], history: Sequence[int]) -> Tuple[List[int], int]:
        """verify() of this request's drafts, recorded: (the drafts kept, the token drawn after them)."""
        kept, nxt = verify(sampler, rows, drafts, history)
        self.record(len(drafts), len(kept))
        return kept, nxt

    def record(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.drafted += drafted
        self.accepted += accepted
        # tokens checked one after the other up to the first miss: each a trial of "kept, given
        # the one before was"
        trials = accepted + (accepted < drafted)
        r = self.rate(self.source)
        self.rates[self.source] = r + 0.3 * trials / max(1, drafted) * (accepted / trials - r)
        if self.source == "model":
            keep = 1.0 - 1.0 / POSITION_WINDOW
            for j in range(min(accepted + 1, drafted)):  # the positions checked: up to the first miss
                self.position_kept[j] = self.position_kept[j] * keep + float(j < accepted)
                self.position_trials[j] = self.position_trials[j] * keep + 1.0
        if max(self.rates.values()) < 0.1:
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
