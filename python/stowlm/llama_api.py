"""llama-cpp-python's ``Llama`` over an LLM, so a script written for ``llama_cpp`` runs with
``from stowlm import Llama``: the same constructor (``model_path``, ``n_ctx=512``,
``n_gpu_layers``, ``seed``, ``embedding``, ...) and the methods such scripts call. A constructor
argument that would change results in a way stowlm does not compute is refused unless it has
llama-cpp-python's default; those that only tune llama.cpp's speed or memory residency are taken
and have no effect (stowlm maps the file, always runs flash attention, batches by n_ubatch)."""
from __future__ import annotations

import os
from typing import List, Optional, Sequence, Union

import numpy as np

from . import _core
from .devices import gpu_layers
from .embedding import GGUF_POOLING, openai_list
from .llm import LLM
from .pull import pull

__all__ = ["Llama", "LLAMA_DEFAULT_SEED"]

LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # llama.cpp's "a random seed"
_POOLING = {-1: None, **GGUF_POOLING}  # llama_pooling_type; -1: unspecified
_KV_TYPES = {1: "f16", 8: "q8_0"}  # ggml_type ids of the KV caches stowlm keeps
_CHAT_FORMATS = {"chatml": "chatml", "qwen": "chatml", "gemma": "gemma"}
_SPEED_ONLY = {"use_mmap", "use_mlock", "numa", "n_batch", "n_threads_batch", "flash_attn", "offload_kqv",
               "op_offload", "swa_full", "no_perf", "last_n_tokens_size", "logits_all"}
# their defaults in llama-cpp-python: any other value changes what the model computes
_AT_DEFAULT = {"split_mode": 1, "main_gpu": 0, "tensor_split": None, "vocab_only": False, "kv_overrides": None,
               "rope_scaling_type": -1, "rope_freq_base": 0.0, "rope_freq_scale": 0.0, "yarn_ext_factor": -1.0,
               "yarn_attn_factor": 1.0, "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "yarn_orig_ctx": 0,
               "lora_base": None, "lora_path": None, "lora_scale": 1.0, "chat_handler": None, "tokenizer": None,
               "spm_infill": False}


