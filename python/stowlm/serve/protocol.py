"""OpenAI's requests, checked: shared by the server and ``LLM.create_*`` (stowlm.compat).

A request body is checked field by field: every field is honoured, or refused with an error that
names it (``param``); nothing is dropped silently. That covers OpenAI's fields stowlm does not
implement (refused), those that have no effect on a local model by nature (``user``, ``store``:
false, ...: accepted) and llama-server's extensions (``top_k``, ``min_p``, ``repeat_penalty``,
``grammar``, ``json_schema``, ``n_probs``, ...; a sampler stowlm does not have is accepted only
at its neutral value). :func:`parse_chat` and :func:`parse_completion` turn a body into a
:class:`Job`; stowlm.serve.events makes its engine events into OpenAI's responses.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..text.grammar import FieldError, StructuredUnavailable
from ..text.infill import fim_prompt
from ..text.sampling import SamplingParams
from ..text.toolcalls import ToolRequest
from ..text.toolparser import new_call_id

__all__ = ["APIError", "Job", "parse_chat", "parse_completion", "MAX_N", "MAX_STOP", "MAX_TOP_LOGPROBS"]

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


def _bad(param: str, why: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"'{param}': {why}", param=param, code=code)


# -- which fields a request may carry ------------------------------------------------------------------

_COMMON = {"model", "n", "stream", "stream_options", "temperature", "top_p", "stop", "seed", "max_tokens",
           "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "user", "response_format",
           # llama-server's
           "top_k", "min_p", "repeat_penalty", "repeat_last_n", "n_predict", "cache_prompt", "grammar",
           "json_schema", "ignore_eos", "n_probs", "typical_p", "mirostat", "mirostat_tau", "mirostat_eta"}
CHAT_FIELDS = _COMMON | {"messages", "top_logprobs", "max_completion_tokens", "tools", "tool_choice",
                         "parallel_tool_calls", "metadata", "service_tier", "modalities", "safety_identifier",
                         "prompt_cache_key"}
COMPLETION_FIELDS = _COMMON | {"prompt", "best_of", "suffix", "echo"}
# Samplers and options stowlm does not have: accepted at the value that turns them off.
NEUTRAL = {"tfs_z": 1.0, "mirostat_mode": 0, "dynatemp_range": 0.0,
           "xtc_probability": 0.0, "dry_multiplier": 0.0, "top_n_sigma": -1.0, "store": False,
           "return_tokens": False, "post_sampling_probs": False, "timings_per_token": False}
_MESSAGE_FIELDS = {
    "system": {"role", "content", "name"}, "developer": {"role", "content", "name"},
    "user": {"role", "content", "name"},
    "assistant": {"role", "content", "name", "tool_calls", "refusal", "reasoning_content"},
    "tool": {"role", "content", "tool_call_id", "name"},
}


def only_fields(body: Mapping, allowed: set) -> None:
    """An endpoint with a fixed set of fields (no OpenAI neutral values): anything else is a 400."""
    for k in body:
        if k not in allowed:
            raise APIError(400, f"'{k}': is not a field of this endpoint ({', '.join(sorted(allowed))})",
                           param=k, code="unsupported_parameter")


def _check_fields(body: Mapping, allowed: set) -> None:
    for k, v in body.items():
        if k in allowed:
            continue
        if k in NEUTRAL:
            neutral = NEUTRAL[k]
            if v is None or (v == neutral and isinstance(v, bool) == isinstance(neutral, bool)
                             and isinstance(v, (bool, int, float))):
                continue
            raise _bad(k, f"is not supported by stowlm (only {json.dumps(neutral)}, which leaves it off)",
                       "unsupported_parameter")
        if k in ("functions", "function_call"):
            raise _bad(k, "is the deprecated form of tools; send 'tools' and 'tool_choice'", "unsupported_parameter")
        raise _bad(k, "is not a field stowlm supports for this endpoint", "unsupported_parameter")


# -- values ------------------------------------------------------------------------------------------------

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
    if isinstance(v, list):  # llama-server's [[token, bias], ...]; false bans the token
        try:
            v = {str(t): (-100 if b is False else b) for t, b in v}
        except (TypeError, ValueError):
            raise _bad("logit_bias", "must be an object mapping token ids to biases") from None
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


def _seed(v: Optional[int]) -> Optional[int]:
    return None if v is None else v % (1 << 64)  # OpenAI's seeds may be negative


def sampling(body: Mapping, llm, max_tokens_default: Optional[int], chat: bool) -> SamplingParams:
    d = SamplingParams()
    n_vocab = llm.model.n_vocab
    max_tokens = _num(body, "max_tokens", 1, 1 << 30, None, integer=True)
    max_tokens = _num(body, "n_predict", -1, 1 << 30, max_tokens, integer=True)
    if max_tokens == -1:  # llama-server: -1 is no limit
        max_tokens = None
    elif max_tokens == 0:
        raise _bad("n_predict", "must be -1 (no limit) or >= 1")
    if chat:
        max_tokens = _num(body, "max_completion_tokens", 1, 1 << 30, max_tokens, integer=True)
    bias = _logit_bias(body, n_vocab)
    if _bool(body, "ignore_eos"):
        bias.update({t: -math.inf for t in llm.tokenizer.eog_ids if t < n_vocab})
    try:
        return SamplingParams(
            temperature=_num(body, "temperature", 0.0, 2.0, d.temperature),
            top_p=max(_num(body, "top_p", 0.0, 1.0, d.top_p), 1e-9),  # 0: the best token only
            top_k=_num(body, "top_k", 0, 1 << 30, d.top_k, integer=True),
            min_p=_num(body, "min_p", 0.0, 1.0, d.min_p),
            repeat_penalty=_num(body, "repeat_penalty", 0.01, 100.0, d.repeat_penalty),
            repeat_last_n=_num(body, "repeat_last_n", -1, 1 << 30, d.repeat_last_n, integer=True),
            presence_penalty=_num(body, "presence_penalty", -2.0, 2.0, 0.0),
            frequency_penalty=_num(body, "frequency_penalty", -2.0, 2.0, 0.0),
            seed=_seed(_num(body, "seed", -(1 << 63), (1 << 64) - 1, None, integer=True)),
            max_tokens=max_tokens if max_tokens is not None or "n_predict" in body else max_tokens_default,
            stop=_stop(body),
            logit_bias=bias,
            typical_p=_num(body, "typical_p", 0.0, 1.0, d.typical_p),
            mirostat=_num(body, "mirostat", 0, 2, d.mirostat, integer=True),
            mirostat_tau=_num(body, "mirostat_tau", 0.0, 1e4, d.mirostat_tau),
            mirostat_eta=_num(body, "mirostat_eta", 0.0, 1e4, d.mirostat_eta))
    except ValueError as e:
        raise APIError(400, str(e)) from None


# -- messages and prompts -------------------------------------------------------------------------------------

def _text_of(content, where: str) -> str:
    """A message's content: a string, or OpenAI's list of parts (text parts only)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str) \
                    or set(part) - {"type", "text"}:
                raise _bad(where, "content parts must be {\"type\": \"text\", \"text\": ...} (this model reads text only)")
            out.append(part["text"])
        return "".join(out)
    raise _bad(where, "content must be a string or a list of text parts")


