"""The user-facing model object: load by name or path, generate, chat, stream.

    llm = stowlm.LLM("smollm2-135m")                # pulled into the cache on first use
    print(llm.generate("Once upon a time", max_tokens=32).text)
    for piece in llm.generate("Hi", stream=True): print(piece, end="")

The KV cache is kept between calls: a prompt that starts with the tokens already evaluated
re-uses them and only evaluates the rest."""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Union

import numpy as np

from . import _core
from . import fit as fitting
from .chat import ChatTemplate, check_messages
from .devices import parse_devices
from .engine import Context, Model
from .gguffile import GGUFFile
from .placement import slot_context
from .pull import pull
from .sampling import Sampler, SamplingParams, TextStream
from .speculative import DRAFT_MAX, Speculator, parse_spec, verify
from .tokenizer import Tokenizer
from .toolcalls import gather

LOGIT_ROWS = fitting.DEFAULT_N_OUTPUTS  # rows of logits a micro-batch returns: one to generate, a few for logits()

__all__ = ["LLM", "Completion"]


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


class LLM:
    """A model, its tokenizer and one context, ready to generate.

    model: a name from ``stowlm.pull.list_models()`` (downloaded on first use) or a .gguf path.
    devices: device specs as ``stowlm.Model`` takes them (default: the CPU, all cores).
    n_threads: threads of the default CPU device (ignored when ``devices`` is given).
    chat_template: Jinja source or a built-in name ("chatml", "gemma") replacing the model's own.
    tensor_overrides: ["REGEX=DEVICE", ...] weights to place on another device (see ``stowlm.Model``).
    fit: decide the placement with ``stowlm.fit.fit`` (every value given here is kept; FitError, a
        MemoryError, when they cannot fit). None (default): fit when several devices are given, when
        cpu_moe / n_cpu_moe is asked for, or when the model does not fit the one device with the
        default context; False: load as given. fit_margin, fit_ctx, cpu_moe, n_cpu_moe: as fit takes them
        (margin, fit_ctx, ...).
    placement: a Placement (or its JSON file) from fit, loaded exactly as it says.
    n_copies: with the layers on several devices, copies of the tensors that cross devices, one per
        micro-batch in flight (pipeline parallelism; default 4 when they fit, 1 turns it off).
    interleave: each device's layers in that many ranges taking turns with the other devices'
        (shorter pipeline stages; default 2 where only CPU devices hold layers, 1: one range each).
    split_mode="tensor" (tensor_split: shares per device): every layer cut over the devices, which
        all work on every token (tensor parallelism; fit picks the shares from free memory; the
        logits are one device's bit for bit). "tensor-sum": the devices' partial products summed
        instead (half the meetings, fewer bytes between devices; results within float rounding).
    n_seq: requests served at once (continuous batching, stowlm.batching): generate() and chat()
        may then be called from several threads, and generate_batch() runs many prompts together;
        each request gets n_ctx / n_seq of the context (rounded down to a multiple of 256 cells;
        n_ctx defaults to n_seq x min(4096, trained)), a longer one the cells of idle slots too.
    speculative: draft tokens and check them in one pass (stowlm.speculative): "ngram" (from the
        prompt and the text so far), a draft model's .gguf path or name (same vocabulary), or None.
        Greedy text is the same as without; sampled text has the same distribution. draft_max:
        draft tokens per step at most (default 7). A Completion's drafted/accepted count them.
    """

    def __init__(self, model: Union[str, os.PathLike] = "smollm2-135m", n_ctx: Optional[int] = None,
                 n_threads: Optional[int] = None, devices=None, n_ubatch: Optional[int] = None,
                 kv_type: Optional[str] = None, layer_split: Optional[Sequence[int]] = None,
                 chat_template: Optional[str] = None, progress: bool = True,
                 tensor_overrides: Optional[Sequence[str]] = None, fit: Optional[bool] = None, placement=None,
                 fit_margin=None, cpu_moe: bool = False, n_cpu_moe: Optional[int] = None,
                 n_copies: Optional[int] = None, fit_ctx: Optional[int] = None, n_seq: int = 1,
                 split_mode: Optional[str] = None, tensor_split: Optional[Sequence[float]] = None,
                 interleave: Optional[int] = None, speculative=None, draft_max: Optional[int] = None):
        if n_threads is not None and (not isinstance(n_threads, int) or n_threads < 1):
            raise ValueError(f"n_threads must be a positive integer, got {n_threads!r}")
        self.path = pull(model, progress=progress)
        if devices is None and n_threads is not None:
            devices = [f"cpu:0[threads={n_threads}]"]
        self.placement = None
        if placement is not None:
            given = [k for k, v in (("devices", devices), ("n_ctx", n_ctx), ("n_ubatch", n_ubatch), ("kv_type", kv_type),
                                    ("layer_split", layer_split), ("tensor_overrides", tensor_overrides),
                                    ("n_cpu_moe", n_cpu_moe), ("n_copies", n_copies), ("split_mode", split_mode),
                                    ("tensor_split", tensor_split), ("interleave", interleave)) if v is not None] + \
                (["cpu_moe"] if cpu_moe else [])
            if given:
                raise ValueError(f"LLM: a placement fixes {', '.join(given)}; give either the placement or these")
            self.placement = placement
        elif fit or (fit is None and _wants_fit(self.path, devices, n_ctx, n_ubatch, kv_type, cpu_moe, n_cpu_moe, n_seq,
                                                fit_margin)):
            self.placement = fitting.fit(self.path, devices, n_ctx=n_ctx, n_ubatch=n_ubatch, kv_type=kv_type,
                                         layer_split=layer_split, tensor_overrides=tensor_overrides,
                                         cpu_moe=cpu_moe, n_cpu_moe=n_cpu_moe, margin=fit_margin, n_copies=n_copies,
                                         n_seq=n_seq, split_mode=split_mode, tensor_split=tensor_split,
                                         interleave=interleave, **({} if fit_ctx is None else {"fit_ctx": fit_ctx}))
            if progress:
                print(f"[{self.placement.summary()}]", file=sys.stderr)
        if self.placement is not None:
            self.model = Model(self.path, placement=self.placement)
            self.placement = self.model.placement
        else:
            self.model = Model(self.path, devices=devices, layer_split=layer_split, tensor_overrides=tensor_overrides,
                               n_copies=n_copies, split_mode=split_mode or "layer", tensor_split=tensor_split,
                               interleave=interleave)
        with GGUFFile(self.path) as f:
            meta = f.metadata
            self.metadata = {k: v for k, v in meta.items() if not k.startswith("tokenizer.ggml.")}
            self.tokenizer = Tokenizer.from_metadata(meta, name=os.path.basename(self.path))
            if chat_template is None and not meta.get("tokenizer.chat_template") \
                    and str(meta.get("general.architecture", "")).startswith("gemma"):
                chat_template = "gemma"  # gemma GGUFs often ship without one; the family's format is fixed
            try:
                self._template: Optional[ChatTemplate] = ChatTemplate.from_metadata(
                    meta, self.tokenizer, name=os.path.basename(self.path), template=chat_template)
            except ValueError as e:
                self._template, self._template_error = None, str(e)
        if self.placement is not None:
            self.ctx = Context(self.model)
        else:
            n_ubatch = n_ubatch or 512
            # Generation needs one row of logits; a few rows keep logits() reasonably batched while
            # the logits buffer (n_vocab floats per row) stays small for 150k-260k vocabularies.
            self.ctx = Context(self.model, n_ctx=slot_context(_default_ctx(self.model.n_ctx_train, n_ctx, n_seq), n_seq),
                               n_ubatch=n_ubatch, n_seq=n_seq,
                               kv_type=kv_type, n_outputs=min(n_ubatch, LOGIT_ROWS))
        self._cached: List[int] = []  # tokens whose K/V are in the cache, in order
        self._grammars: Dict[str, object] = {}  # compiled grammars of recent requests
        self._grammars_lock = threading.Lock()
        self._drafter, self.draft_max = None, DRAFT_MAX if draft_max is None else draft_max
        self._owns_drafter = isinstance(speculative, (str, os.PathLike)) and speculative != "ngram"
        if speculative is not None:
            self._drafter = parse_spec(speculative)
            if not isinstance(self.draft_max, int) or not 1 <= self.draft_max <= self._max_draft():
                raise ValueError(f"draft_max must be an integer in [1, {self._max_draft()}] (a draft and its "
                                 f"token stay below the batch bound), got {draft_max!r}")
            other = getattr(self._drafter, "llm", None)
            if other is not None and (other.model.n_vocab != self.model.n_vocab or
                                      other.tokenizer._tokens != self.tokenizer._tokens):
                raise ValueError(f"the draft model {os.path.basename(os.fspath(other.path))} has another vocabulary "
                                 f"({other.model.n_vocab} tokens) than {os.path.basename(os.fspath(self.path))} "
                                 f"({self.model.n_vocab}): its token ids would mean other text")
        self._engine = None
        if self.ctx.n_seq > 1:
            self.engine()

    def engine(self, max_queue: Optional[int] = None):
        """The continuous-batching engine serving this LLM's context (made on first use; from then
        on generate() and chat() go through it too)."""
        if self._engine is None:
            from .batching import BatchEngine

            self._cached = []
            self._engine = BatchEngine(self, **({} if max_queue is None else {"max_queue": max_queue}))
        elif max_queue is not None:
            self._engine.max_queue = max_queue
        return self._engine

    # -- tokens -----------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> List[int]:
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens: Sequence[int], skip_special: bool = False) -> str:
        return self.tokenizer.decode(tokens, skip_special=skip_special)

    @property
    def n_ctx(self) -> int:
        return self.ctx.n_ctx

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Logits [len(tokens), n_vocab] for every position of ``tokens``, as a fresh sequence."""
        tokens = self._check_tokens(tokens)
        self._rewind(0)
        out = self.ctx.eval(tokens, logits="all")
        self._cached = list(tokens)
        return out

    # -- generation -------------------------------------------------------------------------
    def generate(self, prompt: Union[str, Sequence[int]], max_tokens: Optional[int] = 256,
                 temperature: float = 0.8, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
                 repeat_penalty: float = 1.0, repeat_last_n: int = 64, frequency_penalty: float = 0.0,
                 presence_penalty: float = 0.0, seed: Optional[int] = None, stop=None,
                 logit_bias: Optional[Mapping[int, float]] = None, stream: bool = False,
                 add_special: bool = True, response_format=None, grammar=None, json_schema=None,
                 speculative: Optional[bool] = None, _special: bool = False):
        """Continue ``prompt`` (text, or token ids). Returns a Completion, or with stream=True
        an iterator of text pieces whose ``completion`` attribute holds the Completion at the end.

        Structured output (needs ``pip install "stowlm[structured]"``): ``response_format`` as
        OpenAI's ({"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema":
        ...}}), ``json_schema`` (a schema dict), or ``grammar`` (llama.cpp's GBNF text, or a
        stowlm.grammar.Grammar): only text they allow is generated. speculative=False turns the
        LLM's drafting off for this call (it is also off where a grammar constrains the text)."""
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n,
                                frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                                seed=seed, max_tokens=max_tokens, stop=list(_as_list(stop)),
                                logit_bias=dict(logit_bias or {}))
        if isinstance(prompt, str):
            tokens = self.tokenizer.encode(prompt, add_special=add_special, parse_special=False)
        else:
            tokens = list(prompt)
        tokens = self._check_tokens(tokens)
        g = self.grammar(response_format=response_format, grammar=grammar, json_schema=json_schema)
        spec = None
        if self._drafter is not None and speculative is not False and g is None:
            spec = Speculator(self._drafter, self.draft_max)
        it = _Generation(self, tokens, params, g, _special, spec) if self._engine is None else \
            _Served(self._engine, tokens, params, g, _special, speculative is not False)
        if stream:
            return it
        for _ in it:
            pass
        return it.completion

    def generate_batch(self, prompts: Sequence[Union[str, Sequence[int]]], **kwargs) -> List[Completion]:
        """Completes every prompt, n_seq at a time in one batch (continuous batching); the same
        sampling options as generate() for all. Greedy text is the same as one at a time."""
        if self._engine is None:
            return [self.generate(p, **kwargs) for p in prompts]
        cap = self._engine.n_seq + self._engine.max_queue  # never more in flight than the queue takes
        runs, done = [], 0
        for p in prompts:
            if len(runs) - done >= cap:
                for _ in runs[done]:
                    pass
                done += 1
            runs.append(self.generate(p, stream=True, **kwargs))
        for r in runs[done:]:
            for _ in r:
                pass
        return [r.completion for r in runs]

    def chat(self, messages: Sequence[Mapping[str, str]], stream: bool = False, tools=None, tool_choice=None,
             parallel_tool_calls: Optional[bool] = None, **kwargs):
        """Answer a conversation rendered with the model's chat template (GGUF
        ``tokenizer.chat_template``). Same sampling and structured-output options as generate().

        tools (OpenAI's [{"type": "function", "function": {"name", "description", "parameters"}}])
        are rendered through the template; tool_choice "auto" (default), "none", "required" or
        {"type": "function", "function": {"name": ...}} (the last two forced by a grammar). The
        Completion's tool_calls then holds the calls the model made (OpenAI's shape, arguments
        as a JSON string) and its finish_reason is "tool_calls"; its text is the rest (gpt-oss's
        answer channel, its reasoning in the Completion's reasoning)."""
        tokens, req = self.chat_prompt(messages, tools, tool_choice, parallel_tool_calls)
        if req is None:
            return self.generate(tokens, stream=stream, **kwargs)
        if req.tools:
            given = [k for k in ("response_format", "grammar", "json_schema") if kwargs.get(k) is not None]
            if given:
                raise ValueError(f"{given[0]} cannot be combined with tools (give tool_choice='none', or no tools)")
            from .grammar import Grammar

            text = req.grammar(self.tokenizer)
            kwargs["grammar"] = None if text is None else Grammar(self.tokenizer, text, self.model.n_vocab, "tools")
        it = _ToolCalls(self.generate(tokens, stream=True, _special=req.needs_special, **kwargs), req)
        if stream:
            return it
        for _ in it:
            pass
        return it.completion

    def chat_prompt(self, messages: Sequence[Mapping], tools=None, tool_choice=None,
                    parallel_tool_calls: Optional[bool] = None):
        """(prompt tokens, stowlm.toolcalls.ToolRequest or None): the conversation rendered with the
        template, the tools in the template's format (FieldError, a ValueError, names a bad one)."""
        from . import toolcalls

        if self._template is None:
            raise ValueError(self._template_error)
        messages = check_messages(messages)
        req = toolcalls.parse_tool_request(tools, tool_choice, parallel_tool_calls, self._template.source)
        msgs = toolcalls.template_messages(messages, req.format if req else self.tool_format)
        if req is not None:
            msgs = req.prompt_messages(msgs)
        tokens = self._template.encode(self.tokenizer, msgs, add_generation_prompt=True,
                                       tools=req.template_tools() if req else None)
        return tokens, req

    @property
    def tool_format(self) -> str:
        """How this model's chat template writes tool calls (stowlm.toolcalls.FORMATS)."""
        from .toolcalls import detect_format

        return detect_format(self._template.source if self._template else None)

    def create_completion(self, prompt, **kwargs):
        """llama-cpp-python's Llama.create_completion: an OpenAI text_completion dict (an iterator of
        chunk dicts with stream=True), checked and made as the server makes them."""
        from .compat import create

        return create(self, dict(kwargs, prompt=prompt), chat=False)

    __call__ = create_completion

    def create_chat_completion(self, messages, **kwargs):
        """llama-cpp-python's Llama.create_chat_completion: an OpenAI chat.completion dict (chunks
        with stream=True), with tools, tool_choice and response_format as the server takes them."""
        from .compat import create

        return create(self, dict(kwargs, messages=messages), chat=True)

    def grammar(self, response_format=None, grammar=None, json_schema=None):
        """The compiled Grammar (stowlm.grammar) of these request fields, None for free text;
        GrammarError (a ValueError) names the field that is wrong. Kept for the next request."""
        from . import grammar as gm

        if isinstance(grammar, gm.Grammar):
            if response_format is not None or json_schema is not None:
                raise gm.GrammarError("give one of response_format, grammar, json_schema, not several", "grammar")
            return grammar
        key = json.dumps([response_format, grammar, json_schema], sort_keys=True, default=str)
        with self._grammars_lock:  # the server asks from several threads
            hit = self._grammars.get(key)
        if hit is not None:
            return hit
        text = gm.from_request(response_format, grammar, json_schema)
        if text is None:
            return None
        g = gm.Grammar(self.tokenizer, text, self.model.n_vocab)
        with self._grammars_lock:
            if len(self._grammars) >= 32:
                self._grammars.pop(next(iter(self._grammars)))
            self._grammars[key] = g
        return g

    def chat_tokens(self, messages: Sequence[Mapping[str, str]]) -> List[int]:
        """The prompt tokens of a conversation, rendered with the chat template."""
        return self.chat_prompt(messages)[0]

    # -- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        if self._drafter is not None and self._owns_drafter:
            self._drafter.llm.close()  # a draft model this LLM loaded itself
        self._drafter = None
        self.ctx = None
        self.model = None
        self._cached = []

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LLM({os.fspath(self.path)!r}, n_ctx={self.n_ctx})"

    # -- internals -------------------------------------------------------------------------------
    def _check_tokens(self, tokens) -> List[int]:
        if self.ctx is None:
            raise ValueError("this LLM is closed")
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("the prompt is empty (no tokens)")
        n_vocab = self.model.n_vocab
        bad = [t for t in tokens if not 0 <= t < n_vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{n_vocab - 1})")
        if len(tokens) > self.n_ctx:
            raise ValueError(f"the prompt has {len(tokens)} tokens, more than the context n_ctx={self.n_ctx}")
        return tokens

    def _common_prefix(self, tokens: Sequence[int]) -> int:
        n = 0
        for a, b in zip(self._cached, tokens):
            if a != b:
                break
            n += 1
        return n

    def _rewind(self, n: int) -> None:
        if n < len(self._cached) or self.ctx.n_past != n:
            self.ctx.kv_truncate(n)
        del self._cached[n:]

    def _prefill(self, tokens: List[int]) -> np.ndarray:
        """Brings the cache to exactly ``tokens`` and returns the last position's logits."""
        n_keep = min(self._common_prefix(tokens), len(tokens) - 1)
        self._rewind(n_keep)
        try:
            out = self.ctx.eval(tokens[n_keep:], logits="last")
        except BaseException:
            self._cached = []
            self.ctx.clear()
            raise
        self._cached = list(tokens)
        return out

    def _step(self, token: int) -> np.ndarray:
        out = self.ctx.eval([token], logits="last")
        self._cached.append(token)
        return out

    def _step_many(self, tokens: List[int]) -> np.ndarray:
        """One pass over several tokens (a pending token and its drafts): every row of logits."""
        out = self.ctx.eval(tokens, logits="all")
        self._cached += tokens
        return out

    def _max_draft(self) -> int:
        """Draft tokens one pass may check: with the pending token, below the first batch bound,
        where every token gets the row kernels a one-token step takes."""
        bounds = list(self.model.batch_bounds)
        return max(1, min(bounds[0] - 2 if bounds else 30, LOGIT_ROWS - 1))


