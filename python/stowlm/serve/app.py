"""The HTTP app: routes, errors and the server's own endpoints (/health, /metrics), and
`stowlm serve` running it under uvicorn.

Built on Starlette and uvicorn: a small, well-kept ASGI stack with streaming responses and no
request model of its own, so every request is checked here and every error has OpenAI's shape
({"error": {"message", "type", "param", "code"}}) and the right status. The engine runs on its own
thread (stowlm.batching); the OpenAI routes are stowlm.serve.openai's, llama-server's own
(/completion, /infill, /props, /tokenize, /detokenize) stowlm.serve.native's.
"""
from __future__ import annotations

import os
import socket
import sys
from typing import Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from .context import ServerContext
from .native import NativeRoutes
from .openai import OpenAIRoutes
from .protocol import APIError

__all__ = ["make_app", "serve"]


def make_app(llm, model_id: Optional[str] = None, api_key: Optional[str] = None, max_queue: int = 128):
    """The ASGI app serving `llm` (its engine is made here, with max_queue waiting requests; an LLM
    opened with embedding=True has none and serves /v1/embeddings instead of generating)."""
    engine = None if llm.embedding else llm.engine(max_queue=max_queue)
    ctx = ServerContext(llm, engine, model_id, api_key)
    metrics = ctx.metrics
    openai = OpenAIRoutes(ctx)
    native = NativeRoutes(ctx, openai)

    async def health(request: Request):
        metrics.count("/health", 200)
        if engine is None:
            return JSONResponse({"status": "ok"})
        st = engine.stats()
        return JSONResponse({"status": "ok", "slots_idle": st["slots"] - st["slots_busy"],
                             "slots_processing": st["slots_busy"]})

    async def prometheus(request: Request):
        ctx.check_key(request)
        metrics.count("/metrics", 200)
        return PlainTextResponse(metrics.prometheus(None if engine is None else engine.stats()),
                                 media_type="text/plain; version=0.0.4")

    async def on_api_error(request: Request, exc: APIError):
        return ctx.error(exc, request.url.path)

    async def on_http_error(request: Request, exc: HTTPException):
        type_ = "invalid_request_error"
        msg = {404: f"Unknown endpoint {request.method} {request.url.path}.",
               405: f"Method {request.method} is not allowed on {request.url.path}."}.get(exc.status_code, exc.detail)
        return ctx.error(APIError(exc.status_code, msg, type_), request.url.path)

    async def on_unexpected(request: Request, exc: Exception):
        return ctx.error(APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error",
                                  code="internal_error"), request.url.path)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/health", health, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
        Route("/v1/models", openai.models, methods=["GET"]),
        Route("/v1/models/{name:path}", openai.model_one, methods=["GET"]),
        Route("/v1/completions", openai.completions, methods=["POST"]),
        Route("/v1/chat/completions", openai.chat_completions, methods=["POST"]),
        Route("/completions", openai.completions, methods=["POST"]),
        Route("/tokenize", native.tokenize, methods=["POST"]),
        Route("/detokenize", native.detokenize, methods=["POST"]),
        Route("/completion", native.completion, methods=["POST"]),
        Route("/infill", native.infill, methods=["POST"]),
        Route("/props", native.props, methods=["GET"]),
        Route("/chat/completions", openai.chat_completions, methods=["POST"]),
        Route("/v1/embeddings", openai.embeddings, methods=["POST"]),
        Route("/embeddings", openai.embeddings, methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={APIError: on_api_error, HTTPException: on_http_error,
                                                      Exception: on_unexpected})
    app.state.engine = engine
    app.state.model_id = ctx.model_id
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
    if llm.embedding:
        what = (f"embeddings ({llm.pooling} pooling, inputs of up to {llm.ctx.capacity(0)} tokens, {llm.ctx.n_seq} "
                "a pass)")
    else:
        what = (f"{llm.ctx.n_seq} slots of {app.state.engine.slot_ctx} tokens, a long request takes idle slots' "
                f"cells up to {llm.ctx.n_ctx}")
    print(f"stowlm: serving {app.state.model_id} at http://{hostport}/v1 ({what}); Ctrl-C stops", file=sys.stderr,
          flush=True)
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
