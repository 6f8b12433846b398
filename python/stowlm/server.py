"""`stowlm serve`: an OpenAI-compatible HTTP server over the continuous-batching engine.

Built on Starlette and uvicorn: a small, well-kept ASGI stack with streaming responses and no
request model of its own, so every request is checked here and every error has OpenAI's shape
({"error": {"message", "type", "param", "code"}}) and the right status. The engine runs on its own
thread (stowlm.batching); handlers only submit requests and await the events it posts back to the
event loop, so the loop never waits on a forward pass.

Endpoints: POST /v1/chat/completions, POST /v1/completions (both streamed as server-sent events
or not), GET /v1/models, GET /health, GET /metrics (Prometheus text).
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import sys
import threading
import time
import uuid
from typing import Any, Dict, List, Mapping, Optional, Tuple

from .batching import Event, QueueFull
from .sampling import SamplingParams

__all__ = ["make_app", "serve", "APIError"]

MAX_STOP = 16          # stop strings per request
MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat (completions: 5; we allow 20 for both)
MAX_N = 16             # choices per request


class APIError(Exception):
    """An error answered as OpenAI's JSON with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# -- request checking ------------------------------------------------------------------------------

def _bad(param: str, why: str) -> APIError:
    return APIError(400, f"'{param}': {why}", param=param, code="invalid_value")


def _num(body: Mapping, key: str, lo: float, hi: float, default=None, integer: bool = False):
    v = body.get(key)
    if v is None:
        return default
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or (isinstance(v, float) and not math.isfinite(v)):
        raise _bad(key, f"must be {'an integer' if integer else 'a number'}, got {json.dumps(v)[:40]}")
    if not lo <= v <= hi:
        raise _bad(key, f"must be in [{lo}, {hi}], got {v}")
    return v


