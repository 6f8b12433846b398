"""What a drawn token does to its request in the batching engine: into the request's text stream
(stowlm.text.stream decides where the text ends), out as an Event with its log-probabilities,
and the request finished where its text or its cells end; drafts checked and kept or dropped."""
from __future__ import annotations

import math
import time
from typing import List, Optional

import numpy as np

from .requests import Event, Slot

__all__ = ["RequestOutput"]


class RequestOutput:
    """BatchEngine's side of a slot's tokens (the engine gives ctx, cv, the counters, _grow)."""

    def _drafts(self, s: Slot, n_base: int) -> List[int]:
        """Draft tokens to follow the slot's pending one, within its budget of tokens and cells,
        as many as pay in a pass carrying n_base pending tokens."""
        cap = self.ctx.capacity(s.index)
        room = cap - len(s.cached) - 2  # the pending token, and one cell to sample into
        return s.spec.draft(s.history, min(s.stream.budget(cap) - 1, room), n_base)

    def _check_drafts(self, s: Slot, drafts: List[int], rows: np.ndarray) -> None:
        """The pass's rows for the slot's pending token and drafts: keep the drafts the sampler
        agrees with, emit them, then the token after them; the cache drops the rest."""
        if s.req.cancelled:
            self._finish(s, "cancelled")
        else:
            kept, nxt = s.spec.check(s.sampler, rows, drafts, s.history)
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

    def _next_token(self, s: Slot, logits: np.ndarray, allowed: Optional[np.ndarray] = None) -> None:
        req = s.req
        if req.cancelled:
            self._finish(s, "cancelled")
            return
        self._take(s, s.sampler.sample(logits, s.history, allowed), logits)

    def _take(self, s: Slot, tok: int, logits: np.ndarray, in_cache: bool = False) -> bool:
        """The drawn token into the request's text and events (logprobs from `logits`, the row it
        was drawn from). in_cache: a kept draft, whose K/V the pass already holds. Returns whether
        the request goes on."""
        req = s.req
        s.history.append(tok)
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
        ev.text = s.stream.feed(tok)  # the grammar, where there is one, takes the token here
        req.on_event(ev)
        with self.cv:
            self.completion_tokens_total += 1
        if not s.stream.finished and len(s.cached) + 1 + in_cache >= self.ctx.capacity(s.index) \
                and not self._grow(s):
            s.stream.end("length")  # the request's cells are full, and no idle slot's are next
        if s.stream.finished:
            self._finish(s, s.stream.finish_reason)
            return False
        if in_cache:
            s.cached.append(tok)
        else:
            s.pending = tok
        return True

    def _finish(self, s: Slot, reason: str, error: Optional[str] = None) -> None:
        req = s.req
        tail = s.stream.close() if s.stream is not None and reason in ("stop", "length") else ""
        if tail:
            req.on_event(Event("piece", text=tail))
        req.on_event(Event("done", finish_reason=reason, prompt_tokens=len(req.tokens),
                           completion_tokens=s.stream.n_tokens if s.stream else 0, error=error,
                           drafted=s.spec.drafted if s.spec else 0, accepted=s.spec.accepted if s.spec else 0,
                           stop_word=s.stream.stop_word if s.stream else None, cached_tokens=req.n_cached,
                           slot=s.index))
        self._release(s)

    @staticmethod
    def _release(s: Slot) -> None:
        # What the slot evaluated stays in its cache for a later prefix match; nothing is pending.
        s.req, s.pending, s.sampler, s.stream, s.constraint, s.spec = None, None, None, None, None, None


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - (m + math.log(float(np.exp(x - m).sum())))
