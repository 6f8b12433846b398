"""Continuous batching: several requests share one context, each in its own sequence (slot).

One engine thread runs the loop: waiting requests take free slots (the slot that can keep the
longest prefix of its cache for the new prompt, so a follow-up turn only evaluates its new
tokens); every step decodes one token for every generating slot in a single forward pass, then
evaluates one chunk of one waiting prompt, so new prompts join between steps while the others
keep generating. A finished or cancelled request frees its slot at once.

Batching does not change results, so the greedy text of a request is the same alone and among
others: each slot owns an equal region of the KV cells and attention splits the cells on fixed
boundaries (kv_cache.h); a prompt is evaluated in chunks of its own that end at multiples of
`chunk` positions; and a token's product depends on its batch only through which kernels the
batch's size selects (the model's batch_bounds: below the first, the row kernels; from it, the
batched ones, whose result for a token is the same in any batch that takes them). So decode
tokens go in batches below the first bound, and a slot's cached prompt tokens are reused where
they were made by the kernels a fresh evaluation of the new prompt would use for them, and the
rest of that chunk is evaluated in one pass that takes those kernels too (forced onto the batched
kernels however short it is, where the context offers that: CPU devices), so a reused cache
holds exactly what evaluating the prompt afresh would, and so do the tokens after it. (With routed
experts an expert's kernels follow how many tokens of the pass picked it, and a GPU context of
one sequence splits the KV cells by the call's size, so there a prefix is reused at whole chunks
only, whose passes depend on the prompt alone.)
"""
from __future__ import annotations

import atexit
import bisect
import collections
import math
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional, Sequence

import numpy as np

from .sampling import Sampler, SamplingParams, TextStream
from .speculative import Speculator, verify

__all__ = ["BatchEngine", "Request", "QueueFull", "Event"]

DEFAULT_CHUNK = 256    # prompt tokens per step (and the granularity of prefix reuse)


# Engines still running at exit are stopped first: their threads hold the model, which would
# otherwise outlive the interpreter's teardown (and nanobind reports it as a leak).
_running: "weakref.WeakSet[BatchEngine]" = weakref.WeakSet()
atexit.register(lambda: [e.close() for e in list(_running)])


class QueueFull(RuntimeError):
    """More requests are waiting than the engine's queue holds."""


@dataclass
class Event:
    """What a request produced: a piece of text (kind "piece": its token id, and with logprobs
    requested the token's log-probability and the top alternatives) or the end (kind "done")."""

    kind: str
    text: str = ""
    token: Optional[int] = None
    logprob: Optional[float] = None
    top_logprobs: Optional[List[tuple]] = None  # [(token id, logprob)], best first
    finish_reason: Optional[str] = None  # done: "stop", "length", "cancelled" or "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: Optional[str] = None
    drafted: int = 0   # done: speculative draft tokens checked for the request, and kept
    accepted: int = 0


@dataclass
class Request:
    tokens: List[int]
    params: SamplingParams
    on_event: Callable[[Event], None]
    logprobs: Optional[int] = None  # None: no logprobs; N: the chosen token's and the best N
    grammar: Optional[object] = None  # stowlm.grammar.Grammar (or anything with start()): the text it allows
    special: bool = False  # control tokens stay in the text (a tool format's markers)
    speculative: bool = True  # draft where the engine's LLM drafts (stowlm.speculative)
    cancelled: bool = False
    submitted: float = field(default_factory=time.perf_counter)
    first_token_at: Optional[float] = None

    def cancel(self) -> None:
        self.cancelled = True


class _Slot:
    def __init__(self, index: int):
        self.index = index
        self.cached: List[int] = []   # tokens whose K/V this slot's sequence holds, in order
        self.kernels: List[int] = []  # per leading cached prompt token: its pass's kernel class
        self.req: Optional[Request] = None
        self.pos = 0                  # next prompt token to evaluate
        self.pending: Optional[int] = None  # sampled, not yet evaluated
        self.history: List[int] = []
        self.sampler: Optional[Sampler] = None
        self.stream: Optional[TextStream] = None
        self.constraint = None        # the request's grammar, where it has one
        self.spec = None              # its speculative drafting (stowlm.speculative.Speculator)