class Llama:
    """llama-cpp-python's Llama (``llm.llm`` is the stowlm.LLM underneath). Differences: a model
    without a pooling_type pools embeddings by their mean (llama.cpp: per-token vectors), and the
    low-level token loop (eval, sample, generate of token ids) is stowlm's Context instead."""

    def __init__(self, model_path: str, *, n_gpu_layers: int = 0, seed: int = LLAMA_DEFAULT_SEED, n_ctx: int = 512,
                 n_ubatch: int = 512, n_threads: Optional[int] = None, embedding: bool = False,
                 pooling_type: int = -1, type_k: Optional[int] = None, type_v: Optional[int] = None,
                 chat_format: Optional[str] = None, draft_model=None, verbose: bool = True, **kwargs):
        for k, v in kwargs.items():
            if k in _AT_DEFAULT:
                if v != _AT_DEFAULT[k]:
                    raise ValueError(f"Llama: {k}={v!r} is not supported by stowlm (only {_AT_DEFAULT[k]!r})")
            elif k not in _SPEED_ONLY:
                raise TypeError(f"Llama: unexpected argument {k!r}")
        if pooling_type not in _POOLING:
            raise ValueError(f"Llama: pooling_type must be one of {sorted(_POOLING)}, got {pooling_type!r}")
        if type_k is not None and type_k not in _KV_TYPES or type_v not in (None, type_k):
            raise ValueError(f"Llama: type_k/type_v must be one of {_KV_TYPES} (the same for both), got "
                             f"{type_k!r}/{type_v!r}")
        if chat_format is not None and chat_format not in _CHAT_FORMATS:
            raise ValueError(f"Llama: chat_format {chat_format!r} is not one stowlm has ({', '.join(_CHAT_FORMATS)}); "
                             "leave it None for the model's own template")
        spec, draft_max = None, None
        if draft_model is not None:  # llama-cpp-python's LlamaPromptLookupDecoding(num_pred_tokens=N)
            if not hasattr(draft_model, "num_pred_tokens"):
                raise ValueError("Llama: draft_model must be a LlamaPromptLookupDecoding (prompt lookup); for a draft "
                                 "model use stowlm.LLM(..., speculative='draft.gguf')")
            spec, draft_max = "ngram", int(draft_model.num_pred_tokens)
        self.model_path = os.fspath(pull(model_path, progress=verbose))  # a path, or a name stowlm pulls
        shape = _core.engine.Projector(self.model_path) if n_gpu_layers or not n_ctx else None
        devices, split = gpu_layers(n_gpu_layers, shape.n_layer if n_gpu_layers else 0, threads=n_threads)
        if devices is None and n_threads is not None:
            devices = [f"cpu:0[threads={n_threads}]"]
        n_ctx = n_ctx or shape.n_ctx_train  # 0: the trained context
        self.llm = LLM(self.model_path, n_ctx=n_ctx, devices=devices, layer_split=split, n_ubatch=n_ubatch,
                       kv_type=_KV_TYPES.get(type_k), chat_template=_CHAT_FORMATS.get(chat_format), progress=verbose,
                       embedding=embedding, pooling=_POOLING[pooling_type] if embedding else None,
                       speculative=spec, draft_max=draft_max)
        self.verbose = verbose
        self.set_seed(seed)
        self.metadata = {k: str(v) for k, v in self.llm.metadata.items()}

    # -- generation -------------------------------------------------------------------------
    def create_completion(self, prompt: Union[str, List[int]], **kwargs):
        return self.llm.create_completion(prompt, **self._seeded(kwargs))

    __call__ = create_completion

    def create_chat_completion(self, messages, **kwargs):
        return self.llm.create_chat_completion(messages, **self._seeded(kwargs))

    def set_seed(self, seed: int) -> None:
        """Seeds the calls that give none: a fixed seed makes a run's calls repeat from run to run
        (each call its own draw), LLAMA_DEFAULT_SEED leaves them random."""
        self._rng = None if seed in (LLAMA_DEFAULT_SEED, -1) else np.random.default_rng(seed)

    def _seeded(self, kwargs: dict) -> dict:
        if kwargs.get("seed") is None and self._rng is not None:
            kwargs = dict(kwargs, seed=int(self._rng.integers(0, 1 << 31)))
        return kwargs

    # -- embeddings -------------------------------------------------------------------------
    def embed(self, input, normalize: bool = False, truncate: bool = True, return_count: bool = False):
        """llama-cpp-python's defaults: the raw pooled vectors, a too-long input cut to the context."""
        return self.llm.embed(input, normalize=normalize, truncate=truncate, return_count=return_count)

    def create_embedding(self, input, model: Optional[str] = None) -> dict:
        """As llama-cpp-python's: embed(input) (not normalized) in OpenAI's shape."""
        vecs, _, n = self.llm.embed_arrays(input, normalize=False, truncate=True)
        return openai_list(vecs, model or self.model_path, n)

    # -- tokens -----------------------------------------------------------------------------
    def tokenize(self, text: Union[bytes, str], add_bos: bool = True, special: bool = False) -> List[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        return self.llm.tokenizer.encode(text, add_special=add_bos, parse_special=special)

    def detokenize(self, tokens: Sequence[int], prev_tokens: Optional[Sequence[int]] = None,
                   special: bool = False) -> bytes:
        """The bytes of `tokens`; after prev_tokens (the text so far) a leading space stays."""
        tok = self.llm.tokenizer
        if prev_tokens:
            return tok.decode_bytes(list(prev_tokens) + list(tokens), not special)[
                len(tok.decode_bytes(prev_tokens, not special)):]
        return tok.decode_bytes(tokens, not special)

    def token_bos(self) -> int:
        return -1 if self.llm.tokenizer.bos_id is None else self.llm.tokenizer.bos_id

    def token_eos(self) -> int:
        return -1 if self.llm.tokenizer.eos_id is None else self.llm.tokenizer.eos_id

    def n_ctx(self) -> int:
        return self.llm.n_ctx

    def n_vocab(self) -> int:
        return self.llm.model.n_vocab

    def n_embd(self) -> int:
        return self.llm.model.n_embd

    # -- lifetime ---------------------------------------------------------------------------
    def reset(self) -> None:
        """Nothing to forget: a prompt that reuses the cache gets the bits a fresh evaluation would
        (stowlm.prefix), so results never depend on what was cached."""

    def close(self) -> None:
        self.llm.close()

    def __enter__(self) -> "Llama":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
