"""What the batching engine is given and gives back: a Request, its Events, and the Slot
(sequence) that serves it."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

from ..text.sampling import Sampler, SamplingParams
from ..text.stream import TextStream

__all__ = ["QueueFull", "Event", "Request", "Slot"]


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
    stop_word: Optional[str] = None  # done: the stop string that ended the text
    cached_tokens: int = 0  # done: prompt tokens taken from the slot's cache, not evaluated
    slot: int = -1     # done: the slot that served it


@dataclass
class Request:
    tokens: List[int]
    params: SamplingParams
    on_event: Callable[[Event], None]
    logprobs: Optional[int] = None  # None: no logprobs; N: the chosen token's and the best N
    grammar: Optional[object] = None  # stowlm.text.grammar.Grammar (or anything with start()): the text it allows
    special: bool = False  # control tokens stay in the text (a tool format's markers)
    speculative: bool = True  # draft where the engine's LLM drafts (stowlm.speculative)
    n_cached: int = 0  # prompt tokens its slot's cache held already
    cancelled: bool = False
    submitted: float = field(default_factory=time.perf_counter)
    first_token_at: Optional[float] = None

    def cancel(self) -> None:
        self.cancelled = True


class Slot:
    """One sequence of the context: what its cache holds, and the request it serves."""

    def __init__(self, index: int):
        self.index = index
        self.cached: List[int] = []   # tokens whose K/V this slot's sequence holds, in order
        self.kernels: List[int] = []  # per leading cached prompt token: its pass's kernel class
        self.req: Optional[Request] = None
        self.pos = 0                  # next prompt token to evaluate
        self.pending: Optional[int] = None  # sampled, not yet evaluated
        self.history: List[int] = []
        self.sampler: Optional[Sampler] = None
        self.stream: Optional[TextStream] = None  # the request's text, and where it ends
        self.constraint = None        # the request's grammar, where it has one (the stream's too)
        self.spec = None              # its speculative drafting (stowlm.speculative.Speculator)
