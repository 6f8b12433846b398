"""The engine's events on their way to the client: moved from the engine thread onto the event
loop (:class:`Mailbox`, :class:`Run`), made into OpenAI's choices, deltas, tool calls and
log-probabilities (:class:`ChoiceOut`, :func:`usage`; LLM.create_* use these too), and written as
server-sent events (:func:`chunk_json`, :class:`PieceJson`)."""
from __future__ import annotations

import asyncio
import json
import threading
from typing import Any, Dict, List, Optional, Tuple

from ..batching import Event
from ..text.toolparser import ToolParser, gather
from .protocol import Job

__all__ = ["Mailbox", "Run", "ChoiceOut", "usage", "chunk_json", "PieceJson"]


class Mailbox:
    """Events from the engine thread to the event loop: appended under a lock, and delivered by
    one callback once the engine's step is done (flush), so a decode step's events wake the
    loop once, and not while the engine still samples the step's other requests."""

    def __init__(self, loop):
        self.loop = loop
        self.lock = threading.Lock()
        self.items: List[tuple] = []
        self.scheduled = False

    def post(self, q: asyncio.Queue, ev: Event) -> None:
        with self.lock:
            self.items.append((q, ev))

    def flush(self) -> None:
        with self.lock:
            if not self.items or self.scheduled:
                return
            self.scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is gone (shutdown): nobody is waiting
            pass

    def _deliver(self) -> None:
        with self.lock:
            items, self.items, self.scheduled = self.items, [], False
        for q, ev in items:
            q.put_nowait(ev)


class Run:
    """One submitted request: its events, moved from the engine thread onto the event loop."""

    def __init__(self, engine, mailbox: Mailbox, tokens: List[int], params, job: Job):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done = False
        self.engine = engine
        q = self.queue
        self.req = engine.submit(tokens, params, lambda ev: mailbox.post(q, ev), job.logprobs, job.grammar,
                                 job.special)

    async def next(self) -> Event:
        ev = await self.queue.get()
        if ev.kind == "done":
            self.done = True
        return ev

    def cancel(self) -> None:
        if not self.done:
            self.engine.cancel(self.req)


