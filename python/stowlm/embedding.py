"""Embeddings: a model's final hidden states (after the output norm, what the head multiplies),
pooled over an input's tokens and L2-normalized, as llama.cpp's ``--embeddings`` and OpenAI's
/v1/embeddings give them. An LLM opened with ``embedding=True`` computes them (stowlm.llm)."""
from __future__ import annotations

import base64
import os
import threading
from typing import List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

__all__ = ["Embeddings", "POOLINGS", "GGUF_POOLING", "InputTooLong", "pooling_of", "pool", "l2_normalize", "token_lists",
           "embed_tokens", "openai_list"]

POOLINGS = ("mean", "last", "cls", "none")
# llama.cpp's llama_pooling_type, which GGUF's {arch}.pooling_type stores
GGUF_POOLING = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}


class InputTooLong(ValueError):
    """An input longer than a sequence's context (OpenAI's context_length_exceeded)."""

    def __init__(self, index: int, n_tokens: int, capacity: int, hint: str = ""):
        super().__init__(f"input[{index}] has {n_tokens} tokens, more than the {capacity} one input may have (a "
                         f"sequence's context){hint}")
        self.index, self.n_tokens, self.capacity = index, n_tokens, capacity


def pooling_of(metadata: Mapping, pooling: Optional[str] = None, source: str = "the model") -> str:
    """The pooling an LLM uses: the one asked for, else the file's {arch}.pooling_type, else mean
    (llama.cpp falls back to none, per-token vectors that /v1/embeddings then refuses). Raises
    ValueError for what this engine cannot compute: rank pooling (a reranker's classifier head)
    and bidirectional attention (its attention is causal)."""
    arch = metadata.get("general.architecture", "")
    if metadata.get(f"{arch}.attention.causal", True) is False:
        raise ValueError(f"{source}: {arch}.attention.causal is false (an encoder with bidirectional attention); "
                         "stowlm's attention is causal, so its embeddings would be wrong")
    what = "pooling"
    if pooling is None:
        raw = metadata.get(f"{arch}.pooling_type")
        if raw is None:
            return "mean"
        what, pooling = f"{source}'s {arch}.pooling_type", GGUF_POOLING.get(raw, raw)
    if pooling not in POOLINGS:
        raise ValueError(f"{what} must be one of {', '.join(POOLINGS)}, got {pooling!r}"
                         + (" (rank pooling scores query/document pairs with a classifier head stowlm does not run)"
                            if pooling == "rank" else ""))
    return pooling


def rows_for(n: int, pooling: str) -> List[int]:
    """The token indices whose hidden states a pooling reads."""
    return [0] if pooling == "cls" else [n - 1] if pooling == "last" else list(range(n))


def pool(rows: np.ndarray, pooling: str) -> np.ndarray:
    """rows: the hidden states of rows_for(n, pooling), in order. [n_embd] (none: [n, n_embd])."""
    if pooling == "mean":
        return rows.astype(np.float64).mean(axis=0).astype(np.float32)
    return rows if pooling == "none" else rows[0]


def l2_normalize(v: np.ndarray) -> np.ndarray:
    """L2-normalized along the last axis (a zero vector stays zero)."""
    n = np.linalg.norm(v.astype(np.float64), axis=-1, keepdims=True)
    return (v / np.where(n > 0, n, 1)).astype(np.float32)


def token_lists(inputs, tokenize) -> Tuple[List[List[int]], bool]:
    """OpenAI's input forms (a string, strings, token ids, lists of token ids) as token lists, and
    whether it was a single input."""
    def is_ids(x):
        return isinstance(x, (list, tuple)) and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool)
                                                    for t in x)
    if isinstance(inputs, str):
        return [tokenize(inputs)], True
    if is_ids(inputs) and len(inputs) > 0:
        return [[int(t) for t in inputs]], True
    if isinstance(inputs, (list, tuple)) and inputs:
        out = []
        for i, x in enumerate(inputs):
            if isinstance(x, str):
                out.append(tokenize(x))
            elif is_ids(x):
                out.append([int(t) for t in x])
            else:
                raise ValueError(f"input[{i}] must be a string or a list of token ids, got {type(x).__name__}")
        return out, False
    raise ValueError("input must be a non-empty string, list of strings, list of token ids or list of such lists")


def embed_tokens(ctx, lists: Sequence[Sequence[int]], pooling: str) -> List[np.ndarray]:
    """Each token list's pooled hidden states (not normalized), up to ctx.n_seq lists a pass, each
    its own sequence; the cache is left empty."""
    out: List[np.ndarray] = []
    for g in range(0, len(lists), ctx.n_seq):
        group = lists[g:g + ctx.n_seq]
        toks, seqs, rows, spans = [], [], [], []
        for s, t in enumerate(group):
            want = [len(toks) + r for r in rows_for(len(t), pooling)]
            spans.append((len(rows), len(rows) + len(want)))
            rows += want
            toks += list(t)
            seqs += [s] * len(t)
        ctx.clear()
        try:
            h = ctx.eval_batch(toks, seqs, rows=rows)
        finally:
            ctx.clear()
        out += [pool(h[a:b], pooling) for a, b in spans]
    return out