class _Generation:
    """Iterator of text pieces for one generate() call."""

    def __init__(self, llm: LLM, prompt: List[int], params: SamplingParams, grammar=None, special: bool = False,
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
        llm, p, spec = self.llm, self.params, self.spec
        sampler = Sampler(p, vocab_size=llm.model.n_vocab)
        stream = TextStream(llm.tokenizer, p, skip_special=not self.special)  # end, stop strings, max_tokens
        logits = llm._prefill(self.prompt)
        history = list(self.prompt)
        constraint = self.grammar.start() if self.grammar is not None else None
        finish = "length"

        def pick(logits) -> int:
            allowed = constraint.allowed() if constraint is not None and constraint.active else None
            return sampler.sample(logits, history, allowed)

        def feed(tok: int):
            """tok into the text: (its piece, whether the text ends here)."""
            nonlocal finish
            if constraint is not None and not llm.tokenizer.is_eog(tok):
                constraint.accept(tok)
            piece = stream.feed(tok)
            if stream.finished:
                return piece, True
            history.append(tok)
            if constraint is not None and constraint.done:  # the grammar is complete: only the end may follow
                finish = "stop"
                return piece, True
            return piece, len(history) >= llm.n_ctx  # the context is full

        tok = pick(logits)
        while True:
            piece, end = feed(tok)
            if piece:
                yield piece
            if end:
                break
            left = (p.max_tokens - stream.n_tokens) if p.max_tokens is not None else llm.n_ctx
            drafts = spec.draft(history, min(left - 1, llm.n_ctx - len(history))) if spec is not None else []
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
            kept, tok = verify(sampler, rows, drafts, history)
            spec.record(len(drafts), len(kept))
            for d in kept:
                piece, end = feed(d)
                if piece:
                    yield piece
                if end:
                    break
            llm._rewind(len(history))  # the cache keeps what the text kept
            if end:
                break
        tail = stream.close()
        if tail:
            yield tail
        self.completion = Completion(stream.text, stream.finish_reason or finish, len(self.prompt), stream.n_tokens,
                                     stream.ids, drafted=spec.drafted if spec else 0,
                                     accepted=spec.accepted if spec else 0)


def _default_ctx(n_ctx_train: int, n_ctx: Optional[int], n_seq: int = 1) -> int:
    """n_ctx, or min(4096, trained) for each of n_seq sequences."""
    return n_seq * min(4096, n_ctx_train) if n_ctx is None else n_ctx


def _wants_fit(path, devices, n_ctx, n_ubatch, kv_type, cpu_moe, n_cpu_moe, n_seq, margin) -> bool:
    """Several devices, an expert spill asked for, or a model that does not fit the one device."""
    specs = parse_devices(devices)
    if len(specs) > 1 or cpu_moe or n_cpu_moe is not None:
        return True
    n_ubatch = n_ubatch or 512
    projector = _core.engine.Projector(os.fspath(path))
    n_ctx = slot_context(_default_ctx(projector.n_ctx_train, n_ctx, n_seq), n_seq)
    return not fitting.fits_one_device(projector, specs[0], n_ctx, n_ubatch, kv_type or "f16", min(n_ubatch, LOGIT_ROWS),
                                       margin, n_seq)


class _Served:
    """Iterator of text pieces of one request served by the batch engine (LLM with n_seq > 1):
    submitted at once, so several of them run together."""

    def __init__(self, engine, prompt: List[int], params: SamplingParams, grammar=None, special: bool = False,
                 speculative: bool = True):
        import queue

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


class _ToolCalls:
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


def _as_list(stop) -> List[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    return list(stop)