class ChoiceOut:
    """One choice's events made into OpenAI's shapes. piece() gives a stream chunk's choice (or
    None when nothing is certain yet), done() the last ones; result() the whole choice of a
    response that is not streamed."""

    def __init__(self, job: Job, index: int, tokenizer):
        self.job, self.index, self.tok = job, index, tokenizer
        self.text: List[str] = []
        self.lps: List[dict] = []
        self.offset = 0
        self.parser: Optional[ToolParser] = job.tools.parser() if job.tools is not None else None
        self.calls: List[dict] = []
        self.reasoning: List[str] = []
        self.finish: Optional[str] = None
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0
        self.drafted = self.accepted = 0  # speculative decoding's draft tokens, and those kept

    # -- log-probabilities -----------------------------------------------------------------------------
    def _lp_entry(self, ev) -> Optional[dict]:
        if self.job.logprobs is None or ev.token is None or ev.logprob is None or self.tok.is_eog(ev.token):
            return None
        piece = self.tok.decode([ev.token])
        return {"token": piece, "logprob": ev.logprob,
                "top": [(self.tok.decode([t]), lp) for t, lp in (ev.top_logprobs or [])]}

    @staticmethod
    def chat_lp(x: dict) -> dict:
        return {"token": x["token"], "logprob": x["logprob"], "bytes": list(x["token"].encode("utf-8")),
                "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))} for t, lp in x["top"]]}

    @staticmethod
    def cmpl_lp(lps: List[dict], offset: int = 0) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for x in lps:
            out["tokens"].append(x["token"])
            out["token_logprobs"].append(x["logprob"])
            out["top_logprobs"].append({t: lp for t, lp in x["top"]})
            out["text_offset"].append(offset)
            offset += len(x["token"])
        return out

    # -- the stream ----------------------------------------------------------------------------------------
    def _items(self, text: str, final: bool) -> Tuple[str, List[dict], str]:
        """Content, the tool calls completed by this text, and reasoning the format keeps apart."""
        if self.parser is None:
            return text, [], ""
        items = self.parser.feed(text) if text else []
        if final:
            items += self.parser.finish()
        content, reasoning, new = gather(items, self.job.tools.format)
        self.reasoning.append(reasoning)
        self.calls += new
        return content, [dict(c, index=len(self.calls) - len(new) + i) for i, c in enumerate(new)], reasoning

    def piece(self, ev) -> Optional[dict]:
        """The chunk choice of a piece event, or None."""
        x = self._lp_entry(ev)
        if x is not None:
            self.lps.append(x)
        content, calls, reasoning = self._items(ev.text, False)
        self.text.append(content)
        if not content and not calls and not reasoning and x is None:
            return None
        lp = None
        if x is not None:
            lp = {"content": [self.chat_lp(x)]} if self.job.chat else self.cmpl_lp([x], self.offset)
        self.offset += len(content)
        if self.job.chat:
            delta: Dict[str, Any] = {"content": content} if content or not (calls or reasoning) else {}
            if reasoning:
                delta["reasoning_content"] = reasoning
            if calls:
                delta["tool_calls"] = calls
            return {"index": self.index, "delta": delta, "logprobs": lp, "finish_reason": None}
        return {"index": self.index, "text": content, "logprobs": lp, "finish_reason": None}

    def done(self, ev) -> List[dict]:
        """The chunk choices of the end: what the parser held back, then the finish reason."""
        out = []
        content, calls, reasoning = self._items("", True)
        self.text.append(content)
        if content or calls or reasoning:
            if self.job.chat:
                delta: Dict[str, Any] = {"content": content} if content else {}
                if reasoning:
                    delta["reasoning_content"] = reasoning
                if calls:
                    delta["tool_calls"] = calls
                out.append({"index": self.index, "delta": delta, "logprobs": None, "finish_reason": None})
            else:
                out.append({"index": self.index, "text": content, "logprobs": None, "finish_reason": None})
        self.finish = self.finish_reason(ev)
        self.prompt_tokens, self.completion_tokens = ev.prompt_tokens, ev.completion_tokens
        self.drafted, self.accepted = ev.drafted, ev.accepted
        self.cached_tokens = ev.cached_tokens
        delta_end = {"delta": {}} if self.job.chat else {"text": ""}
        out.append({"index": self.index, **delta_end, "logprobs": None, "finish_reason": self.finish})
        return out

    def finish_reason(self, ev) -> str:
        if self.calls and ev.finish_reason == "stop":
            return "tool_calls"
        return ev.finish_reason if ev.finish_reason in ("stop", "length") else (ev.finish_reason or "stop")

    def result(self) -> dict:
        """The whole choice (after done())."""
        text = "".join(self.text)
        if self.job.chat:
            msg: Dict[str, Any] = {"role": "assistant", "content": text if text or not self.calls else None}
            if "".join(self.reasoning):
                msg["reasoning_content"] = "".join(self.reasoning)
            if self.calls:
                msg["tool_calls"] = self.calls
            return {"index": self.index, "message": msg,
                    "logprobs": None if self.job.logprobs is None else {"content": [self.chat_lp(e) for e in self.lps]},
                    "finish_reason": self.finish}
        return {"index": self.index, "text": self.job.echo_text(self.index) + text,
                "logprobs": None if self.job.logprobs is None else self.cmpl_lp(self.lps),
                "finish_reason": self.finish}


def usage(outs: List[ChoiceOut], n: int) -> dict:
    """OpenAI's usage (prompt_tokens_details.cached_tokens: those a slot's cache held already);
    where drafts were checked, also what speculative decoding did (OpenAI's prediction token
    counts, and stowlm's drafted/accepted)."""
    u = {"prompt_tokens": sum(o.prompt_tokens for i, o in enumerate(outs) if i % n == 0),
         "completion_tokens": sum(o.completion_tokens for o in outs)}
    u["total_tokens"] = u["prompt_tokens"] + u["completion_tokens"]
    u["prompt_tokens_details"] = {"cached_tokens": sum(o.cached_tokens for i, o in enumerate(outs) if i % n == 0)}
    drafted, accepted = sum(o.drafted for o in outs), sum(o.accepted for o in outs)
    if drafted:
        u["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": drafted - accepted}
        u["drafted_tokens"], u["accepted_tokens"] = drafted, accepted
    return u


def chunk_json(head: dict, choices: list, include_usage: bool, usage=None) -> bytes:
    """One server-sent event of a stream: `head` (id, object, created, model) and `choices`."""
    d = dict(head, choices=choices)
    if include_usage:
        d["usage"] = usage
    return ("data: " + json.dumps(d, ensure_ascii=False) + "\n\n").encode("utf-8")


class PieceJson:
    """chunk_json of one choice's text piece (no logprobs), the stream's common event, from
    pieces of text made once: json.dumps of the whole event per token was a tenth of the event
    loop's time."""

    def __init__(self, head: dict, chat: bool, include_usage: bool):
        self.pre = "data: " + json.dumps(head, ensure_ascii=False)[:-1] + ', "choices": [{"index": '
        self.mid = ', "delta": {"content": ' if chat else ', "text": '
        self.post = ('}' if chat else '') + ', "logprobs": null, "finish_reason": null}]' + \
            (', "usage": null' if include_usage else '') + '}\n\n'

    def __call__(self, index: int, text: str) -> bytes:
        return (self.pre + str(index) + self.mid + json.dumps(text, ensure_ascii=False) + self.post).encode("utf-8")
