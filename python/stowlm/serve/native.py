"""llama-server's own routes, for the clients written against it: POST /completion (its native
completion: `prompt`, `n_predict`, its sampling fields; `content`, `stop_type`, `timings` back,
streamed as server-sent events without OpenAI's envelope), POST /infill (the same around a
fill-in-the-middle prompt: `input_prefix`, `input_suffix`, `input_extra`, what editor plugins such
as llama.vim and llama.vscode send), GET /props, POST /tokenize and /detokenize. Requests are
checked by stowlm.serve.protocol like the OpenAI routes', so a field stowlm does not honour is a
400 naming it, never dropped."""
from __future__ import annotations

import asyncio
import json
import time
from typing import List, Mapping, Optional, Tuple

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..text.infill import infill_prompt
from ..text.sampling import SamplingParams
from ..version import __version__
from .context import ServerContext
from .events import ChoiceOut
from .protocol import (_COMMON, MAX_TOP_LOGPROBS, APIError, Job, _bad, _bool, _check_fields, _grammar, _num,
                       only_fields, prompts, sampling)

__all__ = ["NativeRoutes", "parse_native"]

# /completion's fields: llama-server's sampling and prompt fields (OpenAI's n, logprobs and
# stream_options are not its)
NATIVE_FIELDS = (_COMMON - {"n", "logprobs", "stream_options", "user"}) | {"prompt", "return_tokens", "id_slot"}
# /infill's: /completion's, with `prompt` the text right before the cursor (after input_prefix)
INFILL_FIELDS = NATIVE_FIELDS | {"input_prefix", "input_suffix", "input_extra"}
_STOP_TYPE = {"length": "limit", "cancelled": "none"}


def parse_native(body: Mapping, llm, tokens: Optional[List[int]] = None) -> Tuple[Job, bool]:
    """A /completion body as a Job of one prompt (its own, or the given tokens), and whether its
    token ids go back (return_tokens). Tokenizes: call it off the event loop."""
    if tokens is None:
        _check_fields(body, NATIVE_FIELDS)
        if isinstance(body.get("prompt"), list) and body["prompt"] and not isinstance(body["prompt"][0], int):
            raise _bad("prompt", "one prompt a request here: a string or a list of token ids (several go to "
                                 "/v1/completions)")
        tokens = prompts(body, llm)[0]
    if body.get("id_slot") not in (None, -1):
        raise _bad("id_slot", "stowlm chooses the slot (the one whose cache keeps the most of the prompt); only -1",
                   "unsupported_parameter")
    n_probs = _num(body, "n_probs", 0, MAX_TOP_LOGPROBS, None, integer=True)
    job = Job(False, [tokens], sampling(body, llm, None, False), 1, _bool(body, "stream"), False,
              n_probs or None, _grammar(body, llm, None))
    return job, _bool(body, "return_tokens")


def parse_infill(body: Mapping, llm, budget: int) -> Tuple[Job, bool]:
    """An /infill body as parse_native's Job, its prompt made by infill_prompt within budget tokens."""
    _check_fields(body, INFILL_FIELDS)
    texts = {}
    for f in ("input_prefix", "input_suffix", "prompt"):
        v = body.get(f, "")
        if not isinstance(v, str):
            raise _bad(f, "must be a string")
        texts[f] = v
    extra = body.get("input_extra") or []
    if not isinstance(extra, list) or not all(isinstance(c, Mapping) and isinstance(c.get("text", ""), str) and
                                              isinstance(c.get("filename", ""), str) for c in extra):
        raise _bad("input_extra", 'must be a list of {"filename": string, "text": string}')
    try:
        tokens = infill_prompt(llm.tokenizer, texts["input_prefix"], texts["input_suffix"],
                               [(c.get("filename") or "tmp", c.get("text", "")) for c in extra], texts["prompt"],
                               budget=budget, name=llm.path.name)
    except ValueError as e:
        raise _bad("input_prefix", str(e), "unsupported_parameter") from None
    return parse_native(body, llm, tokens)


