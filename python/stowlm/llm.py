"""The user-facing model object: load by name or path, generate, chat, stream.

    llm = stowlm.LLM("smollm2-135m")                # pulled into the cache on first use
    print(llm.generate("Once upon a time", max_tokens=32).text)
    for piece in llm.generate("Hi", stream=True): print(piece, end="")

The KV cache is kept between calls: a prompt that starts with the tokens already evaluated
re-uses them and only evaluates the rest."""
from __future__ import annotations

import os
import threading
from typing import Dict, List, Mapping, Optional, Sequence, Union

import numpy as np

from . import ops
from .conversation import Conversation
from .devices import parse_devices
from .embedding import Embeddings
from .generation import Completion, Generation, Served
from .loading import _default_ctx, load  # noqa: F401  (_default_ctx: stowlm.mpi sizes contexts as an LLM does)
from .placement.rules import DEFAULT_N_OUTPUTS
from .prefix import PrefixReuse
from .speculative import PassCosts, Speculator, drafter_for
from .text.sampling import SamplingParams

__all__ = ["LLM", "Completion"]


def _names_a_model(spec) -> bool:
    """Whether `speculative` names a draft model's file (not "ngram", None or a loaded LLM)."""
    return isinstance(spec, (str, os.PathLike)) and os.fspath(spec) not in ("ngram", "none")


