"""llama-cpp-python's ``Llama.create_completion`` / ``create_chat_completion`` on an LLM: the same
OpenAI-shaped dicts, made by the server's own request checks and result shapes (stowlm.serve's
protocol and events), so code written for ``llama_cpp.Llama`` runs after changing the import."""
from __future__ import annotations

import queue
import time
import uuid
from typing import Iterator, List

from .serve.events import ChoiceOut, usage
from .serve.protocol import APIError, parse_chat, parse_completion

__all__ = ["create"]

# llama-cpp-python's mirostat settings: dropped while mirostat is off (they mean nothing then)
_OFF = ("mirostat_tau", "mirostat_eta")


def _body(kwargs: dict, chat: bool) -> dict:
    body = {k: v for k, v in kwargs.items() if v is not None}
    for k in ("stopping_criteria", "logits_processor"):
        if body.pop(k, None) is not None:
            raise ValueError(f"{k} is not supported by stowlm (use stop, logit_bias or grammar)")
    if "mirostat_mode" in body:
        body["mirostat"] = body.pop("mirostat_mode")
    if not body.get("mirostat"):
        for k in _OFF:
            body.pop(k, None)
    if "max_tokens" in body and body["max_tokens"] <= 0:  # llama-cpp-python: until the context is full
        body["n_predict"] = -1
        del body["max_tokens"]
    if chat:
        body.setdefault("temperature", 0.2)  # llama-cpp-python's chat default
        if "max_tokens" not in body and "n_predict" not in body:
            body["n_predict"] = -1
    if body.get("stop") == []:
        del body["stop"]
    if isinstance(body.get("logit_bias"), dict):
        body["logit_bias"] = {str(k): v for k, v in body["logit_bias"].items()}
    return body


def create(llm, kwargs: dict, chat: bool):
    try:
        body = _body(kwargs, chat)
        job = parse_chat(body, llm) if chat else parse_completion(body, llm)
    except APIError as e:
        err = ValueError(e.message)
        err.param = e.param
        raise err from None
    engine = llm.engine()
    events: "queue.Queue" = queue.Queue()
    reqs = []
    try:
        for i, (tokens, params) in enumerate(job.runs()):
            reqs.append(engine.submit(tokens, params, lambda ev, i=i: events.put((i, ev)), job.logprobs,
                                      job.grammar, job.special))
    except BaseException:
        for r in reqs:
            engine.cancel(r)
        raise
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": kwargs.get("model") or str(llm.path)}
    outs = [ChoiceOut(job, i, llm.tokenizer) for i in range(len(reqs))]
    chunks = _chunks(engine, reqs, events, outs, job, dict(head, object="chat.completion.chunk" if chat else
                                                           "text_completion"))
    if job.stream:
        return chunks
    for _ in chunks:  # the same events made into the whole choices
        pass
    return dict(head, choices=[o.result() for o in outs], usage=usage(outs, job.n))


def _chunks(engine, reqs, events, outs: List[ChoiceOut], job, head) -> Iterator[dict]:
    """The stream's chunk dicts, as the server sends them; outs gather the whole choices."""
    try:
        if job.chat:
            yield dict(head, choices=[{"index": o.index, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None} for o in outs])
        if job.echo is not None:  # each choice's prompt first
            for o in outs:
                yield dict(head, choices=[{"index": o.index, "text": job.echo_text(o.index), "logprobs": None,
                                           "finish_reason": None}])
        left = len(reqs)
        while left:
            i, ev = events.get()
            if ev.kind == "done":
                if ev.finish_reason == "error":
                    raise RuntimeError(f"generation failed: {ev.error}")
                left -= 1
                for c in outs[i].done(ev):
                    yield dict(head, choices=[c])
                continue
            c = outs[i].piece(ev)
            if c is not None:
                yield dict(head, choices=[c])
        if job.include_usage:
            yield dict(head, choices=[], usage=usage(outs, job.n))
    finally:
        for r in reqs:
            engine.cancel(r)