def encode_vector(v: np.ndarray, encoding_format: str) -> Union[list, str]:
    """OpenAI's float list, or base64 of its little-endian float32 bytes (what the openai client
    asks for by default)."""
    if encoding_format == "base64":
        return base64.b64encode(np.ascontiguousarray(v, dtype="<f4").tobytes()).decode("ascii")
    return v.astype(np.float64).tolist()


def openai_list(vectors: Sequence[np.ndarray], model: str, n_tokens: int, encoding_format: str = "float") -> dict:
    """/v1/embeddings' response body."""
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encode_vector(v, encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}


class Embeddings:
    """LLM's embed() and create_embedding(), and what embedding=True changes in an LLM; the LLM
    gives ctx, model, tokenizer and path."""

    @staticmethod
    def _check_embedding_args(embedding: bool, pooling: Optional[str], speculative) -> None:
        if embedding and speculative is not None:
            raise ValueError("speculative decoding needs a generating LLM; embedding=True computes embeddings only")
        if pooling is not None and not embedding:
            raise ValueError("pooling applies to embeddings: give embedding=True with it")
        if pooling is not None and pooling not in POOLINGS:  # before the load; the file's own after it
            pooling_of({}, pooling)

    def _open_embedding(self, embedding: bool, pooling: Optional[str], metadata: Mapping) -> None:
        self.embedding = bool(embedding)
        self.pooling = pooling_of(metadata, pooling, os.path.basename(os.fspath(self.path))) if embedding else None
        self._embed_lock = threading.Lock()  # one input group at a time in the context

    def _for_generation(self) -> None:
        if self.embedding:
            raise ValueError("this LLM was opened with embedding=True: its context computes embeddings, not "
                             "logits; open the model without it to generate")

    def embed(self, input, normalize: bool = True, truncate: bool = False, return_count: bool = False):
        """Embeddings of ``input`` (a string, strings, token ids or lists of them; strings get the
        model's special tokens as a prompt does), pooled by this LLM's pooling and L2-normalized
        unless normalize=False. A single input gives one vector (a list of floats), several a list
        of them; pooling "none" gives each input's per-token vectors. An input longer than a
        sequence's context is an error unless truncate=True (its first tokens are kept).
        return_count: (embeddings, tokens evaluated). Needs ``LLM(..., embedding=True)``."""
        vecs, single, n = self.embed_arrays(input, normalize, truncate)
        out = [v.tolist() for v in vecs]
        out = out[0] if single else out
        return (out, n) if return_count else out

    def create_embedding(self, input, model: Optional[str] = None, encoding_format: str = "float") -> dict:
        """OpenAI's embeddings response, as llama-cpp-python's ``create_embedding`` gives it: one
        pooled vector per input, normalized as OpenAI's and llama-server's are (encoding_format
        "base64": its float32 bytes in base64)."""
        if encoding_format not in ("float", "base64"):
            raise ValueError(f"encoding_format must be 'float' or 'base64', got {encoding_format!r}")
        if self.embedding and self.pooling == "none":
            raise ValueError("pooling 'none' gives per-token vectors, which OpenAI's embeddings format has no place "
                             "for: open the LLM with pooling='mean', 'last' or 'cls'")
        vecs, _, n = self.embed_arrays(input, True, False)
        return openai_list(vecs, model or os.path.basename(os.fspath(self.path)), n, encoding_format)

    def embed_arrays(self, input, normalize: bool = True, truncate: bool = False):
        """embed() as (float32 arrays, whether input was a single input, tokens evaluated)."""
        if self.ctx is None:
            raise ValueError("this LLM is closed")
        if not self.embedding:
            raise ValueError("embeddings need an LLM opened with embedding=True (its context then computes "
                             "hidden states instead of logits)")
        lists, single = token_lists(input, lambda t: self.tokenizer.encode(t, add_special=True, parse_special=False))
        cap, n_vocab = self.ctx.capacity(0), self.model.n_vocab
        for i, t in enumerate(lists):
            if not t:
                raise ValueError(f"input[{i}] has no tokens")
            bad = [x for x in t if not 0 <= x < n_vocab]
            if bad:
                raise ValueError(f"input[{i}]: token id {bad[0]} is outside the vocabulary (0..{n_vocab - 1})")
            if len(t) > cap:
                if not truncate:
                    raise InputTooLong(i, len(t), cap, "; give truncate=True to embed its first tokens, or a "
                                                       "larger n_ctx")
                lists[i] = t[:cap]
        with self._embed_lock:
            vecs = embed_tokens(self.ctx, lists, self.pooling)
        if normalize:
            vecs = [l2_normalize(v) for v in vecs]
        return vecs, single, sum(len(t) for t in lists)