class NativeRoutes:
    def __init__(self, ctx: ServerContext, oai):
        self.ctx, self.oai = ctx, oai  # the OpenAI routes: their request checks and submission

    async def props(self, request: Request):
        """llama-server's GET /props: the slots' context, the chat template, the model."""
        ctx = self.ctx
        ctx.check_key(request)
        llm = ctx.llm
        template = getattr(llm, "_template", None)
        ctx.metrics.count("/props", 200)
        return JSONResponse({
            "default_generation_settings": {"n_ctx": llm.ctx.capacity(0), "params": _settings(None, llm)},
            "total_slots": llm.ctx.n_seq, "model_path": str(llm.path), "model_alias": ctx.model_id,
            "chat_template": template.source if template is not None else "",
            "modalities": {"vision": False, "audio": False}, "build_info": f"stowlm {__version__}",
            "embeddings": bool(llm.embedding)})

    async def tokenize(self, request: Request):
        """llama-server's POST /tokenize: {"content", "add_special", "parse_special", "with_pieces"}."""
        ctx, tok = self.ctx, self.ctx.tok
        ctx.check_key(request)
        body = await ctx.read_json(request)
        only_fields(body, {"content", "add_special", "parse_special", "with_pieces", "model"})
        ctx.check_model(body)
        text = body.get("content")
        if not isinstance(text, str):
            raise APIError(400, "'content': must be a string", param="content", code="invalid_value")
        ids = await asyncio.to_thread(tok.encode, text, _bool(body, "add_special", False),
                                      _bool(body, "parse_special", True))
        if _bool(body, "with_pieces", False):
            pieces = []
            for t in ids:
                b = tok.token_bytes(t)
                try:
                    pieces.append({"id": t, "piece": b.decode("utf-8")})
                except UnicodeDecodeError:  # part of a character: its bytes, as llama-server gives them
                    pieces.append({"id": t, "piece": list(b)})
            ids = pieces
        ctx.metrics.count("/tokenize", 200)
        return JSONResponse({"tokens": ids})

    async def detokenize(self, request: Request):
        """llama-server's POST /detokenize: {"tokens"} -> {"content"}."""
        ctx, tok = self.ctx, self.ctx.tok
        ctx.check_key(request)
        body = await ctx.read_json(request)
        only_fields(body, {"tokens", "model"})
        ctx.check_model(body)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise APIError(400, "'tokens': must be a list of token ids", param="tokens", code="invalid_value")
        bad = [t for t in ids if not 0 <= t < tok.vocab_size]
        if bad:
            raise APIError(400, f"'tokens': token id {bad[0]} is outside the vocabulary [0, {tok.vocab_size})",
                           param="tokens", code="invalid_value")
        ctx.metrics.count("/detokenize", 200)
        return JSONResponse({"content": tok.decode(ids)})

    async def completion(self, request: Request):
        ctx = self.ctx
        body = await ctx.generation_body(request)
        return await self._run(request, body, *await asyncio.to_thread(parse_native, body, ctx.llm), "/completion")

    async def infill(self, request: Request):
        """llama-server's POST /infill: /completion's answer for a fill-in-the-middle prompt. The
        prompt is cut to fit the slot with n_predict (or a quarter of the slot) left to generate."""
        ctx = self.ctx
        body = await ctx.generation_body(request)
        slot = ctx.engine.slot_ctx
        n_predict = body.get("n_predict", body.get("max_tokens"))
        reserve = n_predict if isinstance(n_predict, int) and 0 < n_predict < slot else slot // 4
        job, return_tokens = await asyncio.to_thread(parse_infill, body, ctx.llm, slot - reserve)
        return await self._run(request, body, job, return_tokens, "/infill")

    async def _run(self, request: Request, body: Mapping, job: Job, return_tokens: bool, route: str):
        ctx = self.ctx
        tokens = job.prompts[0]
        self.oai.check_length(tokens, "prompt")
        run = self.oai.submit(tokens, job.params, job)
        prompt = body.get("prompt") if route == "/completion" else tokens
        out = _NativeOut(job, ctx.tok, len(tokens), ctx.model_id, prompt, ctx.llm, return_tokens)
        if job.stream:
            ctx.metrics.count(route, 200)
            return StreamingResponse(self._sse(run, out), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        async def collect():
            while True:
                e = await run.next()
                if e.kind == "done":
                    return e
                out.piece(e)
        task = asyncio.ensure_future(collect())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.5)
                if not task.done() and await request.is_disconnected():  # the client left: free the slot
                    task.cancel()
                    ctx.metrics.count(route, 499)
                    return Response(status_code=499)
            ev = task.result()
        finally:
            run.cancel()
        if ev.finish_reason == "error":
            raise APIError(500, f"generation failed: {ev.error}", type_="server_error", code="internal_error")
        ctx.metrics.count(route, 200)
        return JSONResponse(out.final(ev, stream=False))

    async def _sse(self, run, out: "_NativeOut"):
        try:
            while True:
                ev = await run.next()
                if ev.kind == "done":
                    if ev.finish_reason == "error":
                        yield _event({"error": {"code": 500, "message": f"generation failed: {ev.error}",
                                                "type": "server_error"}})
                    else:
                        yield _event(out.final(ev, stream=True))
                    return
                piece = out.piece(ev)
                if piece is not None:
                    yield _event(piece)
        finally:
            run.cancel()