def _check_tool_calls(calls, where: str) -> List[dict]:
    if not isinstance(calls, list) or not calls:
        raise _bad(where, "must be a non-empty list of {\"id\", \"type\": \"function\", \"function\"}")
    out = []
    for j, c in enumerate(calls):
        w = f"{where}[{j}]"
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or c.get("type", "function") != "function" or set(c) - {"id", "type", "function"}:
            raise _bad(w, "must be {\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\"}}")
        if not isinstance(f.get("name"), str) or not isinstance(f.get("arguments", ""), (str, dict)) \
                or set(f) - {"name", "arguments"}:
            raise _bad(f"{w}.function", "must be {\"name\": string, \"arguments\": JSON string}")
        if c.get("id") is not None and not isinstance(c["id"], str):
            raise _bad(f"{w}.id", "must be a string")
        args = f.get("arguments", "{}")
        out.append({"id": c.get("id") or new_call_id(), "type": "function",
                    "function": {"name": f["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}})
    return out


def messages(body: Mapping) -> List[Dict[str, Any]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "must be a non-empty list of {\"role\", \"content\"} objects")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(where, "must be an object with a string 'role'")
        role = m["role"]
        if role not in _MESSAGE_FIELDS:
            raise _bad(f"{where}.role", f"unknown role {role!r}" +
                       (" (the deprecated function role: send role 'tool' with tool_call_id)" if role == "function" else ""))
        extra = set(m) - _MESSAGE_FIELDS[role]
        if extra:
            k = sorted(extra)[0]
            raise _bad(f"{where}.{k}", f"is not a field of a {role} message stowlm supports")
        msg: Dict[str, Any] = {"role": "system" if role == "developer" else role}
        calls = m.get("tool_calls")
        if calls is not None:
            msg["tool_calls"] = _check_tool_calls(calls, f"{where}.tool_calls")
        if m.get("content") is None:
            if not msg.get("tool_calls"):
                raise _bad(f"{where}.content", "is missing (only an assistant message with tool_calls may leave it out)")
            msg["content"] = None
        else:
            msg["content"] = _text_of(m["content"], f"{where}.content")
        for k in ("name", "tool_call_id"):
            if m.get(k) is not None:
                if not isinstance(m[k], str):
                    raise _bad(f"{where}.{k}", "must be a string")
                msg[k] = m[k]
        if role == "tool" and "tool_call_id" not in msg:
            raise _bad(f"{where}.tool_call_id", "is missing (a tool message answers the call with that id)")
        if m.get("refusal") is not None and not isinstance(m["refusal"], str):
            raise _bad(f"{where}.refusal", "must be a string")
        out.append(msg)
    return out


def prompts(body: Mapping, llm) -> List[List[int]]:
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


# -- a request, checked ------------------------------------------------------------------------------------

@dataclass
class Job:
    chat: bool
    prompts: List[List[int]]
    params: SamplingParams
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: Optional[int] = None  # None: none; N: the chosen token's and the best N
    grammar: Any = None             # stowlm.text.grammar.Grammar
    tools: Optional[ToolRequest] = None
    headers: Dict[str, str] = field(default_factory=dict)
    echo: Optional[List[str]] = None  # each prompt's text, to come back before its completion (echo)

    def echo_text(self, index: int) -> str:
        """The text choice `index` starts with: its prompt's with echo, else nothing."""
        return "" if self.echo is None else self.echo[index // self.n]

    @property
    def special(self) -> bool:
        """Keep control tokens in the text: the tool format's markers are control tokens."""
        return self.tools is not None and self.tools.needs_special

    def runs(self) -> List[Tuple[List[int], SamplingParams]]:
        """One run per (prompt, choice): index i * n + j; a seeded request gives choice j seed + j."""
        out = []
        for p in self.prompts:
            for j in range(self.n):
                pj = self.params if j == 0 or self.params.seed is None else \
                    SamplingParams(**{**self.params.__dict__, "seed": self.params.seed + j})
                out.append((p, pj))
        return out


def _common(body: Mapping, chat: bool) -> Tuple[int, bool, bool]:
    n = _num(body, "n", 1, MAX_N, 1, integer=True)
    stream = _bool(body, "stream")
    so = body.get("stream_options")
    if so is not None and (not isinstance(so, dict) or set(so) - {"include_usage"}):
        raise _bad("stream_options", "must be an object {\"include_usage\": bool}")
    if so is not None and not stream:
        raise _bad("stream_options", "is only allowed with 'stream': true")
    include_usage = stream and _bool(so or {}, "include_usage")
    _bool(body, "cache_prompt")  # prefixes are reused either way, with the same results
    for k in ("user", "safety_identifier", "prompt_cache_key"):
        if body.get(k) is not None and not isinstance(body[k], str):
            raise _bad(k, "must be a string")
    return n, stream, include_usage


def _grammar(body: Mapping, llm, tools: Optional[ToolRequest]):
    fields = [k for k in ("response_format", "grammar", "json_schema") if body.get(k) is not None]
    if tools is not None and not tools.tools:
        tools = None  # a format's channels only (harmony): the grammar fields apply as usual
    if tools is not None and fields and not (fields == ["response_format"] and
                                             isinstance(body["response_format"], dict) and
                                             body["response_format"].get("type") == "text"):
        raise _bad(fields[0], "cannot be combined with 'tools' (give tool_choice 'none', or leave the tools out)")
    try:
        if tools is not None:
            text = tools.grammar(llm.tokenizer)
            from ..text.grammar import Grammar

            return None if text is None else Grammar(llm.tokenizer, text, llm.model.n_vocab, "tools")
        return llm.grammar(response_format=body.get("response_format"), grammar=body.get("grammar"),
                           json_schema=body.get("json_schema"))
    except StructuredUnavailable as e:
        raise APIError(400, str(e), param=(fields or ["tools"])[0], code="structured_output_unavailable") from None
    except FieldError as e:
        raise _bad(e.param or (fields or ["tools"])[0], e.reason) from None


def parse_chat(body: Mapping, llm) -> Job:
    """A /v1/chat/completions body as a Job (tokenizes: call it off the event loop)."""
    _check_fields(body, CHAT_FIELDS)
    n, stream, include_usage = _common(body, True)
    want_lp = _bool(body, "logprobs")
    top = _num(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, 0, integer=True)
    if top and not want_lp:
        raise _bad("top_logprobs", "needs 'logprobs': true")
    if body.get("n_probs") is not None:
        raise _bad("n_probs", "on chat, use 'logprobs' and 'top_logprobs'")
    if body.get("modalities") is not None and body["modalities"] != ["text"]:
        raise _bad("modalities", "this model writes text only: [\"text\"]")
    if body.get("service_tier") not in (None, "auto", "default"):
        raise _bad("service_tier", "only 'auto' or 'default'")
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise _bad("metadata", "must be an object")
    msgs = messages(body)
    try:
        tokens, tools = llm.chat_prompt(msgs, tools=body.get("tools"), tool_choice=body.get("tool_choice"),
                                        parallel_tool_calls=body.get("parallel_tool_calls"))
    except FieldError as e:
        raise _bad(e.param or "messages", e.reason) from None
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    params = sampling(body, llm, None, True)
    job = Job(True, [tokens], params, n, stream, include_usage, top if want_lp else None,
              _grammar(body, llm, tools), tools)
    if tools is not None and tools.tools:
        job.headers["X-Stowlm-Tool-Format"] = tools.format
    return job


def parse_completion(body: Mapping, llm) -> Job:
    """A /v1/completions body as a Job (tokenizes: call it off the event loop)."""
    _check_fields(body, COMPLETION_FIELDS)
    n, stream, include_usage = _common(body, False)
    logprobs = _num(body, "logprobs", 0, MAX_TOP_LOGPROBS, None, integer=True)
    n_probs = _num(body, "n_probs", 0, MAX_TOP_LOGPROBS, None, integer=True)
    if logprobs is None and n_probs:
        logprobs = n_probs
    best_of = _num(body, "best_of", 1, MAX_N, None, integer=True)
    if best_of is not None and best_of != n:
        raise _bad("best_of", "is supported only equal to n (every candidate is returned)", "unsupported_parameter")
    toks = prompts(body, llm)
    suffix = body.get("suffix")
    if suffix not in (None, ""):  # fill in the middle: the prompt before the cursor, the suffix after it
        if not isinstance(suffix, str):
            raise _bad("suffix", "must be a string")
        p = body.get("prompt")
        if not isinstance(p, str) and not (isinstance(p, list) and all(isinstance(x, str) for x in p)):
            raise _bad("suffix", "needs the prompt as text (the text before the cursor)")
        if _bool(body, "echo"):
            raise _bad("echo", "cannot be combined with suffix", "unsupported_parameter")
        try:
            toks = [fim_prompt(llm.tokenizer, x, suffix) for x in ([p] if isinstance(p, str) else p)]
        except ValueError as e:
            raise _bad("suffix", str(e), "unsupported_parameter") from None
    echo = None
    if _bool(body, "echo"):
        if logprobs is not None:
            raise _bad("echo", "with logprobs is not supported (it would need the prompt's own log-probabilities)",
                       "unsupported_parameter")
        p = body["prompt"]
        texts = [p] if isinstance(p, str) or (p and not isinstance(p[0], (str, list))) else p
        echo = [t if isinstance(t, str) else llm.tokenizer.decode(t) for t in texts]
    params = sampling(body, llm, 16, False)
    return Job(False, toks, params, n, stream, include_usage, logprobs, _grammar(body, llm, None), echo=echo)