def _bool(body: Mapping, key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(key, f"must be true or false, got {json.dumps(v)[:40]}")
    return v


def _stop(body: Mapping) -> List[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise _bad("stop", "must be a string or a list of strings")
    if len(v) > MAX_STOP:
        raise _bad("stop", f"at most {MAX_STOP} stop strings, got {len(v)}")
    return [s for s in v if s]


def _logit_bias(body: Mapping, n_vocab: int) -> Dict[int, float]:
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise _bad("logit_bias", "must be an object mapping token ids to biases")
    out = {}
    for k, b in v.items():
        try:
            tok = int(k)
        except (TypeError, ValueError):
            raise _bad("logit_bias", f"key {k!r} is not a token id") from None
        if not 0 <= tok < n_vocab:
            raise _bad("logit_bias", f"token id {tok} is outside the vocabulary [0, {n_vocab})")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise _bad("logit_bias", f"the bias of token {tok} must be a number in [-100, 100]")
        out[tok] = -math.inf if b <= -100 else float(b)  # -100 bans the token, as OpenAI's does
    return out


def _sampling(body: Mapping, n_vocab: int, max_tokens_default: Optional[int], chat: bool) -> SamplingParams:
    d = SamplingParams()
    max_tokens = _num(body, "max_tokens", 1, 1 << 30, None, integer=True)
    if chat:
        max_tokens = _num(body, "max_completion_tokens", 1, 1 << 30, max_tokens, integer=True)
    return SamplingParams(
        temperature=_num(body, "temperature", 0.0, 2.0, d.temperature),
        top_p=max(_num(body, "top_p", 0.0, 1.0, d.top_p), 1e-9),  # 0: the best token only
        top_k=_num(body, "top_k", 0, 1 << 30, d.top_k, integer=True),
        min_p=_num(body, "min_p", 0.0, 1.0, d.min_p),
        repeat_penalty=_num(body, "repeat_penalty", 0.01, 100.0, d.repeat_penalty),
        presence_penalty=_num(body, "presence_penalty", -2.0, 2.0, 0.0),
        frequency_penalty=_num(body, "frequency_penalty", -2.0, 2.0, 0.0),
        seed=_seed(_num(body, "seed", -(1 << 63), (1 << 64) - 1, None, integer=True)),
        max_tokens=max_tokens if max_tokens is not None else max_tokens_default,
        stop=_stop(body),
        logit_bias=_logit_bias(body, n_vocab))


def _seed(v: Optional[int]) -> Optional[int]:
    return None if v is None else v % (1 << 64)  # OpenAI's seeds may be negative


def _text_of(content, where: str) -> str:
    """A message's content: a string, or OpenAI's list of parts (text parts only)."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        out = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(where, "content parts must be {\"type\": \"text\", \"text\": ...} (this model reads text only)")
            out.append(part["text"])
        return "".join(out)
    raise _bad(where, "content must be a string or a list of text parts")


def _messages(body: Mapping) -> List[Dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "must be a non-empty list of {\"role\", \"content\"} objects")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}]", "must be an object with a string 'role'")
        if m["role"] not in ("system", "developer", "user", "assistant", "tool"):
            raise _bad(f"messages[{i}].role", f"unknown role {m['role']!r}")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": _text_of(m.get("content"), f"messages[{i}].content")})
    return out


def _prompts(body: Mapping, llm) -> List[List[int]]:
    """/v1/completions' prompt: a string, a list of strings, a list of token ids, or a list of those."""
    p = body.get("prompt")
    n_vocab = llm.model.n_vocab

    def ids(x, where):
        if not x:
            raise _bad(where, "is empty")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in x):
            raise _bad(where, "must be a string or a list of token ids")
        bad = [t for t in x if not 0 <= t < n_vocab]
        if bad:
            raise _bad(where, f"token id {bad[0]} is outside the vocabulary [0, {n_vocab})")
        return list(x)

    def text(s, where):
        if not s:
            raise _bad(where, "is empty")
        return llm.tokenize(s)

    if isinstance(p, str):
        return [text(p, "prompt")]
    if isinstance(p, list) and p:
        if all(isinstance(x, str) for x in p):
            return [text(x, f"prompt[{i}]") for i, x in enumerate(p)]
        if all(isinstance(x, list) for x in p):
            return [ids(x, f"prompt[{i}]") for i, x in enumerate(p)]
        return [ids(p, "prompt")]
    raise _bad("prompt", "must be a non-empty string, list of strings or list of token ids")


# -- the app -----------------------------------------------------------------------------------

class _Metrics:
    def __init__(self):
        self.http: Dict[Tuple[str, int], int] = {}
        self.ttft_sum = 0.0
        self.ttft_count = 0
        self.started = time.time()

    def count(self, path: str, status: int) -> None:
        key = (path, status)
        self.http[key] = self.http.get(key, 0) + 1


def _chunk_json(head: dict, choices: list, include_usage: bool, usage=None) -> bytes:
    """One server-sent event of a stream: `head` (id, object, created, model) and `choices`."""
    d = dict(head, choices=choices)
    if include_usage:
        d["usage"] = usage
    return ("data: " + json.dumps(d, ensure_ascii=False) + "\n\n").encode("utf-8")


class _PieceJson:
    """_chunk_json of one choice's text piece (no logprobs), the stream's common event, from
    pieces of text made once: json.dumps of the whole event per token was a tenth of the event
    loop's time."""

    def __init__(self, head: dict, chat: bool, include_usage: bool):
        self.pre = "data: " + json.dumps(head, ensure_ascii=False)[:-1] + ', "choices": [{"index": '
        self.mid = ', "delta": {"content": ' if chat else ', "text": '
        self.post = ('}' if chat else '') + ', "logprobs": null, "finish_reason": null}]' + \
            (', "usage": null' if include_usage else '') + '}\n\n'

    def __call__(self, index: int, text: str) -> bytes:
        return (self.pre + str(index) + self.mid + json.dumps(text, ensure_ascii=False) + self.post).encode("utf-8")


class _Mailbox:
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


class _Run:
    """One submitted request: its events, moved from the engine thread onto the event loop."""

    def __init__(self, engine, mailbox: _Mailbox, tokens: List[int], params: SamplingParams,
                 logprobs: Optional[int]):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done = False
        self.engine = engine
        q = self.queue
        self.req = engine.submit(tokens, params, lambda ev: mailbox.post(q, ev), logprobs)

    async def next(self) -> Event:
        ev = await self.queue.get()
        if ev.kind == "done":
            self.done = True
        return ev

    def cancel(self) -> None:
        if not self.done:
            self.engine.cancel(self.req)


def make_app(llm, model_id: Optional[str] = None, api_key: Optional[str] = None, max_queue: int = 128):
    """The ASGI app serving `llm` (its engine is made here, with max_queue waiting requests)."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    engine = llm.engine(max_queue=max_queue)
    model_id = model_id or os.path.splitext(os.path.basename(os.fspath(llm.path)))[0]
    created = int(time.time())
    metrics = _Metrics()
    tok = llm.tokenizer

    def error(e: APIError, path: str) -> JSONResponse:
        metrics.count(path, e.status)
        headers = {"Retry-After": "1"} if e.status == 503 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        auth = request.headers.get("authorization", "")
        if not auth.startswith("Bearer "):
            raise APIError(401, "Missing API key: send it as 'Authorization: Bearer KEY'.", code="invalid_api_key")
        if auth[len("Bearer "):].strip() != api_key:
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    async def read_json(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"The request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
        return body

    def check_model(body: Mapping) -> None:
        m = body.get("model")
        if m is None:
            return
        if not isinstance(m, str):
            raise _bad("model", "must be a string")
        if m not in (model_id, os.path.basename(os.fspath(llm.path))):
            raise APIError(404, f"The model '{m}' does not exist; this server serves '{model_id}'.", param="model",
                           code="model_not_found")

    def check_length(tokens: List[int]) -> None:
        if len(tokens) >= engine.slot_ctx:
            raise APIError(400, f"This model's maximum context length is {engine.slot_ctx} tokens per request "
                                f"(n_ctx {engine.ctx.n_ctx} over {engine.n_seq} slots), but the prompt has "
                                f"{len(tokens)} tokens (and at least one must be generated).",
                           param="messages", code="context_length_exceeded")

    boxes: Dict[int, _Mailbox] = {}

    def mailbox() -> _Mailbox:
        loop = asyncio.get_running_loop()
        box = boxes.get(id(loop))
        if box is None or box.loop is not loop:
            if box is not None:
                engine.step_listeners.remove(box.flush)
            box = boxes[id(loop)] = _Mailbox(loop)
            engine.step_listeners.append(box.flush)
        return box

    def submit(tokens: List[int], params: SamplingParams, logprobs: Optional[int]) -> _Run:
        try:
            return _Run(engine, mailbox(), tokens, params, logprobs)
        except QueueFull as e:
            raise APIError(503, f"The server is busy: {e}. Retry later.", type_="server_error",
                           code="server_busy") from None
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def piece_of(t: int) -> str:
        return tok.decode([t])

    # -- handlers -----------------------------------------------------------------------------
    async def health(request: Request):
        metrics.count("/health", 200)
        st = engine.stats()
        return JSONResponse({"status": "ok", "slots_idle": st["slots"] - st["slots_busy"],
                             "slots_processing": st["slots_busy"]})

    async def models(request: Request):
        check_key(request)
        metrics.count("/v1/models", 200)
        return JSONResponse({"object": "list", "data": [
            {"id": model_id, "object": "model", "created": created, "owned_by": "stowlm",
             "meta": {"n_ctx": engine.ctx.n_ctx, "n_ctx_slot": engine.slot_ctx, "slots": engine.n_seq,
                      "n_vocab": llm.model.n_vocab}}]})

    async def model_one(request: Request):
        check_key(request)
        name = request.path_params["name"]
        if name != model_id:
            raise APIError(404, f"The model '{name}' does not exist.", param="model", code="model_not_found")
        metrics.count("/v1/models/{name}", 200)
        return JSONResponse({"id": model_id, "object": "model", "created": created, "owned_by": "stowlm"})

    async def prometheus(request: Request):
        check_key(request)
        metrics.count("/metrics", 200)
        st = engine.stats()
        lines = []

        def metric(name, kind, help_, value, labels=""):
            lines.append(f"# HELP stowlm_{name} {help_}")
            lines.append(f"# TYPE stowlm_{name} {kind}")
            lines.append(f"stowlm_{name}{labels} {value}")

        metric("requests_total", "counter", "Generation requests accepted by the engine.", st["requests_total"])
        metric("prompt_tokens_total", "counter", "Prompt tokens of accepted requests (tokens in).",
               st["prompt_tokens_total"])
        metric("prompt_tokens_evaluated_total", "counter", "Prompt tokens evaluated (less than tokens in by what "
               "cached prefixes saved).", st["prompt_tokens_evaluated"])
        metric("completion_tokens_total", "counter", "Generated tokens (tokens out).", st["completion_tokens_total"])
        metric("tokens_per_second", "gauge", "Generated tokens per second over the last 10 s.",
               f"{st['tokens_per_second']:.3f}")
        metric("queue_length", "gauge", "Requests waiting for a slot.", st["queue_length"])
        metric("slots_busy", "gauge", "Slots generating or evaluating a prompt.", st["slots_busy"])
        metric("slots", "gauge", "Slots (sequences served at once).", st["slots"])
        metric("kv_cells_used", "gauge", "KV cache cells in use, every slot.", st["kv_cells_used"])
        metric("kv_cells", "gauge", "KV cache cells.", st["kv_cells"])
        metric("time_to_first_token_seconds_sum", "counter", "Sum of times to the first token.",
               f"{metrics.ttft_sum:.6f}")
        metric("time_to_first_token_seconds_count", "counter", "Requests with a first token.", metrics.ttft_count)
        lines.append("# HELP stowlm_http_responses_total HTTP responses by path and status.")
        lines.append("# TYPE stowlm_http_responses_total counter")
        for (path, status), n in sorted(metrics.http.items()):
            lines.append(f'stowlm_http_responses_total{{path="{path}",status="{status}"}} {n}')
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def completions(request: Request):
        return await _generate(request, chat=False)

    async def chat_completions(request: Request):
        return await _generate(request, chat=True)

    async def _generate(request: Request, chat: bool):
        path = request.url.path
        check_key(request)
        body = await read_json(request)
        check_model(body)
        n = _num(body, "n", 1, MAX_N, 1, integer=True)
        stream = _bool(body, "stream")
        so = body.get("stream_options")
        if so is not None and not isinstance(so, dict):
            raise _bad("stream_options", "must be an object")
        include_usage = stream and _bool(so or {}, "include_usage")
        if chat:
            want_lp = _bool(body, "logprobs")
            top = _num(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, 0, integer=True)
            if top and not want_lp:
                raise _bad("top_logprobs", "needs 'logprobs': true")
            logprobs = top if want_lp else None
            msgs = _messages(body)
            try:
                prompts = [await asyncio.to_thread(llm.chat_tokens, msgs)]
            except ValueError as e:
                raise APIError(400, str(e), param="messages") from None
        else:
            logprobs = _num(body, "logprobs", 0, MAX_TOP_LOGPROBS, None, integer=True)
            if _bool(body, "echo"):
                raise _bad("echo", "is not supported")
            prompts = await asyncio.to_thread(_prompts, body, llm)
        try:
            params = _sampling(body, llm.model.n_vocab, None if chat else 16, chat)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        for p in prompts:
            check_length(p)
        # one run per (prompt, n): choice index i * n + j; a seeded request gives choice j seed + j
        jobs = []
        for p in prompts:
            for j in range(n):
                pj = params if j == 0 or params.seed is None else SamplingParams(**{**params.__dict__,
                                                                                     "seed": params.seed + j})
                jobs.append((p, pj))
        runs: List[_Run] = []
        try:
            for p, pj in jobs:
                runs.append(submit(p, pj, logprobs))
        except APIError:
            for r in runs:
                r.cancel()
            raise
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        now = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        t_start = time.perf_counter()
        if stream:
            metrics.count(path, 200)
            return StreamingResponse(_sse(request, runs, n, rid, now, chat, include_usage, logprobs, t_start),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            results = await _collect_all(request, runs, t_start)
        finally:
            for r in runs:
                r.cancel()
        if results is None:  # the client left
            metrics.count(path, 499)
            return Response(status_code=499)
        choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0}
        for i, (text, finish, pt, ct, lps, err) in enumerate(results):
            if err:
                raise APIError(500, f"generation failed: {err}", type_="server_error", code="internal_error")
            usage["prompt_tokens"] += pt if i % n == 0 else 0
            usage["completion_tokens"] += ct
            if chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                "logprobs": None if logprobs is None else {"content": [_chat_lp(e) for e in lps]},
                                "finish_reason": finish})
            else:
                choices.append({"index": i, "text": text, "logprobs": None if logprobs is None else _cmpl_lp(lps),
                                "finish_reason": finish})
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        metrics.count(path, 200)
        return JSONResponse({"id": rid, "object": obj, "created": now, "model": model_id, "choices": choices,
                             "usage": usage})

    def _lp_entry(e: Event) -> dict:
        return {"token": piece_of(e.token), "logprob": e.logprob,
                "top": [(piece_of(t), lp) for t, lp in (e.top_logprobs or [])]}

    def _chat_lp(x: dict) -> dict:
        return {"token": x["token"], "logprob": x["logprob"], "bytes": list(x["token"].encode("utf-8")),
                "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))} for t, lp in x["top"]]}

    def _cmpl_lp(lps: List[dict], offset: int = 0) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for x in lps:
            out["tokens"].append(x["token"])
            out["token_logprobs"].append(x["logprob"])
            out["top_logprobs"].append({t: lp for t, lp in x["top"]})
            out["text_offset"].append(offset)
            offset += len(x["token"])
        return out

    def _note_first(t_start: float) -> None:
        metrics.ttft_sum += time.perf_counter() - t_start
        metrics.ttft_count += 1

    async def _collect(request: Request, run: _Run, t_start: float):
        text, lps, first = [], [], True
        while True:
            ev = await run.next()
            if ev.kind == "done":
                return "".join(text), _finish(ev), ev.prompt_tokens, ev.completion_tokens, lps, ev.error
            if first and ev.token is not None:
                first = False
                _note_first(t_start)
            if ev.token is not None and ev.logprob is not None and not tok.is_eog(ev.token):
                lps.append(_lp_entry(ev))
            text.append(ev.text)

    async def _collect_all(request: Request, runs: List[_Run], t_start: float):
        tasks = [asyncio.ensure_future(_collect(request, r, t_start)) for r in runs]
        pending = set(tasks)
        while pending:
            _, pending = await asyncio.wait(pending, timeout=0.5)
            if pending and await request.is_disconnected():
                for t in tasks:
                    t.cancel()
                return None
        return [t.result() for t in tasks]

    async def _sse(request, runs: List[_Run], n, rid, now, chat, include_usage, logprobs, t_start):
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": now,
                "model": model_id}
        piece = _PieceJson(head, chat, include_usage)

        def chunk(choices, usage=None):
            return _chunk_json(head, choices, include_usage, usage)

        usage = {"prompt_tokens": 0, "completion_tokens": 0}
        offsets = [0] * len(runs)
        first = True
        try:
            if chat:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(len(runs))])
            async for i, ev in _arrivals(runs):
                if ev.kind == "done":
                    if ev.finish_reason == "error":
                        err = {"error": {"message": f"generation failed: {ev.error}", "type": "server_error",
                                         "param": None, "code": "internal_error"}}
                        yield ("data: " + json.dumps(err) + "\n\n").encode()
                    usage["prompt_tokens"] += ev.prompt_tokens if i % n == 0 else 0
                    usage["completion_tokens"] += ev.completion_tokens
                    delta = {"delta": {}} if chat else {"text": ""}
                    yield chunk([{"index": i, **delta, "logprobs": None, "finish_reason": _finish(ev)}])
                    continue
                if first and ev.token is not None:
                    first = False
                    _note_first(t_start)
                lp = None
                if logprobs is not None and ev.token is not None and ev.logprob is not None \
                        and not tok.is_eog(ev.token):
                    x = _lp_entry(ev)
                    lp = {"content": [_chat_lp(x)]} if chat else _cmpl_lp([x], offsets[i])
                if ev.text or lp is not None:
                    offsets[i] += len(ev.text)
                    if lp is None:
                        yield piece(i, ev.text)
                        continue
                    body = {"delta": {"content": ev.text}} if chat else {"text": ev.text}
                    yield chunk([{"index": i, **body, "logprobs": lp, "finish_reason": None}])
            if include_usage:
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
                yield _chunk_json(head, [], True, usage)
            yield b"data: [DONE]\n\n"
        finally:  # also when the client disconnects: the slots are freed at once
            for r in runs:
                r.cancel()

    async def _arrivals(runs: List[_Run]):
        """(index, event) of the runs' events in arrival order, until each run is done."""
        if len(runs) == 1:  # the usual case: no task per event
            while not runs[0].done:
                yield 0, await runs[0].next()
            return
        waiting = {asyncio.ensure_future(r.next()): i for i, r in enumerate(runs)}
        try:
            while waiting:
                done, _ = await asyncio.wait(set(waiting), return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    i = waiting.pop(fut)
                    ev = fut.result()
                    if ev.kind != "done":
                        waiting[asyncio.ensure_future(runs[i].next())] = i
                    yield i, ev
        finally:
            for fut in waiting:
                fut.cancel()

    def _finish(ev: Event) -> str:
        return ev.finish_reason if ev.finish_reason in ("stop", "length") else (ev.finish_reason or "stop")

    async def on_api_error(request: Request, exc: APIError):
        return error(exc, request.url.path)

    async def on_http_error(request: Request, exc: HTTPException):
        type_ = "invalid_request_error"
        msg = {404: f"Unknown endpoint {request.method} {request.url.path}.",
               405: f"Method {request.method} is not allowed on {request.url.path}."}.get(exc.status_code, exc.detail)
        return error(APIError(exc.status_code, msg, type_), request.url.path)

    async def on_unexpected(request: Request, exc: Exception):
        return error(APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error",
                              code="internal_error"), request.url.path)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/health", health, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", model_one, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/completions", completions, methods=["POST"]),
        Route("/chat/completions", chat_completions, methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={APIError: on_api_error, HTTPException: on_http_error,
                                                      Exception: on_unexpected})
    app.state.engine = engine
    app.state.model_id = model_id
    return app


def serve(llm, host: str = "127.0.0.1", port: int = 8080, model_id: Optional[str] = None,
          api_key: Optional[str] = None, max_queue: int = 128, log_level: str = "warning", ready=None) -> None:
    """Serves until Ctrl-C (or SIGTERM). The socket is bound first, so port 0 takes a free port and
    the address printed is the real one; ready(host, port) is called once it listens."""
    import uvicorn

    app = make_app(llm, model_id=model_id, api_key=api_key, max_queue=max_queue)
    # The engine thread takes the GIL back after each forward pass: a short switch interval keeps it
    # from waiting out the event loop's 5 ms default slice.
    sys.setswitchinterval(float(os.environ.get("STOWLM_SWITCH_INTERVAL", "0.0005")))
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    bound = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=3, access_log=False)
    server = uvicorn.Server(config)
    hostport = f"[{host}]:{bound}" if family == socket.AF_INET6 else f"{host}:{bound}"
    print(f"stowlm: serving {app.state.model_id} at http://{hostport}/v1 ({llm.ctx.n_seq} slots of "
          f"{app.state.engine.slot_ctx} tokens); Ctrl-C stops", file=sys.stderr, flush=True)
    if ready is not None:
        ready(host, bound)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown: that is a clean stop
        pass
    finally:
        sock.close()
        llm.close()
    print("stowlm: stopped", file=sys.stderr, flush=True)
