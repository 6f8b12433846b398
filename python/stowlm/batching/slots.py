"""Which slot a request gets and what of its cache it keeps: the slot that can keep the longest
prefix of its cache for the new prompt (so a follow-up turn only evaluates its new tokens), the
regions of KV cells a long request takes from idle slots after its own (how much of a cached
prefix gives exactly the bits a fresh evaluation would: stowlm.prefix)."""
from __future__ import annotations

from .requests import Event, Slot

__all__ = ["SlotPlanner"]


class SlotPlanner:
    """BatchEngine's admission of waiting requests into slots (the engine gives ctx, slots, queue,
    n_seq, slot_ctx, reuse: its PrefixReuse, and _start(slot, request))."""

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
            keep, _, _, best = max(((self.reuse.reusable(s.cached, s.kernels, req.tokens), self._room(s, want), -len(s.cached), s)
                                    for s in starts), key=lambda x: (x[0], x[1], x[2], -x[3].index))
            self._claim(best, need)
            if keep < len(best.cached):
                self.ctx.kv_truncate(keep, seq=best.index)
                del best.cached[keep:]
            del best.kernels[keep:]
            best.pos = req.n_cached = keep
            self._start(best, req)
        self.queue.extendleft(reversed(waiting))

    # -- regions: a long request holds the cells of the idle slots after its own ---------------------
    def _room(self, s: Slot, want: int) -> int:
        """How many regions from slot s's own, up to want, are idle for it."""
        n = 0
        while n < want and s.index + n < self.n_seq and self._idle(s.index + n, s):
            n += 1
        return n

    def _idle(self, q: int, start: Slot) -> bool:
        """Whether slot q's region can go to a request starting at slot `start`: q serves nothing,
        and neither does the slot holding q's region, if another holds it."""
        if self.slots[q].req is not None:
            return False
        h = self.ctx.kv_held_by(q)
        return h is None or h == start.index or self.slots[h].req is None

    def _shrink(self, h: Slot, n: int) -> None:
        """Slot h keeps n regions (its cache cut to fit)."""
        cap = n * self.slot_ctx
        if len(h.cached) > cap:
            self.ctx.kv_truncate(cap, seq=h.index)
            del h.cached[cap:]
            del h.kernels[cap:]
        self.ctx.kv_span(h.index, n)

    def _claim(self, s: Slot, need: int) -> None:
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

    def _grow(self, s: Slot) -> bool:
        """One more region for slot s, whose cells are full, where the next is idle and no request
        waits for it."""
        nxt = s.index + self.ctx.kv_span_of(s.index)
        if nxt >= self.n_seq or self.queue or not self._idle(nxt, s):
            return False
        self._claim(s, nxt - s.index + 1)
        return True
