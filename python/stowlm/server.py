"""`stowlm serve`: an OpenAI-compatible HTTP server over the continuous-batching engine.

Built on Starlette and uvicorn: a small, well-kept ASGI stack with streaming responses and no
request model of its own, so every request is checked here and every error has OpenAI's shape
({"error": {"message", "type", "param", "code"}}) and the right status. The engine runs on its own
thread (stowlm.batching); handlers only submit requests and await the events it posts back to the
event loop, so the loop never waits on a forward pass.

Endpoints: POST /v1/chat/completions, POST /v1/completions (both streamed as server-sent events
or not; request checks and result shapes in stowlm.protocol), POST /tokenize and /detokenize
(llama-server's shapes), GET /v1/models, GET /health, GET /metrics (Prometheus text).
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import threading
import time
import uuid
from typing import Dict, List, Mapping, Optional, Tuple

from .batching import Event, QueueFull

__all__ = ["make_app", "serve", "APIError"]

from .protocol import APIError, ChoiceOut, Job, parse_chat, parse_completion, usage as _usage  # noqa: F401


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

    def __init__(self, engine, mailbox: _Mailbox, tokens: List[int], params, job: Job):
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
            raise APIError(400, "'model': must be a string", param="model", code="invalid_value")
        if m not in (model_id, os.path.basename(os.fspath(llm.path))):
            raise APIError(404, f"The model '{m}' does not exist; this server serves '{model_id}'.", param="model",
                           code="model_not_found")

    def check_length(tokens: List[int]) -> None:
        if len(tokens) >= engine.ctx.n_ctx:
            raise APIError(400, f"This model's maximum context length is {engine.ctx.n_ctx} tokens (n_ctx, shared by "
                                f"{engine.n_seq} slots of {engine.slot_ctx}: a long request takes the cells of idle "
                                f"slots), but the prompt has {len(tokens)} tokens (and at least one must be "
                                "generated).", param="messages", code="context_length_exceeded")

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

    def submit(tokens: List[int], params, job: Job) -> _Run:
        try:
            return _Run(engine, mailbox(), tokens, params, job)
        except QueueFull as e:
            raise APIError(503, f"The server is busy: {e}. Retry later.", type_="server_error",
                           code="server_busy") from None
        except ValueError as e:
            raise APIError(400, str(e)) from None

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
        metric("draft_tokens_total", "counter", "Speculative draft tokens checked.", st["drafted_total"])
        metric("draft_tokens_accepted_total", "counter", "Speculative draft tokens kept.", st["accepted_total"])
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

    def _only(body: Mapping, allowed: set) -> None:
        for k in body:
            if k not in allowed:
                raise APIError(400, f"'{k}': is not a field of this endpoint ({', '.join(sorted(allowed))})",
                               param=k, code="unsupported_parameter")

    def _flag(body: Mapping, key: str, default: bool) -> bool:
        v = body.get(key, default)
        if not isinstance(v, bool):
            raise APIError(400, f"'{key}': must be true or false", param=key, code="invalid_value")
        return v

    async def tokenize(request: Request):
        """llama-server's POST /tokenize: {"content", "add_special", "parse_special", "with_pieces"}."""
        check_key(request)
        body = await read_json(request)
        _only(body, {"content", "add_special", "parse_special", "with_pieces", "model"})
        check_model(body)
        text = body.get("content")
        if not isinstance(text, str):
            raise APIError(400, "'content': must be a string", param="content", code="invalid_value")
        ids = await asyncio.to_thread(tok.encode, text, _flag(body, "add_special", False),
                                      _flag(body, "parse_special", True))
        if _flag(body, "with_pieces", False):
            pieces = []
            for t in ids:
                b = tok.token_bytes(t)
                try:
                    pieces.append({"id": t, "piece": b.decode("utf-8")})
                except UnicodeDecodeError:  # part of a character: its bytes, as llama-server gives them
                    pieces.append({"id": t, "piece": list(b)})
            ids = pieces
        metrics.count("/tokenize", 200)
        return JSONResponse({"tokens": ids})

    async def detokenize(request: Request):
        """llama-server's POST /detokenize: {"tokens"} -> {"content"}."""
        check_key(request)
        body = await read_json(request)
        _only(body, {"tokens", "model"})
        check_model(body)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise APIError(400, "'tokens': must be a list of token ids", param="tokens", code="invalid_value")
        bad = [t for t in ids if not 0 <= t < tok.vocab_size]
        if bad:
            raise APIError(400, f"'tokens': token id {bad[0]} is outside the vocabulary [0, {tok.vocab_size})",
                           param="tokens", code="invalid_value")
        metrics.count("/detokenize", 200)
        return JSONResponse({"content": tok.decode(ids)})

    async def completions(request: Request):
        return await _generate(request, chat=False)

    async def chat_completions(request: Request):
        return await _generate(request, chat=True)

    async def _generate(request: Request, chat: bool):
        path = request.url.path
        check_key(request)
        body = await read_json(request)
        check_model(body)
        job = await asyncio.to_thread(parse_chat if chat else parse_completion, body, llm)
        for p in job.prompts:
            check_length(p)
        runs: List[_Run] = []
        try:
            for p, pj in job.runs():
                runs.append(submit(p, pj, job))
        except APIError:
            for r in runs:
                r.cancel()
            raise
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        now = int(time.time())
        outs = [ChoiceOut(job, i, tok) for i in range(len(runs))]
        t_start = time.perf_counter()
        if job.stream:
            metrics.count(path, 200)
            return StreamingResponse(_sse(request, runs, outs, job, rid, now, t_start), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **job.headers})
        try:
            ok = await _collect_all(request, runs, outs, t_start)
        finally:
            for r in runs:
                r.cancel()
        if not ok:  # the client left
            metrics.count(path, 499)
            return Response(status_code=499)
        metrics.count(path, 200)
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion", "created": now,
                             "model": model_id, "choices": [o.result() for o in outs], "usage": _usage(outs, job.n)},
                            headers=job.headers)

    def _note_first(t_start: float) -> None:
        metrics.ttft_sum += time.perf_counter() - t_start
        metrics.ttft_count += 1

    def _failed(ev: Event) -> APIError:
        return APIError(500, f"generation failed: {ev.error}", type_="server_error", code="internal_error")

    async def _collect(run: _Run, out: ChoiceOut, t_start: float) -> None:
        first = True
        while True:
            ev = await run.next()
            if ev.kind == "done":
                if ev.finish_reason == "error":
                    raise _failed(ev)
                out.done(ev)
                return
            if first and ev.token is not None:
                first = False
                _note_first(t_start)
            out.piece(ev)

    async def _collect_all(request: Request, runs: List[_Run], outs: List[ChoiceOut], t_start: float) -> bool:
        tasks = [asyncio.ensure_future(_collect(r, o, t_start)) for r, o in zip(runs, outs)]
        pending = set(tasks)
        while pending:
            _, pending = await asyncio.wait(pending, timeout=0.5)
            if pending and await request.is_disconnected():
                for t in tasks:
                    t.cancel()
                return False
        for t in tasks:
            t.result()  # a failed generation raises its APIError here
        return True

    async def _sse(request, runs: List[_Run], outs: List[ChoiceOut], job: Job, rid, now, t_start):
        chat = job.chat
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": now,
                "model": model_id}
        fast = job.tools is None and job.logprobs is None  # a piece is plain text: the event made from parts
        piece = _PieceJson(head, chat, job.include_usage)

        def chunk(choices, usage=None):
            return _chunk_json(head, choices, job.include_usage, usage)

        first = True
        try:
            if chat:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(len(runs))])
            async for i, ev in _arrivals(runs):
                if ev.kind == "done":
                    if ev.finish_reason == "error":
                        yield ("data: " + json.dumps(_failed(ev).body()) + "\n\n").encode()
                    for c in outs[i].done(ev):
                        yield chunk([c])
                    continue
                if first and ev.token is not None:
                    first = False
                    _note_first(t_start)
                if fast:
                    if ev.text:
                        yield piece(i, ev.text)
                    continue
                c = outs[i].piece(ev)
                if c is not None:
                    yield chunk([c])
            if job.include_usage:
                yield _chunk_json(head, [], True, _usage(outs, job.n))
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
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
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
          f"{app.state.engine.slot_ctx} tokens, a long request takes idle slots' cells up to "
          f"{llm.ctx.n_ctx}); Ctrl-C stops", file=sys.stderr, flush=True)
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
