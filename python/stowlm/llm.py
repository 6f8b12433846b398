"""The user-facing model object: load by name or path, generate, chat, stream.

    llm = stowlm.LLM("smollm2-135m")                # pulled into the cache on first use
    print(llm.generate("Once upon a time", max_tokens=32).text)
    for piece in llm.generate("Hi", stream=True): print(piece, end="")

The KV cache is kept between calls: a prompt that starts with the tokens already evaluated
re-uses them and only evaluates the rest."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Iterator, List, Mapping, Optional, Sequence, Union

import numpy as np

from . import _core
from . import fit as fitting
from .chat import ChatTemplate
from .devices import parse_devices
from .engine import Context, Model
from .gguffile import GGUFFile
from .placement import slot_context
from .pull import pull
from .sampling import Sampler, SamplingParams, StopChecker
from .tokenizer import Tokenizer

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
        n_ctx defaults to n_seq x min(4096, trained)).
    """

    def __init__(self, model: Union[str, os.PathLike] = "smollm2-135m", n_ctx: Optional[int] = None,
                 n_threads: Optional[int] = None, devices=None, n_ubatch: Optional[int] = None,
                 kv_type: Optional[str] = None, layer_split: Optional[Sequence[int]] = None,
                 chat_template: Optional[str] = None, progress: bool = True,
                 tensor_overrides: Optional[Sequence[str]] = None, fit: Optional[bool] = None, placement=None,
                 fit_margin=None, cpu_moe: bool = False, n_cpu_moe: Optional[int] = None,
                 n_copies: Optional[int] = None, fit_ctx: Optional[int] = None, n_seq: int = 1,
                 split_mode: Optional[str] = None, tensor_split: Optional[Sequence[float]] = None,
                 interleave: Optional[int] = None):
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
                 add_special: bool = True):
        """Continue ``prompt`` (text, or token ids). Returns a Completion, or with stream=True
        an iterator of text pieces whose ``completion`` attribute holds the Completion at the end."""
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
        it = _Generation(self, tokens, params) if self._engine is None else _Served(self._engine, tokens, params)
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

    def chat(self, messages: Sequence[Mapping[str, str]], stream: bool = False, **kwargs):
        """Answer a conversation rendered with the model's chat template (GGUF
        ``tokenizer.chat_template``). Same sampling options as generate()."""
        return self.generate(self.chat_tokens(messages), stream=stream, **kwargs)

    def chat_tokens(self, messages: Sequence[Mapping[str, str]]) -> List[int]:
        """The prompt tokens of a conversation, rendered with the chat template."""
        if self._template is None:
            raise ValueError(self._template_error)
        return self._template.encode(self.tokenizer, messages, add_generation_prompt=True)

    # -- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None
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


class _Generation:
    """Iterator of text pieces for one generate() call."""

    def __init__(self, llm: LLM, prompt: List[int], params: SamplingParams):
        self.llm = llm
        self.prompt = prompt
        self.params = params
        self.completion: Optional[Completion] = None
        self._gen = self._run()

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        return next(self._gen)

    def _run(self) -> Iterator[str]:
        llm, p = self.llm, self.params
        sampler = Sampler(p, vocab_size=llm.model.n_vocab)
        detok = llm.tokenizer.detokenizer(skip_special=True)
        stops = StopChecker(p.stop)
        logits = llm._prefill(self.prompt)
        history = list(self.prompt)
        out_tokens: List[int] = []
        text: List[str] = []
        finish = "length"
        limit = p.max_tokens if p.max_tokens is not None else llm.n_ctx
        while len(out_tokens) < limit:
            tok = sampler.sample(logits, history)
            if llm.tokenizer.is_eog(tok):
                finish = "stop"
                break
            out_tokens.append(tok)
            history.append(tok)
            piece, stopped = stops.feed(detok.feed(tok))
            if piece:
                text.append(piece)
                yield piece
            if stopped:
                finish = "stop"
                break
            if len(history) >= llm.n_ctx:  # the context is full
                break
            if len(out_tokens) < limit:
                logits = llm._step(tok)
        if finish != "stop":
            tail, _ = stops.feed(detok.flush())
            tail += stops.flush()
            if tail:
                text.append(tail)
                yield tail
        self.completion = Completion("".join(text), finish, len(self.prompt), len(out_tokens), out_tokens)


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

    def __init__(self, engine, prompt: List[int], params: SamplingParams):
        import queue

        self.completion: Optional[Completion] = None
        self._events: "queue.Queue" = queue.Queue()
        self._tokens: List[int] = []
        self._text: List[str] = []
        self._engine = engine
        self._req = engine.submit(prompt, params, self._events.put)

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        while self.completion is None:
            ev = self._events.get()
            if ev.kind == "done":
                if ev.finish_reason == "error":
                    raise RuntimeError(f"generation failed: {ev.error}")
                self.completion = Completion("".join(self._text), ev.finish_reason, ev.prompt_tokens,
                                             ev.completion_tokens, self._tokens)
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


def _as_list(stop) -> List[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    return list(stop)
