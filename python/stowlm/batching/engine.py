"""Continuous batching: several requests share one context, each in its own sequence (slot).

One engine thread runs the loop: waiting requests take free slots (the slot that can keep the
longest prefix of its cache for the new prompt, so a follow-up turn only evaluates its new
tokens); every step decodes one token for every generating slot in a single forward pass, then
evaluates one chunk of one waiting prompt, so new prompts join between steps while the others
keep generating. A finished or cancelled request frees its slot at once.

Batching does not change results, so the greedy text of a request is the same alone and among
others: each slot owns an equal region of the KV cells and attention splits the cells on fixed
boundaries (kv_cache.h); a prompt is evaluated in chunks of its own that end at multiples of
`chunk` positions; decode tokens go in batches below the first batch bound (the row kernels); and
a slot's cached prompt tokens are reused only where they hold the bits a fresh evaluation of the
new prompt would (stowlm.prefix says how much, and in which passes the rest goes).
"""
from __future__ import annotations

import atexit
import collections
import threading
import time
import weakref
from typing import Callable, Deque, Dict, List, Optional, Sequence

import numpy as np

from ..prefix import PrefixReuse
from ..speculative import PassCosts, Speculator
from ..text.sampling import Sampler, SamplingParams
from ..text.stream import TextStream
from .output import RequestOutput
from .requests import Event, QueueFull, Request, Slot
from .slots import SlotPlanner

__all__ = ["BatchEngine", "DEFAULT_CHUNK"]

DEFAULT_CHUNK = 256    # prompt tokens per step (and the granularity of prefix reuse)


# Engines still running at exit are stopped first: their threads hold the model, which would
# otherwise outlive the interpreter's teardown (and nanobind reports it as a leak).
_running: "weakref.WeakSet[BatchEngine]" = weakref.WeakSet()
atexit.register(lambda: [e.close() for e in list(_running)])


class BatchEngine(SlotPlanner, RequestOutput):
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
        self.pass_costs = getattr(llm, "_pass_costs", None) or PassCosts()  # every slot's passes teach it
        if self.drafter is not None and getattr(self.drafter, "llm", None) is not None:
            raise ValueError("a draft model drafts for one sequence: serve it with one slot (n_seq=1, --parallel 1), "
                             "or draft with 'ngram'")
        self.reuse = PrefixReuse.of(self.ctx, llm.model, self.chunk)  # what of a slot's cache a prompt keeps
        self.slots = [Slot(i) for i in range(self.n_seq)]
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
                        try:
                            self._finish(s, "error", str(e))
                        except Exception:  # even its end failed: the client still hears of it
                            s.req.on_event(Event("done", finish_reason="error", error=str(e)))
                            self._release(s)
            self._step_done()

    def _step_done(self) -> None:
        for fn in list(self.step_listeners):
            fn()

    def _start(self, s: Slot, req: Request) -> None:
        """The request's own state in the slot its prompt goes to (from s.pos on)."""
        s.req, s.pending = req, None
        s.history = list(req.tokens)
        s.sampler = Sampler(req.params, vocab_size=self.llm.model.n_vocab)
        s.constraint = req.grammar.start() if req.grammar is not None else None
        s.stream = TextStream(self.llm.tokenizer, req.params, skip_special=not req.special, constraint=s.constraint)
        s.spec = Speculator(self.drafter, self.draft_max, self.pass_costs) \
            if self.drafter is not None and req.grammar is None and req.speculative else None
        self.prompt_tokens_total += len(req.tokens)

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
            timed = any(s.spec is not None for s in group)
            # the cells the tokens attend to, before the pass adds theirs
            depth = sum(self.ctx.n_past_of(s.index) for s in group) // len(group) if timed else 0
            t0 = time.perf_counter()
            logits = self.ctx.eval_batch(toks, seqs, rows=list(range(len(toks))))
            if timed:
                self.pass_costs.observe(len(toks), time.perf_counter() - t0, depth)  # once: the slots share it
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

    def _prompt_step(self) -> None:
        pre = [s for s in self.slots if s.req and s.pending is None and s.pos < len(s.req.tokens)]
        if not pre:
            return
        s = pre[self._rr % len(pre)]
        self._rr += 1
        n, chunk, forced = self.reuse.next_pass(s.pos, len(s.req.tokens))
        toks = s.req.tokens[s.pos:s.pos + n]
        last = s.pos + n == len(s.req.tokens)
        masks = self._masks_during([s] if last else [])
        logits = self.ctx.eval_batch(toks, [s.index] * len(toks), rows=[len(toks) - 1] if last else [],
                                     batched=forced)
        s.cached += toks
        s.kernels += [chunk] * len(toks)
        s.pos += len(toks)
        with self.cv:
            self.prompt_tokens_evaluated += len(toks)
        if last:
            if s.spec is not None:
                s.spec.ready(s.req.tokens)
            self._next_token(s, logits[0], masks().get(s.index))

    def _masks_during(self, slots: Sequence[Slot]) -> Callable[[], Dict[int, np.ndarray]]:
        """Starts filling the masks of the slots' grammars on the mask thread (llguidance runs
        without the GIL, as does the forward pass) and returns the call that waits for them: the
        next token's mask depends only on the tokens already drawn, so it overlaps the pass."""
        if not any(s.constraint is not None and s.constraint.active for s in slots):
            return dict
        if self._mask_pool is None:
            import concurrent.futures

            self._mask_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stowlm-masks")
        return self._mask_pool.submit(_masks, list(slots)).result


def _masks(slots: Sequence[Slot]) -> Dict[int, np.ndarray]:
    """slot index -> the tokens its grammar allows next, for the slots that have one (filled
    together, off the GIL)."""
    constrained = [s for s in slots if s.constraint is not None and s.constraint.active]
    if not constrained:
        return {}
    from ..text.grammar import fill_masks

    return {s.index: m for s, m in zip(constrained, fill_masks([s.constraint for s in constrained]))}