class BatchEngine:
    """Serves requests on `llm`'s context (an LLM made with n_seq slots) from its own thread.

    submit() may be called from any thread; events go to each request's on_event from the engine
    thread, and after each step every function of step_listeners is called (a consumer that
    hands events to another thread can wake it once per step there). A prompt longer than a
    slot's share of the context (n_ctx / n_seq) is refused with ValueError naming both lengths; a
    request that would wait behind max_queue others while every slot is busy raises QueueFull."""

    def __init__(self, llm, chunk: Optional[int] = None, max_queue: int = 64):
        self.llm = llm
        self.ctx = llm.ctx
        self.n_seq = self.ctx.n_seq
        self.slot_ctx = self.ctx.n_ctx // self.n_seq
        self.chunk = min(chunk or DEFAULT_CHUNK, self.ctx.n_ubatch)
        self.max_queue = max_queue
        self.bounds = list(llm.model.batch_bounds)
        self.max_decode = self.bounds[0] - 1 if self.bounds else 1 << 30  # decode batches stay on the row kernels
        self.drafter, self.draft_max = getattr(llm, "_drafter", None), getattr(llm, "draft_max", 0)
        if self.drafter is not None and getattr(self.drafter, "llm", None) is not None:
            raise ValueError("a draft model drafts for one sequence: serve it with one slot (n_seq=1, --parallel 1), "
                             "or draft with 'ngram'")
        can_force = self.ctx.can_force_batched
        # prefixes reused at chunk boundaries only: with routed experts, and in a context of one
        # sequence on a GPU (its attention splits the cells by how many tokens the call has)
        self.whole_chunks = llm.model.n_expert > 0 or (self.n_seq == 1 and not can_force)
        # a prompt's tail after a reused prefix may go in a pass of any size on the batched kernels
        self.forced = can_force and not self.whole_chunks
        self.slots = [_Slot(i) for i in range(self.n_seq)]
        self.ctx.clear()  # the slots start empty, whatever the context held
        self.queue: Deque[Request] = collections.deque()
        self.cv = threading.Condition()
        self.running = True
        self._rr = 0
        self.step_listeners: List[Callable[[], None]] = []
        self._mask_pool = None  # the thread that fills grammar masks during forward passes
        # metrics
        self.requests_total = 0
        self.prompt_tokens_total = 0
        self.prompt_tokens_evaluated = 0  # less than the total by what cached prefixes saved
        self.completion_tokens_total = 0
        self.drafted_total = 0
        self.accepted_total = 0
        self._recent: Deque[tuple] = collections.deque()  # (time, tokens) of recent decode steps
        self.thread = threading.Thread(target=self._loop, name="stowlm-engine", daemon=True)
        self.thread.start()
        _running.add(self)

    # -- from any thread ------------------------------------------------------------------------
    def submit(self, tokens: Sequence[int], params: SamplingParams, on_event: Callable[[Event], None],
               logprobs: Optional[int] = None, grammar=None, special: bool = False,
               speculative: bool = True) -> Request:
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("the prompt is empty (no tokens)")
        if len(tokens) >= self.ctx.n_ctx:
            raise ValueError(f"the prompt has {len(tokens)} tokens, but the context holds {self.ctx.n_ctx} cells in all "
                             f"({self.n_seq} slots of {self.slot_ctx}; a long request takes the cells of idle slots), "
                             "with room for at least one generated token")
        Sampler(params, vocab_size=self.llm.model.n_vocab)  # validate now, in the caller's thread
        req = Request(tokens, params, on_event, logprobs, grammar, special, speculative)
        with self.cv:
            if not self.running:
                raise RuntimeError("the engine is stopped")
            busy = sum(1 for sl in self.slots if sl.req)
            if busy + len(self.queue) >= self.n_seq + self.max_queue:  # every slot busy and the queue full
                raise QueueFull(f"all {self.n_seq} slots are busy and {len(self.queue)} requests are waiting "
                                f"(queue limit {self.max_queue})")
            self.queue.append(req)
            self.requests_total += 1
            self.cv.notify()
        return req

    def cancel(self, req: Request) -> None:
        with self.cv:
            req.cancel()
            self.cv.notify()

    def close(self) -> None:
        with self.cv:
            self.running = False
            self.cv.notify()
        self.thread.join()
        if self._mask_pool is not None:
            self._mask_pool.shutdown()
        _running.discard(self)

    def stats(self) -> Dict[str, float]:
        with self.cv:
            now = time.perf_counter()
            while self._recent and now - self._recent[0][0] > 10.0:
                self._recent.popleft()
            recent = sum(n for _, n in self._recent)
            return {"requests_total": self.requests_total, "prompt_tokens_total": self.prompt_tokens_total,
                    "completion_tokens_total": self.completion_tokens_total, "queue_length": len(self.queue),
                    "drafted_total": self.drafted_total, "accepted_total": self.accepted_total,
                    "prompt_tokens_evaluated": self.prompt_tokens_evaluated,
                    "slots_busy": sum(1 for s in self.slots if s.req), "slots": self.n_seq,
                    "kv_cells_used": self.ctx._c.n_cells_used, "kv_cells": self.ctx.n_ctx,
                    "tokens_per_second": recent / 10.0}

    # -- the engine thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self.cv:
                while self.running and not self.queue and not any(s.req for s in self.slots):
                    self.cv.wait()
                if not self.running:
                    for s in self.slots:
                        if s.req:
                            self._finish(s, "cancelled")
                    while self.queue:
                        self.queue.popleft().on_event(Event("done", finish_reason="cancelled"))
                    self._step_done()
                    return
                self._admit()
            for s in self.slots:
                if s.req and s.req.cancelled:
                    self._finish(s, "cancelled")
            try:
                self._decode_step()
                self._step_done()
                self._prompt_step()
            except Exception as e:  # a failed step ends the requests it touched, not the engine
                for s in self.slots:
                    if s.req:
                        self._finish(s, "error", str(e))
            self._step_done()

    def _step_done(self) -> None:
        for fn in list(self.step_listeners):
            fn()

    def _admit(self) -> None:
        waiting = []  # requests that need more idle slots than there are now: they keep their turn
        while self.queue:
            req = self.queue.popleft()
            if req.cancelled:
                req.on_event(Event("done", finish_reason="cancelled", prompt_tokens=len(req.tokens)))
                continue
            need = -(-(len(req.tokens) + 1) // self.slot_ctx)  # regions: the prompt and one token
            # the slots whose next `need` regions are idle; of them the one that keeps the most of
            # its cache (a follow-up turn reuses it), else the one caching least, so that other
            # caches stay for later requests
            starts = [s for s in self.slots if s.index + need <= self.n_seq
                      and all(self._idle(q, s) for q in range(s.index, s.index + need))]
            if not starts:
                waiting.append(req)
                if not any(not s.req for s in self.slots):
                    break
                continue
            # a request that may outgrow its regions prefers a start with idle regions after them
            want = -(-(len(req.tokens) + (req.params.max_tokens or self.ctx.n_ctx)) // self.slot_ctx)
            keep, _, _, best = max(((self._reusable(s, req.tokens), self._room(s, want), -len(s.cached), s)
                                    for s in starts), key=lambda x: (x[0], x[1], x[2], -x[3].index))
            self._claim(best, need)
            if keep < len(best.cached):
                self.ctx.kv_truncate(keep, seq=best.index)
                del best.cached[keep:]
            del best.kernels[keep:]
            best.req, best.pos, best.pending = req, keep, None
            best.history = list(req.tokens)
            best.sampler = Sampler(req.params, vocab_size=self.llm.model.n_vocab)
            best.stream = TextStream(self.llm.tokenizer, req.params, skip_special=not req.special)
            best.constraint = req.grammar.start() if req.grammar is not None else None
            best.spec = Speculator(self.drafter, self.draft_max) \
                if self.drafter is not None and req.grammar is None and req.speculative else None
            self.prompt_tokens_total += len(req.tokens)
        self.queue.extendleft(reversed(waiting))

    # -- regions: a long request holds the cells of the idle slots after its own ---------------------
    def _room(self, s: _Slot, want: int) -> int:
        """How many regions from slot s's own, up to want, are idle for it."""
        n = 0
        while n < want and s.index + n < self.n_seq and self._idle(s.index + n, s):
            n += 1
        return n

    def _idle(self, q: int, start: _Slot) -> bool:
        """Whether slot q's region can go to a request starting at slot `start`: q serves nothing,
        and neither does the slot holding q's region, if another holds it."""
        if self.slots[q].req is not None:
            return False
        h = self.ctx.kv_held_by(q)
        return h is None or h == start.index or self.slots[h].req is None

    def _shrink(self, h: _Slot, n: int) -> None:
        """Slot h keeps n regions (its cache cut to fit)."""
        cap = n * self.slot_ctx
        if len(h.cached) > cap:
            self.ctx.kv_truncate(cap, seq=h.index)
            del h.cached[cap:]
            del h.kernels[cap:]
        self.ctx.kv_span(h.index, n)

    def _claim(self, s: _Slot, need: int) -> None:
        """Slot s holds its own region and the need - 1 after it: each is taken from an idle slot
        holding it (whose cache is cut to what it keeps) and emptied."""
        for q in range(s.index, s.index + need):
            h = self.ctx.kv_held_by(q)
            if h is not None and h != s.index:
                self._shrink(self.slots[h], q - h)
            if q == s.index:
                continue
            if self.ctx.kv_span_of(q) > 1:
                self._shrink(self.slots[q], 1)
            if self.slots[q].cached:
                self.ctx.kv_truncate(0, seq=q)
                self.slots[q].cached, self.slots[q].kernels = [], []
        if need > self.ctx.kv_span_of(s.index):
            self.ctx.kv_span(s.index, need)

    def _grow(self, s: _Slot) -> bool:
        """One more region for slot s, whose cells are full, where the next is idle and no request
        waits for it."""
        nxt = s.index + self.ctx.kv_span_of(s.index)
        if nxt >= self.n_seq or self.queue or not self._idle(nxt, s):
            return False
        self._claim(s, nxt - s.index + 1)
        return True

    def _kernels(self, n: int) -> int:
        """Which kernels a pass of n tokens takes: the number of batch bounds it reaches."""
        return bisect.bisect_right(self.bounds, n)

    def _reusable(self, s: _Slot, tokens: List[int]) -> int:
        """How many of slot s's cached tokens a request for `tokens` keeps: a common prefix of
        prompt tokens, each made by the kernels that a fresh evaluation of `tokens` would use for
        it (those of its chunk's size), cut so that the rest of its chunk, evaluated in one pass,
        is still large enough to take the same kernels. At least one token is left to evaluate."""
        k = min(_common_prefix(s.cached, tokens), len(s.kernels), len(tokens) - 1)
        if self.whole_chunks:
            return k - k % self.chunk
        for c in range(0, k, self.chunk):
            want = self._kernels(min(self.chunk, len(tokens) - c))
            bad = next((i for i in range(c, min(c + self.chunk, k)) if s.kernels[i] != want), None)
            if bad is not None:
                k = bad
                break
        c0 = k - k % self.chunk
        size = min(self.chunk, len(tokens) - c0)  # the fresh pass of k's chunk
        cls = self._kernels(size)
        if self.forced and cls == len(self.bounds):
            return k  # the rest goes in a pass forced onto the batched kernels, however short
        smallest = self.bounds[cls - 1] if cls else 1  # the smallest pass taking the same kernels
        return min(k, c0 + size - smallest)

    def _decode_step(self) -> None:
        gen = [s for s in self.slots if s.req and s.pending is not None]
        if not gen:
            return
        drafts = {s.index: self._drafts(s, min(len(gen), self.max_decode)) for s in gen if s.spec is not None}
        b = 0
        while b < len(gen):
            # as many slots as the pass takes below the batch bound, each its pending token and drafts
            group, n = [], 0
            while b < len(gen) and n + 1 <= self.max_decode:
                s = gen[b]
                d = drafts.get(s.index, [])[:self.max_decode - n - 1]
                drafts[s.index] = d
                group.append(s)
                n += 1 + len(d)
                b += 1
            masks = self._masks_during(group)  # the grammars' next masks, filled while the pass runs
            toks, seqs, first = [], [], []
            for s in group:
                first.append(len(toks))
                toks += [s.pending] + drafts.get(s.index, [])
                seqs += [s.index] * (1 + len(drafts.get(s.index, [])))
            t0 = time.perf_counter()
            logits = self.ctx.eval_batch(toks, seqs, rows=list(range(len(toks))))
            for s in group:
                if s.spec is not None:
                    s.spec.timed_pass(time.perf_counter() - t0, len(toks))
            with self.cv:
                self._recent.append((time.perf_counter(), len(group)))
            masks = masks()
            for s, r0 in zip(group, first):
                s.cached.append(s.pending)
                s.pending = None
                d = drafts.get(s.index, [])
                if d:
                    self._check_drafts(s, d, logits[r0:r0 + 1 + len(d)])
                else:
                    self._next_token(s, logits[r0], masks.get(s.index))

    def _drafts(self, s: _Slot, n_base: int) -> List[int]:
        """Draft tokens to follow the slot's pending one, within its budget of tokens and cells,
        as many as pay in a pass carrying n_base pending tokens."""
        cap = self.ctx.capacity(s.index)
        left = (s.req.params.max_tokens - s.stream.n_tokens) if s.req.params.max_tokens is not None else cap
        room = cap - len(s.cached) - 2  # the pending token, and one cell to sample into
        return s.spec.draft(s.history, min(left - 1, room), n_base)

    def _check_drafts(self, s: _Slot, drafts: List[int], rows: np.ndarray) -> None:
        """The pass's rows for the slot's pending token and drafts: keep the drafts the sampler
        agrees with, emit them, then the token after them; the cache drops the rest."""
        if s.req.cancelled:
            self._finish(s, "cancelled")
        else:
            kept, nxt = verify(s.sampler, rows, drafts, s.history)
            s.spec.record(len(drafts), len(kept))
            with self.cv:
                self.drafted_total += len(drafts)
                self.accepted_total += len(kept)
            going = True
            for i, d in enumerate(kept):
                going = self._take(s, d, rows[i], in_cache=True)
                if not going:
                    break
            if going:
                self._take(s, nxt, rows[len(kept)])
        self.ctx.kv_truncate(len(s.cached), seq=s.index)  # the drafts not kept leave the cache

    def _prompt_step(self) -> None:
        pre = [s for s in self.slots if s.req and s.pending is None and s.pos < len(s.req.tokens)]
        if not pre:
            return
        s = pre[self._rr % len(pre)]
        self._rr += 1
        toks = s.req.tokens[s.pos:(s.pos // self.chunk + 1) * self.chunk]  # up to the next chunk boundary
        last = s.pos + len(toks) == len(s.req.tokens)
        # the kernels of the whole chunk, which a tail after a reused prefix is forced onto
        chunk = self._kernels(s.pos % self.chunk + len(toks))
        forced = self.forced and chunk == len(self.bounds) and self._kernels(len(toks)) < chunk
        masks = self._masks_during([s] if last else [])
        logits = self.ctx.eval_batch(toks, [s.index] * len(toks), rows=[len(toks) - 1] if last else [],
                                     batched=forced)
        s.cached += toks
        s.kernels += [chunk] * len(toks)
        s.pos += len(toks)
        with self.cv:
            self.prompt_tokens_evaluated += len(toks)
        if last:
            self._next_token(s, logits[0], masks().get(s.index))

    def _masks_during(self, slots: Sequence[_Slot]) -> Callable[[], Dict[int, np.ndarray]]:
        """Starts filling the masks of the slots' grammars on the mask thread (llguidance runs
        without the GIL, as does the forward pass) and returns the call that waits for them: the
        next token's mask depends only on the tokens already drawn, so it overlaps the pass."""
        if not any(s.constraint is not None and s.constraint.active for s in slots):
            return dict
        if self._mask_pool is None:
            import concurrent.futures

            self._mask_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stowlm-masks")
        return self._mask_pool.submit(_masks, list(slots)).result

    def _next_token(self, s: _Slot, logits: np.ndarray, allowed: Optional[np.ndarray] = None) -> None:
        req = s.req
        if req.cancelled:
            self._finish(s, "cancelled")
            return
        self._take(s, s.sampler.sample(logits, s.history, allowed), logits)

    def _take(self, s: _Slot, tok: int, logits: np.ndarray, in_cache: bool = False) -> bool:
        """The drawn token into the request's text and events (logprobs from `logits`, the row it
        was drawn from). in_cache: a kept draft, whose K/V the pass already holds. Returns whether
        the request goes on."""
        req = s.req
        s.history.append(tok)
        if s.constraint is not None and not self.llm.tokenizer.is_eog(tok):
            s.constraint.accept(tok)
        if req.first_token_at is None:
            req.first_token_at = time.perf_counter()
        ev = Event("piece", token=tok)
        if req.logprobs is not None:
            lp = _log_softmax(logits)
            ev.logprob = float(lp[tok])
            if req.logprobs > 0:
                top = np.argpartition(-lp, req.logprobs - 1)[:req.logprobs]
                top = top[np.argsort(-lp[top], kind="stable")]
                ev.top_logprobs = [(int(t), float(lp[t])) for t in top]
        ev.text = s.stream.feed(tok)
        req.on_event(ev)
        with self.cv:
            self.completion_tokens_total += 1
        if s.stream.finished:
            self._finish(s, s.stream.finish_reason)
        elif s.constraint is not None and s.constraint.done:
            self._finish(s, "stop")  # the grammar is complete: only the end could follow
        elif len(s.cached) + 1 + in_cache >= self.ctx.capacity(s.index) and not self._grow(s):
            self._finish(s, "length")  # the request's cells are full, and no idle slot's are next
        elif in_cache:
            s.cached.append(tok)
            return True
        else:
            s.pending = tok
            return True
        return False

    def _finish(self, s: _Slot, reason: str, error: Optional[str] = None) -> None:
        req = s.req
        tail = s.stream.close() if s.stream is not None and reason in ("stop", "length") else ""
        if tail:
            req.on_event(Event("piece", text=tail))
        req.on_event(Event("done", finish_reason=reason, prompt_tokens=len(req.tokens),
                           completion_tokens=s.stream.n_tokens if s.stream else 0, error=error,
                           drafted=s.spec.drafted if s.spec else 0, accepted=s.spec.accepted if s.spec else 0))
        # What the slot evaluated stays in its cache for a later prefix match; nothing is pending.
        s.req, s.pending, s.sampler, s.stream, s.constraint, s.spec = None, None, None, None, None, None


def _masks(slots: Sequence[_Slot]) -> Dict[int, np.ndarray]:
    """slot index -> the tokens its grammar allows next, for the slots that have one (filled
    together, off the GIL)."""
    constrained = [s for s in slots if s.constraint is not None and s.constraint.active]
    if not constrained:
        return {}
    from .grammar import fill_masks

    return {s.index: m for s, m in zip(constrained, fill_masks([s.constraint for s in constrained]))}


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - (m + math.log(float(np.exp(x - m).sum())))
