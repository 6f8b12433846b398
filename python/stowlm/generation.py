"""What one generate() or chat() call returns: an iterator of text pieces whose ``completion``
holds the :class:`Completion` at the end.

:class:`Generation` draws the tokens itself on the LLM's one sequence (with drafts where the LLM
speculates); :class:`Served` hands the request to the batching engine (LLM with n_seq > 1) and
reads its events; :class:`ToolCalls` takes either and parses the tool calls out of the text.
Where the text ends is decided by stowlm.text.stream for all of them.
"""
from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field
from typing import Iterator, List, Optional

from .speculative import Speculator
from .text.sampling import Sampler, SamplingParams
from .text.stream import TextStream
from .text.toolparser import gather

__all__ = ["Completion", "Generation", "Served", "ToolCalls"]


@dataclass
class Completion:
    """The result of a generate/chat call."""

    text: str
    finish_reason: str  # "stop" (end-of-generation token or stop string) or "length"
    prompt_tokens: int
    completion_tokens: int
    tokens: List[int] = field(default_factory=list)
    tool_calls: Optional[List[dict]] = None  # chat with tools: [{"id", "type": "function", "function": {...}}]
    drafted: int = 0   # speculative decoding: draft tokens checked
    accepted: int = 0  # of them, kept
    reasoning: Optional[str] = None  # the reasoning the chat format keeps apart from the answer (gpt-oss)

    def __str__(self) -> str:
        return self.text


class Generation:
    """Iterator of text pieces for one generate() call on the LLM's own sequence."""

    def __init__(self, llm, prompt: List[int], params: SamplingParams, grammar=None, special: bool = False,
                 spec: Optional[Speculator] = None):
        self.llm = llm
        self.prompt = prompt
        self.params = params
        self.grammar = grammar
        self.special = special
        self.spec = spec
        self.completion: Optional[Completion] = None
        self._gen = self._run()

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        return next(self._gen)

    def _run(self) -> Iterator[str]:
        llm, spec = self.llm, self.spec
        sampler = Sampler(self.params, vocab_size=llm.model.n_vocab)
        constraint = self.grammar.start() if self.grammar is not None else None
        stream = TextStream(llm.tokenizer, self.params, skip_special=not self.special, constraint=constraint)
        logits = llm._prefill(self.prompt)
        if spec is not None:
            spec.ready(self.prompt)
        history = list(self.prompt)

        def pick(logits) -> int:
            allowed = constraint.allowed() if constraint is not None and constraint.active else None
            return sampler.sample(logits, history, allowed)

        def feed(tok: int) -> str:
            """tok into the text: its piece (stream.finished: the text ends here)."""
            piece = stream.feed(tok)
            if not stream.finished:
                history.append(tok)
                if len(history) >= llm.n_ctx:
                    stream.end("length")  # the context is full
            return piece

        tok = pick(logits)
        while True:
            piece = feed(tok)
            if piece:
                yield piece
            if stream.finished:
                break
            budget = min(stream.budget(llm.n_ctx) - 1, llm.n_ctx - len(history))
            drafts = spec.draft(history, budget) if spec is not None else []
            if not drafts:
                t0 = time.perf_counter()
                logits = llm._step(tok)
                if spec is not None:
                    spec.timed_pass(time.perf_counter() - t0, 1)
                tok = pick(logits)
                continue
            t0 = time.perf_counter()
            rows = llm._step_many([tok] + drafts)  # the pending token and the drafts, one pass
            spec.timed_pass(time.perf_counter() - t0, 1 + len(drafts))
            kept, tok = spec.check(sampler, rows, drafts, history)
            for d in kept:
                piece = feed(d)
                if piece:
                    yield piece
                if stream.finished:
                    break
            llm._rewind(len(history))  # the cache keeps what the text kept
            if stream.finished:
                break
        tail = stream.close()
        if tail:
            yield tail
        self.completion = Completion(stream.text, stream.finish_reason, len(self.prompt), stream.n_tokens,
                                     stream.ids, drafted=spec.drafted if spec else 0,
                                     accepted=spec.accepted if spec else 0)


class Served:
    """Iterator of text pieces of one request served by the batch engine (LLM with n_seq > 1):
    submitted at once, so several of them run together."""

    def __init__(self, engine, prompt: List[int], params: SamplingParams, grammar=None, special: bool = False,
                 speculative: bool = True):
        self.completion: Optional[Completion] = None
        self._events: "queue.Queue" = queue.Queue()
        self._tokens: List[int] = []
        self._text: List[str] = []
        self._engine = engine
        self._req = engine.submit(prompt, params, self._events.put, grammar=grammar, special=special,
                                  speculative=speculative)

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        while self.completion is None:
            ev = self._events.get()
            if ev.kind == "done":
                if ev.finish_reason == "error":
                    raise RuntimeError(f"generation failed: {ev.error}")
                self.completion = Completion("".join(self._text), ev.finish_reason, ev.prompt_tokens,
                                             ev.completion_tokens, self._tokens, drafted=ev.drafted,
                                             accepted=ev.accepted)
                break
            if ev.token is not None and not self._engine.llm.tokenizer.is_eog(ev.token):
                self._tokens.append(ev.token)
            if ev.text:
                self._text.append(ev.text)
                return ev.text
        raise StopIteration

    def __del__(self):
        req = getattr(self, "_req", None)  # None: submit() refused the request
        if self.completion is None and req is not None:
            self._engine.cancel(req)


class ToolCalls:
    """Text pieces of a chat with tools: the content as it comes, the calls in the completion."""

    def __init__(self, it, req):
        self._it, self._req, self._parser = it, req, req.parser()
        self._text: List[str] = []
        self._reasoning: List[str] = []
        self._calls: List[dict] = []
        self.completion: Optional[Completion] = None

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        while self.completion is None:
            try:
                items = self._parser.feed(next(self._it))
                last = False
            except StopIteration:
                items, last = self._parser.finish(), True
            text, reasoning, calls = gather(items, self._req.format)
            self._reasoning.append(reasoning)
            self._calls += calls
            self._text.append(text)
            if last:
                c = self._it.completion
                finish = "tool_calls" if self._calls and c.finish_reason == "stop" else c.finish_reason
                self.completion = Completion("".join(self._text), finish, c.prompt_tokens, c.completion_tokens,
                                             c.tokens, self._calls if self._req.tools else None,
                                             "".join(self._reasoning) or None)
            if text:
                return text
        raise StopIteration
