"""The OpenAI routes: /v1/models, /v1/completions and /v1/chat/completions (request checks in
stowlm.serve.protocol, result shapes in stowlm.serve.events), streamed as server-sent events or
answered whole. Handlers only submit requests and await the events the engine posts back to the
event loop, so the loop never waits on a forward pass. /v1/embeddings, on a server of an LLM
opened with embedding=True (`stowlm serve --embeddings`), runs on a worker thread."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Dict, List

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..batching import Event, QueueFull
from .context import ServerContext
from .events import ChoiceOut, Mailbox, PieceJson, Run, chunk_json, usage
from ..embedding import InputTooLong, openai_list
from .protocol import APIError, Job, only_fields, parse_chat, parse_completion

_EMBEDDING_FIELDS = {"input", "model", "encoding_format", "dimensions", "user"}

__all__ = ["OpenAIRoutes"]


class OpenAIRoutes:
    def __init__(self, ctx: ServerContext):
        self.ctx = ctx
        self._boxes: Dict[int, Mailbox] = {}

    # -- requests into the engine ------------------------------------------------------------------
    def _mailbox(self) -> Mailbox:
        engine = self.ctx.engine
        loop = asyncio.get_running_loop()
        box = self._boxes.get(id(loop))
        if box is None or box.loop is not loop:
            if box is not None:
                engine.step_listeners.remove(box.flush)
            box = self._boxes[id(loop)] = Mailbox(loop)
            engine.step_listeners.append(box.flush)
        return box

    def submit(self, tokens: List[int], params, job: Job) -> Run:
        try:
            return Run(self.ctx.engine, self._mailbox(), tokens, params, job)
        except QueueFull as e:
            raise APIError(503, f"The server is busy: {e}. Retry later.", type_="server_error",
                           code="server_busy") from None
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def check_length(self, tokens: List[int], param: str) -> None:
        engine = self.ctx.engine
        if len(tokens) >= engine.ctx.n_ctx:
            raise APIError(400, f"This model's maximum context length is {engine.ctx.n_ctx} tokens (n_ctx, shared by "
                                f"{engine.n_seq} slots of {engine.slot_ctx}: a long request takes the cells of idle "
                                f"slots), but the prompt has {len(tokens)} tokens (and at least one must be "
                                "generated).", param=param, code="context_length_exceeded")

    # -- the models ------------------------------------------------------------------------------------
    async def models(self, request: Request):
        ctx = self.ctx
        ctx.check_key(request)
        ctx.metrics.count("/v1/models", 200)
        llm = ctx.llm
        meta = {"n_ctx": llm.ctx.n_ctx, "n_ctx_slot": llm.ctx.capacity(0), "slots": llm.ctx.n_seq,
                "n_vocab": llm.model.n_vocab}
        if llm.embedding:
            meta.update(n_embd=llm.model.n_embd, pooling=llm.pooling)
        return JSONResponse({"object": "list", "data": [
            {"id": ctx.model_id, "object": "model", "created": ctx.created, "owned_by": "stowlm", "meta": meta}]})

    async def model_one(self, request: Request):
        ctx = self.ctx
        ctx.check_key(request)
        name = request.path_params["name"]
        if name != ctx.model_id:
            raise APIError(404, f"The model '{name}' does not exist.", param="model", code="model_not_found")
        ctx.metrics.count("/v1/models/{name}", 200)
        return JSONResponse({"id": ctx.model_id, "object": "model", "created": ctx.created, "owned_by": "stowlm"})

    # -- completions -----------------------------------------------------------------------------------
    async def completions(self, request: Request):
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request):
        return await self._generate(request, chat=True)

    async def embeddings(self, request: Request):
        """OpenAI's POST /v1/embeddings: {"input", "model", "encoding_format", "dimensions", "user"}."""
        ctx = self.ctx
        ctx.check_key(request)
        llm = ctx.llm
        if not llm.embedding:
            raise APIError(400, "This server generates text; it computes no embeddings. Start one with --embeddings "
                                "for /v1/embeddings.", code="embeddings_disabled")
        body = await ctx.read_json(request)
        only_fields(body, _EMBEDDING_FIELDS)
        ctx.check_model(body)
        if "input" not in body:
            raise APIError(400, "'input': is required", param="input", code="missing_required_parameter")
        fmt = body.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise APIError(400, "'encoding_format': must be 'float' or 'base64'", param="encoding_format",
                           code="invalid_value")
        dims = body.get("dimensions")
        if dims is not None and dims != llm.model.n_embd:
            raise APIError(400, f"'dimensions': this model's embeddings have {llm.model.n_embd} dimensions, and it "
                                "cannot give fewer", param="dimensions", code="invalid_value")
        if llm.pooling == "none":  # as llama-server: per-token vectors have no place in OpenAI's format
            raise APIError(400, "Pooling 'none' gives a vector per token, which OpenAI's embeddings format has no "
                                "place for; start the server with --pooling mean, last or cls.", param="input",
                           code="invalid_value")
        try:
            vecs, _, n = await asyncio.to_thread(llm.embed_arrays, body["input"])
        except InputTooLong as e:
            raise APIError(400, f"input[{e.index}] has {e.n_tokens} tokens, more than the {e.capacity} one input may "
                                "have here (n_ctx / --parallel)", param="input",
                           code="context_length_exceeded") from None
        except ValueError as e:
            raise APIError(400, str(e), param="input", code="invalid_value") from None
        ctx.metrics.embedded(len(vecs), n)
        ctx.metrics.count(request.url.path, 200)
        return JSONResponse(openai_list(vecs, ctx.model_id, n, fmt))

    async def _generate(self, request: Request, chat: bool):
        ctx = self.ctx
        path = request.url.path
        body = await ctx.generation_body(request)
        job = await asyncio.to_thread(parse_chat if chat else parse_completion, body, ctx.llm)
        for p in job.prompts:
            self.check_length(p, "messages" if chat else "prompt")
        runs: List[Run] = []
        try:
            for p, pj in job.runs():
                runs.append(self.submit(p, pj, job))
        except APIError:
            for r in runs:
                r.cancel()
            raise
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        now = int(time.time())
        outs = [ChoiceOut(job, i, ctx.tok) for i in range(len(runs))]
        t_start = time.perf_counter()
        if job.stream:
            ctx.metrics.count(path, 200)
            return StreamingResponse(self._sse(runs, outs, job, rid, now, t_start), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **job.headers})
        try:
            ok = await self._collect_all(request, runs, outs, t_start)
        finally:
            for r in runs:
                r.cancel()
        if not ok:  # the client left
            ctx.metrics.count(path, 499)
            return Response(status_code=499)
        ctx.metrics.count(path, 200)
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion", "created": now,
                             "model": ctx.model_id, "choices": [o.result() for o in outs], "usage": usage(outs, job.n)},
                            headers=job.headers)

    @staticmethod
    def _failed(ev: Event) -> APIError:
        return APIError(500, f"generation failed: {ev.error}", type_="server_error", code="internal_error")

    async def _collect(self, run: Run, out: ChoiceOut, t_start: float) -> None:
        first = True
        while True:
            ev = await run.next()
            if ev.kind == "done":
                if ev.finish_reason == "error":
                    raise self._failed(ev)
                out.done(ev)
                return
            if first and ev.token is not None:
                first = False
                self.ctx.metrics.first_token(t_start)
            out.piece(ev)

    async def _collect_all(self, request: Request, runs: List[Run], outs: List[ChoiceOut], t_start: float) -> bool:
        tasks = [asyncio.ensure_future(self._collect(r, o, t_start)) for r, o in zip(runs, outs)]
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

    async def _sse(self, runs: List[Run], outs: List[ChoiceOut], job: Job, rid, now, t_start):
        chat = job.chat
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": now,
                "model": self.ctx.model_id}
        fast = job.tools is None and job.logprobs is None  # a piece is plain text: the event made from parts
        piece = PieceJson(head, chat, job.include_usage)

        def chunk(choices, usage=None):
            return chunk_json(head, choices, job.include_usage, usage)

        first = True
        try:
            if chat:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(len(runs))])
            if job.echo is not None:  # each choice's prompt first
                for i in range(len(runs)):
                    yield chunk([{"index": i, "text": job.echo_text(i), "logprobs": None, "finish_reason": None}])
            async for i, ev in _arrivals(runs):
                if ev.kind == "done":
                    if ev.finish_reason == "error":
                        yield ("data: " + json.dumps(self._failed(ev).body()) + "\n\n").encode()
                    for c in outs[i].done(ev):
                        yield chunk([c])
                    continue
                if first and ev.token is not None:
                    first = False
                    self.ctx.metrics.first_token(t_start)
                if fast:
                    if ev.text:
                        yield piece(i, ev.text)
                    continue
                c = outs[i].piece(ev)
                if c is not None:
                    yield chunk([c])
            if job.include_usage:
                yield chunk_json(head, [], True, usage(outs, job.n))
            yield b"data: [DONE]\n\n"
        finally:  # also when the client disconnects: the slots are freed at once
            for r in runs:
                r.cancel()


async def _arrivals(runs: List[Run]):
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
