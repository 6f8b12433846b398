"""Generated tokens in, text out: where the text ends, and why.

One :class:`TextStream` per request, fed by whoever draws the tokens (``stowlm.llm``'s one
sequence and ``stowlm.batching``'s slots alike). It decides every end that depends on the text:
an end-of-generation token, a stop string (never emitted, not even in part: a tail that may still
grow into one is held back), ``max_tokens``, and a grammar that is complete. An end that depends
on the context (its cells are full) is given to it with ``end("length")``; ``finish_reason``
then says why the text ended.
"""
from __future__ import annotations

from typing import Iterable, List, Optional, Sequence, Tuple, Union

from .sampling import SamplingParams

__all__ = ["StopChecker", "TextStream", "held_prefix"]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens two texts share from the start (what a KV cache of one keeps for the other)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def held_prefix(buf: str, markers: Sequence[str]) -> int:
    """Length of the longest tail of ``buf`` that is a proper prefix of one of ``markers``: text
    that must wait, since the next piece may complete the marker."""
    best = 0
    for s in markers:
        for n in range(min(len(s) - 1, len(buf)), best, -1):
            if buf.endswith(s[:n]):
                best = n
                break
    return best


class StopChecker:
    """Streams text while watching for stop strings.

    ``feed(piece)`` returns ``(text_to_emit, stopped)``. Text that might be the beginning of a stop
    string is held back until it is decided; when a stop string completes, everything before it is
    emitted, the stop string and anything after it are dropped, and ``stopped`` is True.
    ``flush()`` returns the held-back text once generation ends for another reason.
    """

    def __init__(self, stop: Union[str, Iterable[str], None] = ()):
        if isinstance(stop, str):
            stop = [stop]
        self.stop = [s for s in (stop or ())]
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        self._held = ""
        self.stopped = False
        self.matched: Optional[str] = None  # the stop string that ended the text

    def feed(self, piece: str) -> Tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stop:
            return piece, False
        buf = self._held + piece
        first, which = -1, None
        for s in self.stop:
            i = buf.find(s)
            if i >= 0 and (first < 0 or i < first):
                first, which = i, s
        if first >= 0:
            self._held = ""
            self.stopped = True
            self.matched = which
            return buf[:first], True
        hold = held_prefix(buf, self.stop)
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold], False

    def flush(self) -> str:
        out, self._held = self._held, ""
        return "" if self.stopped else out


class TextStream:
    """Generated token ids in, finished text out, with all the reasons to stop.

    Combines the tokenizer's streaming detokenizer (whole UTF-8 characters only), a
    :class:`StopChecker` for ``params.stop``, end-of-generation tokens, ``params.max_tokens`` and,
    where given, the request's grammar ``constraint`` (each token but the end is accepted by it; a
    complete grammar ends the text). ``feed(id)`` returns the text that is now certain; once
    ``finished`` is set, ``finish_reason`` says why: ``"stop"`` (end-of-generation token, stop
    string, complete grammar) or ``"length"`` (max_tokens, or ``end("length")``: the context is
    full). Call ``close()`` at the end for any held-back text.
    """

    def __init__(self, tokenizer, params: Optional[SamplingParams] = None, skip_special: bool = True, constraint=None):
        self.params = params or SamplingParams()
        self.tokenizer = tokenizer
        self.constraint = constraint
        self._detok = tokenizer.detokenizer(skip_special=skip_special)
        self._stop = StopChecker(self.params.stop)
        self.n_tokens = 0
        self.ids: List[int] = []
        self.finished = False
        self.finish_reason: Optional[str] = None
        self.text = ""

    def feed(self, token_id: int) -> str:
        if self.finished:
            return ""
        token_id = int(token_id)
        eog = self.tokenizer.is_eog(token_id)
        if self.constraint is not None and not eog:
            self.constraint.accept(token_id)
        self.n_tokens += 1
        if eog:
            self.finished, self.finish_reason = True, "stop"
            return self._emit(self._drain())
        self.ids.append(token_id)
        out, stopped = self._stop.feed(self._detok.feed(token_id))
        if stopped:
            self.finished, self.finish_reason = True, "stop"
            return self._emit(out)
        if self.params.max_tokens is not None and self.n_tokens >= self.params.max_tokens:
            self.finished, self.finish_reason = True, "length"
            return self._emit(out + self._drain())
        if self.constraint is not None and self.constraint.done:
            # the grammar is complete: only the end could follow (close() gives the held-back tail)
            self.finished, self.finish_reason = True, "stop"
        return self._emit(out)

    @property
    def stop_word(self) -> Optional[str]:
        """The stop string that ended the text (None: it ended otherwise, or goes on)."""
        return self._stop.matched

    def end(self, reason: str) -> None:
        """The text ends for a reason outside it (the context is full: "length")."""
        if not self.finished:
            self.finished, self.finish_reason = True, reason

    def budget(self, unlimited: int) -> int:
        """Tokens the text may still take by max_tokens (``unlimited`` where it has none)."""
        return self.params.max_tokens - self.n_tokens if self.params.max_tokens is not None else unlimited

    def close(self) -> str:
        """Text still held back (a possible stop-string start, an unfinished character)."""
        if self._stop.stopped:
            return ""
        return self._emit(self._drain())

    def _drain(self) -> str:
        out, stopped = self._stop.feed(self._detok.flush())
        if stopped:
            return out
        return out + self._stop.flush()

    def _emit(self, s: str) -> str:
        self.text += s
        return s