def _event(d: dict) -> bytes:
    return ("data: " + json.dumps(d, ensure_ascii=False) + "\n\n").encode("utf-8")


def _settings(params, llm) -> dict:
    """generation_settings: the sampling values a request ran with (the defaults for None)."""
    p = params or SamplingParams(max_tokens=None)  # /completion's default: no limit
    return {"n_predict": -1 if p.max_tokens is None else p.max_tokens, "temperature": p.temperature,
            "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p, "repeat_penalty": p.repeat_penalty,
            "repeat_last_n": p.repeat_last_n, "presence_penalty": p.presence_penalty,
            "frequency_penalty": p.frequency_penalty, "seed": -1 if p.seed is None else p.seed,
            "stop": list(p.stop), "typical_p": p.typical_p, "mirostat": p.mirostat, "mirostat_tau": p.mirostat_tau,
            "mirostat_eta": p.mirostat_eta, "n_ctx": llm.ctx.capacity(0)}


class _NativeOut:
    """One /completion's text, tokens, probabilities and times, in llama-server's shapes."""

    def __init__(self, job: Job, tok, n_prompt: int, model: str, prompt, llm, return_tokens: bool):
        self.job, self.tok, self.n_prompt, self.model, self.llm = job, tok, n_prompt, model, llm
        self.prompt = prompt if isinstance(prompt, str) else tok.decode(prompt or [])
        self.choice = ChoiceOut(job, 0, tok)  # the text, held back at a possible stop string as OpenAI's is
        self.tokens: List[int] = []
        self.probs: List[dict] = []  # completion_probabilities
        self.t0, self.t_first = time.perf_counter(), None
        self.return_tokens = return_tokens

    def _prob(self, t: int, lp: float) -> dict:
        piece = self.tok.decode([t])
        return {"id": t, "token": piece, "logprob": lp, "bytes": list(piece.encode("utf-8"))}

    def piece(self, ev) -> Optional[dict]:
        new = []
        if ev.token is not None:
            self.tokens.append(ev.token)
            self.t_first = self.t_first or time.perf_counter()
            if self.job.logprobs is not None and ev.logprob is not None and not self.tok.is_eog(ev.token):
                new = [dict(self._prob(ev.token, ev.logprob),
                            top_logprobs=[self._prob(t, lp) for t, lp in ev.top_logprobs or []])]
                self.probs += new
        c = self.choice.piece(ev)
        if c is None and not new:
            return None
        d = {"index": 0, "content": c["text"] if c else "", "tokens": [ev.token] if self.return_tokens and
             ev.token is not None else [], "stop": False, "id_slot": -1, "tokens_predicted": len(self.tokens),
             "tokens_evaluated": self.n_prompt}
        if new:
            d["completion_probabilities"] = new
        return d

    def final(self, ev, stream: bool) -> dict:
        tail = self.choice.done(ev)
        t_end = time.perf_counter()
        text = "".join(self.choice.text)
        first = self.t_first or t_end
        n = ev.completion_tokens
        prompt_ms, pred_ms = (first - self.t0) * 1e3, (t_end - first) * 1e3
        n_eval = max(self.n_prompt - ev.cached_tokens, 0)
        stop_type = "word" if ev.stop_word else _STOP_TYPE.get(ev.finish_reason, "eos")
        res = {"index": 0, "content": "".join(c.get("text", "") for c in tail) if stream else text,
               "tokens": [] if stream or not self.return_tokens else self.tokens, "id_slot": ev.slot, "stop": True,
               "model": self.model, "tokens_predicted": n, "tokens_evaluated": self.n_prompt,
               "generation_settings": _settings(self.job.params, self.llm), "prompt": self.prompt,
               "has_new_line": "\n" in text, "truncated": False, "stop_type": stop_type,
               "stopping_word": ev.stop_word or "", "tokens_cached": ev.cached_tokens,
               "timings": {"prompt_n": n_eval, "prompt_ms": prompt_ms,
                           "prompt_per_token_ms": prompt_ms / n_eval if n_eval else 0.0,
                           "prompt_per_second": n_eval / prompt_ms * 1e3 if prompt_ms > 0 else 0.0,
                           "predicted_n": n, "predicted_ms": pred_ms,
                           "predicted_per_token_ms": pred_ms / n if n else 0.0,
                           "predicted_per_second": n / pred_ms * 1e3 if pred_ms > 0 else 0.0}}
        if not stream and self.job.logprobs is not None:
            res["completion_probabilities"] = self.probs
        return res
