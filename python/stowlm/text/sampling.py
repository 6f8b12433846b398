"""Choosing the next token from logits.

:class:`Sampler` follows llama.cpp's default chain: repetition penalties -> logit bias -> top-k ->
top-p -> min-p -> temperature -> draw from the softmax (seeded numpy Generator). Temperature 0 is
greedy: the argmax after penalties and bias.

Where the text stops (stop strings, end of generation, max_tokens) is stowlm.text.stream's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

__all__ = ["SamplingParams", "Sampler"]


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Defaults are llama.cpp's.

    temperature: 0 = greedy; top_k: 0 = off; top_p: 1 = off; min_p: 0 = off;
    repeat_penalty: 1 = off, applied over the last ``repeat_last_n`` tokens (-1: all, 0: off),
    as are frequency_penalty / presence_penalty; seed: None = fresh entropy;
    max_tokens: None = until an end-of-generation token; stop: strings that end the text (not
    included in it); logit_bias: token id -> value added to its logit (-inf bans it).
    typical_p: locally typical sampling's mass, 1 = off (after top-k, before top-p, as llama.cpp);
    mirostat: 1 or 2 (0 = off) replaces top-k, top-p, min-p and typical-p by Mirostat's cut at the
    target surprise mirostat_tau (bits), adapted at the rate mirostat_eta after every token.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 256
    stop: List[str] = field(default_factory=list)
    logit_bias: Dict[int, float] = field(default_factory=dict)
    typical_p: float = 1.0
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1

    def __post_init__(self):
        self.validate()

    def validate(self) -> "SamplingParams":
        def bad(name, why):
            raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        if not _is_num(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            bad("temperature", "must be a finite number >= 0 (0 = greedy)")
        if not _is_int(self.top_k) or self.top_k < 0:
            bad("top_k", "must be an integer >= 0 (0 = off)")
        if not _is_num(self.top_p) or not (0.0 < self.top_p <= 1.0):
            bad("top_p", "must be in (0, 1] (1 = off)")
        if not _is_num(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            bad("min_p", "must be in [0, 1] (0 = off)")
        if not _is_num(self.repeat_penalty) or not math.isfinite(self.repeat_penalty) or self.repeat_penalty <= 0:
            bad("repeat_penalty", "must be a finite number > 0 (1 = off)")
        if not _is_int(self.repeat_last_n) or self.repeat_last_n < -1:
            bad("repeat_last_n", "must be an integer >= -1 (-1 = whole history, 0 = off)")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not math.isfinite(v):
                bad(name, "must be a finite number")
        if not _is_num(self.typical_p) or not (0.0 < self.typical_p <= 1.0):
            bad("typical_p", "must be in (0, 1] (1 = off)")
        if self.mirostat not in (0, 1, 2) or isinstance(self.mirostat, bool):
            bad("mirostat", "must be 0 (off), 1 or 2")
        for name in ("mirostat_tau", "mirostat_eta"):
            v = getattr(self, name)
            if not _is_num(v) or not math.isfinite(v) or v <= 0:
                bad(name, "must be a finite number > 0")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            bad("seed", "must be None or an integer >= 0")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            bad("max_tokens", "must be None or an integer >= 1")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a list of non-empty strings")
        self.stop = list(self.stop)
        if not isinstance(self.logit_bias, Mapping):
            bad("logit_bias", "must be a dict {token_id: bias}")
        clean = {}
        for k, v in self.logit_bias.items():
            if not _is_int(k) or k < 0:
                raise ValueError(f"SamplingParams.logit_bias: key {k!r} is not a token id (integer >= 0)")
            if not _is_num(v) or math.isnan(v) or v == math.inf:
                raise ValueError(f"SamplingParams.logit_bias[{k}]={v!r}: must be a number "
                                 f"(finite, or -inf to ban the token)")
            clean[int(k)] = float(v)
        self.logit_bias = clean
        return self


class Sampler:
    """Picks token ids from logits according to :class:`SamplingParams`.

    ``sample(logits, history)``: logits is the 1-D vector for the next position, history the ids
    so far (prompt and generated; the penalties look at its last ``repeat_last_n``).
    """

    # top-p without top-k first looks for the nucleus among this many best tokens (exact: the
    # full sort runs when the nucleus is not inside them).
    _NUCLEUS_PREFETCH = 1024

    def __init__(self, params: Optional[SamplingParams] = None, vocab_size: Optional[int] = None):
        self.params = (params or SamplingParams()).validate()
        self.vocab_size = vocab_size
        if vocab_size is not None:
            for k in self.params.logit_bias:
                if k >= vocab_size:
                    raise ValueError(f"SamplingParams.logit_bias: token id {k} is outside the vocabulary "
                                     f"(size {vocab_size})")
        self.rng = np.random.default_rng(self.params.seed)
        self.mu = 2.0 * self.params.mirostat_tau  # Mirostat's running surprise limit (bits)

    def reseed(self, seed: Optional[int]) -> None:
        self.rng = np.random.default_rng(seed)

    # -- the chain, step by step (public so callers and tests can inspect it) --------------

    def apply_penalties(self, logits: np.ndarray, history: Sequence[int] = ()) -> np.ndarray:
        """Repetition / frequency / presence penalties (llama.cpp's formula): the logits as float32,
        a copy where a penalty applies (else possibly the caller's array: not to be written)."""
        p = self.params
        n = p.repeat_last_n
        if n == 0 or (p.repeat_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0):
            return np.asarray(logits, dtype=np.float32)  # no copy: a vocabulary's worth a token
        out = np.array(logits, dtype=np.float32, copy=True)
        hist = np.asarray(history, dtype=np.int64).ravel()
        if n > 0:
            hist = hist[-n:]
        if hist.size == 0:
            return out
        if hist.min() < 0 or hist.max() >= out.shape[0]:
            raise ValueError(f"history has token ids outside the vocabulary (size {out.shape[0]})")
        ids, counts = np.unique(hist, return_counts=True)
        vals = out[ids]
        # a positive logit is divided, a negative one multiplied, so the penalty always lowers it
        vals = np.where(vals <= 0, vals * p.repeat_penalty, vals / p.repeat_penalty)
        vals = vals - counts * p.frequency_penalty - p.presence_penalty
        out[ids] = vals.astype(np.float32)
        return out

    def apply_logit_bias(self, logits: np.ndarray) -> np.ndarray:
        if not self.params.logit_bias:
            return logits
        ids = np.fromiter(self.params.logit_bias.keys(), dtype=np.int64)
        if ids.max() >= logits.shape[0]:
            raise ValueError(f"logit_bias token id {int(ids.max())} is outside the vocabulary "
                             f"(size {logits.shape[0]})")
        logits[ids] += np.fromiter(self.params.logit_bias.values(), dtype=np.float32)
        return logits

    def candidates(self, logits, history: Sequence[int] = (),
                   allowed: Optional[np.ndarray] = None) -> Tuple[np.ndarray, np.ndarray]:
        """The filtered distribution the next token is drawn from: (ids, probabilities), best first.

        Greedy (temperature 0) gives the single argmax with probability 1. ``allowed`` (booleans
        over the vocabulary, from a grammar) leaves only those tokens in the running.
        """
        x = np.asarray(logits)
        if x.ndim != 1 or x.shape[0] == 0:
            raise ValueError(f"logits must be a non-empty 1-D vector, got shape {x.shape}")
        if self.vocab_size is not None and x.shape[0] != self.vocab_size:
            raise ValueError(f"logits have {x.shape[0]} entries, the vocabulary {self.vocab_size}")
        x = self.apply_penalties(x, history)
        if (self.params.logit_bias or allowed is not None) and np.shares_memory(x, logits):
            x = x.copy()  # written below: never the caller's logits
        x = self.apply_logit_bias(x)
        top = float(x.max())  # each pass over a vocabulary costs: the largest logit once
        if math.isnan(top):  # (a NaN anywhere makes the max NaN)
            raise ValueError("logits contain NaN")
        if allowed is not None:
            x[~allowed[:x.shape[0]]] = -np.inf
            top = float(x.max())
            if not math.isfinite(top):
                raise ValueError("the grammar allows no token here")
        p = self.params
        if p.temperature == 0.0:
            best = int(np.argmax(x))
            return np.array([best], dtype=np.int64), np.array([1.0])
        if not math.isfinite(top):
            raise ValueError("no token has a finite logit (all banned?)")
        if p.mirostat:
            return self._mirostat(x)
        ids, vals = self._top(x, top)
        prefetched = p.top_k == 0 and ids.shape[0] < x.shape[0]  # top-p's best-N, not a cut
        if vals[-1] == -np.inf:  # banned tokens (logit bias -inf) are no candidates
            finite = vals > -np.inf
            ids, vals = ids[finite], vals[finite]
        if p.typical_p < 1.0 and len(ids) > 1:
            ids, vals = self._typical(ids, vals)
        # top-p and min-p work on the untempered distribution, as in llama.cpp
        keep = len(ids)
        if p.top_p < 1.0 and keep > 1:
            if prefetched:
                # prefetched best-N: normalise over the whole vocabulary
                probs = np.exp(vals.astype(np.float64) - _logsumexp(x))
            else:
                probs = _softmax(vals)
            cum = np.cumsum(probs)
            hit = np.nonzero(cum >= p.top_p)[0]
            if hit.size == 0 and ids.shape[0] < x.shape[0]:
                ids, vals = self._sorted(x, np.arange(x.shape[0]))
                probs = _softmax(vals)
                cum = np.cumsum(probs)
                hit = np.nonzero(cum >= p.top_p)[0]
            keep = int(hit[0]) + 1 if hit.size else len(ids)
        ids, vals = ids[:keep], vals[:keep]
        if p.min_p > 0.0 and len(ids) > 1:
            keep = int(np.count_nonzero(vals >= vals[0] + math.log(p.min_p)))
            ids, vals = ids[:max(keep, 1)], vals[:max(keep, 1)]
        vals = vals.astype(np.float64) / p.temperature
        return ids, _softmax(vals)

    def sample(self, logits, history: Sequence[int] = (), allowed: Optional[np.ndarray] = None) -> int:
        ids, probs = self.candidates(logits, history, allowed)
        if len(ids) == 1:
            self._observe(1.0)
            return int(ids[0])
        cum = np.cumsum(probs)
        u = self.rng.random() * cum[-1]
        i = min(int(np.searchsorted(cum, u, side="right")), len(ids) - 1)
        self._observe(probs[i])
        return int(ids[i])

    __call__ = sample

    def sample_draft(self, logits, history: Sequence[int], draft: int) -> Tuple[int, bool]:
        """Speculative decoding's check of a drafted token: (token, kept). The draft is kept with
        the probability this sampler gives it; else the token is drawn from the distribution
        without it, renormalised, so the text follows the distribution sample() draws from
        (greedy: kept exactly when it is the argmax)."""
        ids, probs = self.candidates(logits, history)
        if len(ids) == 1:
            self._observe(1.0)
            return int(ids[0]), int(ids[0]) == int(draft)
        hit = np.flatnonzero(ids == draft)
        if hit.size and self.rng.random() < probs[hit[0]]:
            self._observe(probs[hit[0]])
            return int(draft), True
        if hit.size:
            ids, probs = np.delete(ids, hit[0]), np.delete(probs, hit[0])
        cum = np.cumsum(probs)
        i = min(int(np.searchsorted(cum, self.rng.random() * cum[-1], side="right")), len(ids) - 1)
        self._observe(probs[i])  # its probability in the target's distribution, as sample() sees it
        return int(ids[i]), False

    # -- helpers ----------------------------------------------------------------------

    def _observe(self, prob: float) -> None:
        """Mirostat: move mu by the chosen token's surprise against the target (llama.cpp's rule)."""
        if self.params.mirostat:
            self.mu -= self.params.mirostat_eta * (-math.log2(max(float(prob), 1e-300)) - self.params.mirostat_tau)

    def _typical(self, ids: np.ndarray, vals: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """Locally typical sampling: the candidates whose surprise is nearest the entropy, until
        their mass passes typical_p; best first again."""
        probs = _softmax(vals)
        logp = np.log(np.maximum(probs, 1e-300))
        order = np.argsort(np.abs(-logp - float(-(probs * logp).sum())), kind="stable")
        hit = np.nonzero(np.cumsum(probs[order]) > self.params.typical_p)[0]
        kept = np.sort(order[:int(hit[0]) + 1 if hit.size else len(order)])  # back in best-first order
        return ids[kept], vals[kept]

    def _mirostat(self, x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """Mirostat 1 or 2 over the tempered distribution (llama.cpp's chain: no other cut)."""
        p = self.params
        ids, vals = self._sorted(x, np.flatnonzero(x > -np.inf))
        probs = _softmax(vals.astype(np.float64) / p.temperature)
        if p.mirostat == 2:  # the tokens whose surprise is at most mu
            keep = max(1, int(np.count_nonzero(-np.log2(np.maximum(probs, 1e-300)) <= self.mu)))
        else:  # a Zipf exponent from the best 100, then the k whose expected surprise is mu
            m = min(100, len(probs))
            t = np.log(np.arange(2, m + 1) / np.arange(1, m))
            b = np.log(probs[:m - 1] / np.maximum(probs[1:m], 1e-300))
            s_hat = float((t * b).sum() / (t * t).sum()) if m > 1 else 1.0
            eps = s_hat - 1.0
            n = float(self.vocab_size or x.shape[0])
            try:
                k = (eps * 2.0 ** self.mu / (1.0 - n ** -eps)) ** (1.0 / s_hat) if eps != 0 else 1.0
            except (OverflowError, ZeroDivisionError):
                k = float(len(probs))
            keep = min(len(probs), max(1, int(k) if math.isfinite(k) else len(probs)))
        return ids[:keep], probs[:keep] / probs[:keep].sum()

    def _top(self, x: np.ndarray, top: float) -> Tuple[np.ndarray, np.ndarray]:
        """Candidates best first: the top-k, or (top-k off) a prefetch of the best, or all (top:
        the largest logit)."""
        n = x.shape[0]
        p = self.params
        k = p.top_k
        if k == 0 and p.top_p < 1.0 and p.typical_p == 1.0:  # (typical-p needs every candidate)
            k_eff = min(self._NUCLEUS_PREFETCH, n)
        elif k == 0:
            if p.min_p > 0.0 and p.typical_p == 1.0:
                # min-p is the only filter: apply it before sorting (same result, far less to sort)
                keep = np.nonzero(x >= top + math.log(p.min_p))[0]
                return self._sorted(x, keep)
            k_eff = n
        else:
            k_eff = min(k, n)
        if k_eff < n:
            part, pool = self._best(x, k_eff, top)
            if k > 0:
                # ties at the k-th value: keep the lower ids, so the result does not depend on
                # argpartition's internal order (every logit >= the k-th lies in the pool)
                kth = x[part].min()
                xp = x[pool]
                above = pool[xp > kth]
                tied = pool[xp == kth][:k_eff - above.size]
                part = np.concatenate([above, tied])
            return self._sorted(x, part)
        return self._sorted(x, np.arange(n))

    # A vocabulary's best k lie within a few logits of the largest: partitioning only those,
    # nearest first, instead of the whole vocabulary (smollm2's 49152 logits: 30 us against
    # argpartition's 380, of a 3 ms token).
    _BEST_SPANS = (3.0, 6.0, 12.0, 24.0)

    @classmethod
    def _best(cls, x: np.ndarray, k: int, top: float) -> Tuple[np.ndarray, np.ndarray]:
        """Ids of k largest logits (which of tied ones: argpartition's choice), and the ids,
        ascending, of a pool that holds every logit at least as large as the k-th."""
        for span in cls._BEST_SPANS:
            near = np.flatnonzero(x >= top - span)
            if near.size >= k:
                return near[np.argpartition(-x[near], k - 1)[:k]], near
        # a distribution flatter than the widest span
        return np.argpartition(-x, k - 1)[:k], np.arange(x.shape[0])

    @staticmethod
    def _sorted(x: np.ndarray, idx: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        idx = np.sort(idx)
        order = np.argsort(-x[idx], kind="stable")  # equal logits: lower id first
        ids = idx[order].astype(np.int64)
        return ids, x[ids]


def _logsumexp(x: np.ndarray) -> float:
    m = float(np.max(x))
    return m + math.log(float(np.sum(np.exp(x.astype(np.float64) - m))))


def _softmax(v: np.ndarray) -> np.ndarray:
    v = v.astype(np.float64)
    e = np.exp(v - v.max())
    return e / e.sum()