class LLM(Conversation, Embeddings):
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
    moe_offload_min: with experts in RAM and their layers on a GPU, micro-batches of at least this
        many tokens multiply the experts on the GPU, copying them in layer by layer (default 128;
        0: never; decoding leaves them to the CPU).
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
        draft tokens per step at most (default 7). A Completion's drafted/accepted count them. With
        a draft model, prompt lookup drafts too where it yields more (no draft steps, but the draft
        must read what it skipped before drafting again); draft_lookup=False: the model alone.
    embedding: compute embeddings, not logits (embed(), create_embedding(); no generating), pooled by
        ``pooling``: "mean", "last", "cls" or "none" (default: the file's pooling_type, else "mean");
        n_seq inputs a pass.
    """

    def __init__(self, model: Union[str, os.PathLike] = "smollm2-135m", n_ctx: Optional[int] = None,
                 n_threads: Optional[int] = None, devices=None, n_ubatch: Optional[int] = None,
                 kv_type: Optional[str] = None, layer_split: Optional[Sequence[int]] = None,
                 chat_template: Optional[str] = None, progress: bool = True,
                 tensor_overrides: Optional[Sequence[str]] = None, fit: Optional[bool] = None, placement=None,
                 fit_margin=None, cpu_moe: bool = False, n_cpu_moe: Optional[int] = None,
                 n_copies: Optional[int] = None, fit_ctx: Optional[int] = None, n_seq: int = 1,
                 split_mode: Optional[str] = None, tensor_split: Optional[Sequence[float]] = None,
                 interleave: Optional[int] = None, speculative=None, draft_max: Optional[int] = None,
                 moe_offload_min: Optional[int] = None, draft_lookup: bool = True, embedding: bool = False,
                 pooling: Optional[str] = None):
        if n_threads is not None and (not isinstance(n_threads, int) or n_threads < 1):
            raise ValueError(f"n_threads must be a positive integer, got {n_threads!r}")
        if devices is None and n_threads is not None:
            devices = [f"cpu:0[threads={n_threads}]"]
        if not draft_lookup and (speculative is None or speculative in ("ngram", "none")):
            raise ValueError("draft_lookup=False needs a draft model (speculative='draft.gguf'): it turns off the "
                             "prompt lookup beside one")
        self._check_embedding_args(embedding, pooling, speculative)
        # A draft model loads first, on the first device, so that fit counts what it holds there.
        draft = self._load_draft(speculative, devices, n_ctx, n_seq) if _names_a_model(speculative) else None
        reserved = None if draft is None else {d["device"]: d["total"] for d in draft.ctx.memory_report()}
        try:
            ld = load(model, n_ctx=n_ctx, devices=devices, n_ubatch=n_ubatch, kv_type=kv_type,
                      layer_split=layer_split, chat_template=chat_template, progress=progress,
                      tensor_overrides=tensor_overrides, fit=fit, placement=placement, fit_margin=fit_margin,
                      cpu_moe=cpu_moe, n_cpu_moe=n_cpu_moe, n_copies=n_copies, fit_ctx=fit_ctx, n_seq=n_seq,
                      split_mode=split_mode, tensor_split=tensor_split, interleave=interleave, reserved=reserved,
                      moe_offload_min=moe_offload_min, embedding=embedding)
        except BaseException:
            if draft is not None:
                draft.close()
            raise
        self.path, self.placement, self.model, self.metadata = ld.path, ld.placement, ld.model, ld.metadata
        self.tokenizer, self.ctx = ld.tokenizer, ld.ctx
        self._open_embedding(embedding, pooling, ld.metadata)
        self._template, self._template_error = ld.template, ld.template_error
        self._cached: List[int] = []  # tokens whose K/V are in the cache, in order
        self._kernels: List[int] = []  # the kernel class of each cached token's pass (-1: not reusable)
        # what of the cache a prompt keeps: a fresh prompt goes in passes of n_ubatch tokens
        self._reuse = PrefixReuse.of(self.ctx, self.model, self.ctx.n_ubatch)
        self._grammars: Dict[str, object] = {}  # compiled grammars of recent requests
        self._grammars_lock = threading.Lock()
        # what passes of several tokens cost here (cheaper with repacked weights, more so with
        # AVX-512's kernels), and their timings
        self._pass_costs = PassCosts.for_model(self.model, repacked=bool(getattr(self.model, "repacked", None)),
                                               isa=ops.cpu_info()["active"])
        self._owns_drafter = draft is not None  # a draft model this LLM loaded itself
        self._drafter, self.draft_max = drafter_for(self, speculative, draft, draft_max, draft_lookup)
        self._engine = None
        if self.ctx.n_seq > 1 and not self.embedding:
            self.engine()

    @staticmethod
    def _load_draft(spec, devices, n_ctx, n_seq) -> "LLM":
        """The draft model on the target's first device, with a context of one sequence's."""
        first = parse_devices(devices)[0]
        return LLM(spec, devices=[str(first)], n_ctx=None if n_ctx is None else max(1, n_ctx // n_seq),
                   progress=False, fit=False)

    def engine(self, max_queue: Optional[int] = None):
        """The continuous-batching engine serving this LLM's context (made on first use; from then
        on generate() and chat() go through it too)."""
        self._for_generation()
        if self._engine is None:
            from .batching import BatchEngine

            self._cached, self._kernels = [], []
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
        self._for_generation()
        tokens = self._check_tokens(tokens)
        self._rewind(0)
        out = self.ctx.eval(tokens, logits="all")
        self._cached, self._kernels = list(tokens), [-1] * len(tokens)  # passes cut by n_outputs too
        return out

    # -- generation -------------------------------------------------------------------------
    def generate(self, prompt: Union[str, Sequence[int]], max_tokens: Optional[int] = 256,
                 temperature: float = 0.8, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
                 repeat_penalty: float = 1.0, repeat_last_n: int = 64, frequency_penalty: float = 0.0,
                 presence_penalty: float = 0.0, seed: Optional[int] = None, stop=None,
                 logit_bias: Optional[Mapping[int, float]] = None, typical_p: float = 1.0, mirostat: int = 0,
                 mirostat_tau: float = 5.0, mirostat_eta: float = 0.1, stream: bool = False,
                 add_special: bool = True, response_format=None, grammar=None, json_schema=None,
                 speculative: Optional[bool] = None, _special: bool = False):
        """Continue ``prompt`` (text, or token ids). Returns a Completion, or with stream=True
        an iterator of text pieces whose ``completion`` attribute holds the Completion at the end.
        Sampling options: stowlm.text.sampling.SamplingParams (llama.cpp's, Mirostat included).

        Structured output (needs ``pip install "stowlm[structured]"``): ``response_format`` as
        OpenAI's ({"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema":
        ...}}), ``json_schema`` (a schema dict), or ``grammar`` (llama.cpp's GBNF text, or a
        stowlm.text.grammar.Grammar): only text they allow is generated. speculative=False turns the
        LLM's drafting off for this call (it is also off where a grammar constrains the text)."""
        self._for_generation()
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n,
                                frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                                seed=seed, max_tokens=max_tokens, stop=list(_as_list(stop)),
                                logit_bias=dict(logit_bias or {}), typical_p=typical_p, mirostat=mirostat,
                                mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta)
        if isinstance(prompt, str):
            tokens = self.tokenizer.encode(prompt, add_special=add_special, parse_special=False)
        else:
            tokens = list(prompt)
        tokens = self._check_tokens(tokens)
        g = self.grammar(response_format=response_format, grammar=grammar, json_schema=json_schema)
        spec = None
        if self._drafter is not None and speculative is not False and g is None:
            spec = Speculator(self._drafter, self.draft_max, self._pass_costs)
        it = Generation(self, tokens, params, g, _special, spec) if self._engine is None else \
            Served(self._engine, tokens, params, g, _special, speculative is not False)
        if stream:
            return it
        _drain(it)
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
                _drain(runs[done])
                done += 1
            runs.append(self.generate(p, stream=True, **kwargs))
        for r in runs[done:]:
            _drain(r)
        return [r.completion for r in runs]

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
        self._cached, self._kernels = [], []

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

    def _rewind(self, n: int) -> None:
        if n < len(self._cached) or self.ctx.n_past != n:
            self.ctx.kv_truncate(n)
        del self._cached[n:], self._kernels[n:]

    def _prefill(self, tokens: List[int]) -> np.ndarray:
        """Brings the cache to exactly ``tokens`` and returns the last position's logits: the
        bits a fresh evaluation of ``tokens`` would give (stowlm.prefix)."""
        reuse, n_tok = self._reuse, len(tokens)
        k = reuse.reusable(self._cached, self._kernels, tokens)
        self._rewind(k)
        try:
            if k % reuse.chunk:  # the rest of k's chunk, in one pass taking that chunk's kernels
                n, cls, forced = reuse.next_pass(k, n_tok)
                rows = [n - 1] if k + n == n_tok else []
                out = self.ctx.eval_batch(tokens[k:k + n], [0] * n, rows=rows, batched=forced)
                self._cached += tokens[k:k + n]
                self._kernels += [cls] * n
                out, k = (out[0] if rows else None), k + n
            if k < n_tok:  # whole chunks from a chunk boundary, as a fresh evaluation goes
                out = self.ctx.eval(tokens[k:], logits="last")
                self._cached += tokens[k:]
                self._kernels += reuse.classes(k, n_tok)
        except BaseException:
            self._cached, self._kernels = [], []
            self.ctx.clear()
            raise
        return out

    def _step(self, token: int) -> np.ndarray:
        out = self.ctx.eval([token], logits="last")
        self._cached.append(token)
        self._kernels.append(self._reuse.kernels(1))
        return out

    def _step_many(self, tokens: List[int]) -> np.ndarray:
        """One pass over several tokens (a pending token and its drafts): every row of logits."""
        out = self.ctx.eval(tokens, logits="all")
        self._cached += tokens
        self._kernels += [self._reuse.kernels(len(tokens))] * len(tokens)
        return out

    def _max_draft(self) -> int:
        """Draft tokens one pass may check: with the pending token, below the first batch bound,
        where every token gets the row kernels a one-token step takes."""
        bounds = list(self.model.batch_bounds)
        return max(1, min(bounds[0] - 2 if bounds else 30, DEFAULT_N_OUTPUTS - 1))


def _as_list(stop) -> List[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    return list(stop)


def _drain(run) -> None:
    for _ in run:
        pass
