"""Text <-> token ids for GGUF models, matching llama.cpp's tokenizer.

Built on the `tokenizers` library from the GGUF tokenizer metadata:

* ``tokenizer.ggml.model == "gpt2"``: byte-level BPE (GPT-2 byte-to-unicode alphabet, merges from
  ``tokenizer.ggml.merges``) after llama.cpp's pre-tokenizer regexes for ``tokenizer.ggml.pre``.
* ``tokenizer.ggml.model == "llama"``: SentencePiece-style BPE: spaces become "▁", the pair whose
  merged piece has the best score merges first, characters outside the vocabulary fall back to
  ``<0xXX>`` byte tokens. The score order is turned into a BPE merge table once per vocabulary.

Special tokens follow llama.cpp: control/unknown tokens are recognised in the input text only when
``parse_special`` is true; user-defined tokens (gemma's runs of newlines, tabs and spaces) always are.
"""
from __future__ import annotations

import codecs
import threading
from collections import OrderedDict
from typing import Iterable, List, Mapping, Optional, Sequence

import numpy as np

from .infill import FIM_EOG_TEXTS

__all__ = ["Tokenizer", "StreamingDetokenizer", "TokenType"]


class TokenType:
    """GGUF ``tokenizer.ggml.token_type`` values."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# llama.cpp's pre-tokenizer regexes (src/llama-vocab.cpp), applied one after the other: each splits
# every piece left by the previous one into its matches and the gaps between them.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
           r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]

# tokenizer.ggml.pre -> (regexes, ignore_merges)
_PRE = {}
for _names, _regexes, _ignore in [
    (("default",), _DEFAULT, False),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"), [_LLAMA3], True),
    (("dbrx", "smaug-bpe"), [_LLAMA3], False),
    (("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"), [_QWEN2], False),
    (("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
     [r"\p{N}", _GPT2], False),
    (("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "jina-es", "jina-de", "jina-v1-en",
      "jina-v2-es", "jina-v2-de", "jina-v2-code", "roberta-bpe"), [_GPT2], False),
]:
    for _n in _names:
        _PRE[_n] = (_regexes, _ignore)
# llama3-style vocabularies: ignore_merges (a whole pre-token found in the vocabulary is used as is)
# and BOS added by default.
_LLAMA3_NAMES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"}

# Token texts llama.cpp treats as end-of-generation (besides EOS and EOT ids from the metadata).
_EOG_TEXTS = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<|return|>", "<|call|>",
}
_EOT_TEXTS = ["<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|end_of_text|>", "<EOT>", "_<EOT>", "<end_of_utterance>"]


def _bytes_to_unicode() -> dict:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table = {}
    extra = 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


def _as_list(value) -> list:
    if value is None:
        return []
    if isinstance(value, np.ndarray):
        return value.tolist()
    return list(value)


def _scalar(meta: Mapping, key: str, default=None):
    v = meta.get(key, default)
    if isinstance(v, np.ndarray):
        v = v.item() if v.size == 1 else v
    if isinstance(v, np.generic):
        v = v.item()
    return v


class Tokenizer:
    """A GGUF model's tokenizer. Build with :meth:`from_metadata`."""

    def __init__(self, *, kind: str, pre: str, tokens: List[str], token_types: np.ndarray,
                 hf_tokenizer, add_bos: bool, add_eos: bool, add_space_prefix: bool,
                 bos_id: Optional[int], eos_id: Optional[int], eot_id: Optional[int],
                 unk_id: Optional[int], pad_id: Optional[int], eog_ids: frozenset, name: str = ""):
        self.kind = kind  # "bpe" (byte-level) or "spm"
        self.pre = pre
        self.name = name
        self._tokens = tokens
        self.token_types = token_types
        self._hf = hf_tokenizer
        self._hf_lock = threading.Lock()
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.add_space_prefix = add_space_prefix
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.eot_id = eot_id
        self.unk_id = unk_id
        self.pad_id = pad_id
        self.eog_ids = eog_ids
        self._token_to_id = None
        self._pieces: dict = {}  # id -> bytes (special tokens rendered), filled lazily

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_metadata(cls, meta: Mapping, name: str = "", cache: bool = True) -> "Tokenizer":
        """Build from a GGUF metadata dict (``tokenizer.ggml.*`` keys; arrays as lists or numpy).

        With ``cache`` the build is kept per vocabulary (a few most recent), so loading a model
        with the same tokenizer again is instant; gemma's 262k vocabulary takes seconds to build.
        """
        model = _scalar(meta, "tokenizer.ggml.model")
        if model is None:
            raise ValueError(f"{name or 'model'}: GGUF metadata has no tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if tokens is None or len(tokens) == 0:
            raise ValueError(f"{name or 'model'}: GGUF metadata has no tokenizer.ggml.tokens")
        pre = _scalar(meta, "tokenizer.ggml.pre", "default") or "default"
        merges = meta.get("tokenizer.ggml.merges")
        key = (model, pre, len(tokens), hash(tuple(tokens)),
               0 if merges is None else len(merges),
               0 if merges is None else hash(tuple(merges)))
        built = None
        if cache:
            with _CACHE_LOCK:
                built = _CACHE.get(key)
                if built is not None:
                    _CACHE.move_to_end(key)
        if built is None:
            # the lock goes with the HF tokenizer: encode_special_tokens is state on that object
            built = _build(meta, model, pre, name) + (threading.Lock(),)
            if cache:
                with _CACHE_LOCK:
                    _CACHE[key] = built
                    while len(_CACHE) > 4:
                        _CACHE.popitem(last=False)
        hf, tokens_list, types, index, lock = built
        tok = cls._finish(meta, model, pre, tokens_list, types, index, hf, name)
        tok._hf_lock = lock
        return tok

    @classmethod
    def _finish(cls, meta, model, pre, tokens, types, index, hf, name):
        n = len(tokens)

        def tid(key, default):
            v = _scalar(meta, key, None)
            if v is None:
                return default
            v = int(v)
            if not 0 <= v < n:
                return default
            return v

        if model == "llama":
            kind = "spm"
            bos, eos, unk, pad = tid("tokenizer.ggml.bos_token_id", 1), tid("tokenizer.ggml.eos_token_id", 2), \
                tid("tokenizer.ggml.unknown_token_id", 0), tid("tokenizer.ggml.padding_token_id", None)
            add_bos_default, add_space_default = True, True
        else:
            kind = "bpe"
            bos, eos, unk, pad = tid("tokenizer.ggml.bos_token_id", 11 if n > 11 else None), \
                tid("tokenizer.ggml.eos_token_id", 11 if n > 11 else None), \
                tid("tokenizer.ggml.unknown_token_id", None), tid("tokenizer.ggml.padding_token_id", None)
            add_bos_default = pre in _LLAMA3_NAMES
            add_space_default = False
        add_bos = _scalar(meta, "tokenizer.ggml.add_bos_token", None)
        add_eos = _scalar(meta, "tokenizer.ggml.add_eos_token", None)
        add_space = _scalar(meta, "tokenizer.ggml.add_space_prefix", None) if kind == "spm" else False
        add_bos = add_bos_default if add_bos is None else bool(add_bos)
        add_eos = False if add_eos is None else bool(add_eos)
        add_space = add_space_default if add_space is None else bool(add_space)
        if add_bos and bos is None:
            raise ValueError(f"{name or 'model'}: tokenizer.ggml.add_bos_token is set but the BOS id is not")
        if add_eos and eos is None:
            raise ValueError(f"{name or 'model'}: tokenizer.ggml.add_eos_token is set but the EOS id is not")

        eot = tid("tokenizer.ggml.eot_token_id", None)
        if eot is None:
            for t in _EOT_TEXTS:
                if t in index:
                    eot = index[t]
                    break
        eog = {i for i in (eos, eot, tid("tokenizer.ggml.eom_token_id", None)) if i is not None}
        eog.update(index[t] for t in _EOG_TEXTS | FIM_EOG_TEXTS if t in index)
        if "<|return|>" in index and "<|call|>" in index and "<|end|>" in index:
            # gpt-oss (harmony): <|end|> closes a message (the reasoning) and the answer follows;
            # the turn ends at <|return|> or at a tool <|call|>, as llama.cpp decides too
            eog.discard(index["<|end|>"])
        tok = cls(kind=kind, pre=pre, tokens=tokens, token_types=types, hf_tokenizer=hf,
                  add_bos=add_bos, add_eos=add_eos, add_space_prefix=add_space, bos_id=bos,
                  eos_id=eos, eot_id=eot, unk_id=unk, pad_id=pad, eog_ids=frozenset(eog), name=name)
        tok._token_to_id = index
        return tok

    # ------------------------------------------------------------------ properties

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def id_to_token(self, token_id: int) -> str:
        """The raw vocabulary string of a token (GPT-2 byte alphabet / "▁" spaces as stored)."""
        self._check_id(token_id)
        return self._tokens[token_id]

    def token_to_id(self, text: str) -> Optional[int]:
        return self._token_to_id.get(text)

    def is_special(self, token_id: int) -> bool:
        """Control or unknown token (not rendered when decoding with ``skip_special``)."""
        return int(self.token_types[token_id]) in (TokenType.CONTROL, TokenType.UNKNOWN)

    def is_eog(self, token_id: int) -> bool:
        """End-of-generation token (EOS, EOT, <|im_end|>, <end_of_turn>, ...)."""
        return token_id in self.eog_ids

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> List[int]:
        """Token ids of ``text`` as llama.cpp's ``llama_tokenize(text, add_special, parse_special)``.

        ``add_special`` adds BOS/EOS where the model asks for them; ``parse_special`` turns control
        token text in the input (like ``<|im_start|>``) into that token.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        out: List[int] = []
        if add_special and self.add_bos:
            out.append(self.bos_id)
        if text:
            with self._hf_lock:
                self._hf.encode_special_tokens = not parse_special
                out.extend(self._hf.encode(text, add_special_tokens=False).ids)
        if add_special and self.add_eos:
            out.append(self.eos_id)
        return out

    def token_bytes(self, token_id: int, special: bool = True) -> bytes:
        """The bytes a token stands for; control tokens give their text, or b"" unless ``special``."""
        self._check_id(token_id)
        ttype = int(self.token_types[token_id])
        if ttype in (TokenType.CONTROL, TokenType.UNKNOWN) and not special:
            return b""
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._piece(token_id, ttype)
            self._pieces[token_id] = piece
        return piece

    def _piece(self, token_id: int, ttype: int) -> bytes:
        text = self._tokens[token_id]
        if ttype in (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED):
            return text.encode("utf-8", "surrogateescape")
        if ttype == TokenType.BYTE and text.startswith("<0x") and text.endswith(">"):
            return bytes([int(text[3:-1], 16)])
        if ttype in (TokenType.NORMAL, TokenType.UNDEFINED, TokenType.BYTE):
            if self.kind == "spm":
                return text.replace("\u2581", " ").encode("utf-8", "surrogateescape")
            try:
                return bytes(_BYTE_DECODER[c] for c in text)
            except KeyError:  # not a byte-level string: show it as it is
                return text.encode("utf-8", "surrogateescape")
        return b""  # unused tokens render as nothing, as in llama.cpp

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        ids = [int(i) for i in ids]
        parts = []
        strip_space = self.add_space_prefix
        for i in ids:
            piece = self.token_bytes(i, special=not skip_special)
            if strip_space and piece and i != self.bos_id:
                # SentencePiece models prepend a space to the text; take it off again
                if piece.startswith(b" ") and int(self.token_types[i]) == TokenType.NORMAL:
                    piece = piece[1:]
                strip_space = False
            parts.append(piece)
        return b"".join(parts)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of ``ids``; invalid UTF-8 (a cut multi-byte character) becomes U+FFFD."""
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def detokenizer(self, skip_special: bool = True) -> "StreamingDetokenizer":
        """A streaming decoder: feed token ids one by one, get back only complete characters."""
        return StreamingDetokenizer(self, skip_special)

    def _check_id(self, token_id) -> None:
        if not 0 <= int(token_id) < len(self._tokens):
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {len(self._tokens)})")

    def __repr__(self) -> str:
        return (f"Tokenizer({self.name or self.kind!r}, kind={self.kind}, pre={self.pre}, "
                f"vocab={self.vocab_size}, bos={self.bos_id}, eos={self.eos_id}, add_bos={self.add_bos})")


class StreamingDetokenizer:
    """Turns a stream of token ids into text, holding back a multi-byte character until complete.

    ``feed(id)`` returns the newly completed text (possibly ""), ``flush()`` whatever is left
    (an incomplete trailing sequence becomes U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True):
        self._tok = tokenizer
        self._skip_special = skip_special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = True
        self.ids: List[int] = []

    def feed(self, token_id: int) -> str:
        tok = self._tok
        token_id = int(token_id)
        self.ids.append(token_id)
        piece = tok.token_bytes(token_id, special=not self._skip_special)
        if self._first and piece and token_id != tok.bos_id:
            if tok.add_space_prefix and piece.startswith(b" ") \
                    and int(tok.token_types[token_id]) == TokenType.NORMAL:
                piece = piece[1:]  # the space SentencePiece put in front of the text
            self._first = False
        return self._decoder.decode(piece, final=False)

    def feed_many(self, ids: Iterable[int]) -> str:
        return "".join(self.feed(i) for i in ids)

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


# ---------------------------------------------------------------------- building (cached)

_CACHE: "OrderedDict[tuple, tuple]" = OrderedDict()
_CACHE_LOCK = threading.Lock()


def _build(meta: Mapping, model: str, pre: str, name: str):
    from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer
    from tokenizers import models, normalizers, pre_tokenizers

    where = name or "model"
    tokens = _as_list(meta["tokenizer.ggml.tokens"])
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    n = len(tokens)
    types = meta.get("tokenizer.ggml.token_type")
    types = np.full(n, TokenType.NORMAL, dtype=np.int32) if types is None else np.asarray(types, dtype=np.int32)
    if types.shape[0] < n:
        raise ValueError(f"{where}: tokenizer.ggml.token_type has {types.shape[0]} entries for {n} tokens")
    types = types[:n].copy()
    # llama.cpp forces end-of-turn style tokens to control so they never leak into text
    for i, t in enumerate(tokens):
        if types[i] != TokenType.CONTROL and t in _EOG_TEXTS and t.startswith("<"):
            types[i] = TokenType.CONTROL

    vocab = {}
    for i, t in enumerate(tokens):
        if t in vocab:
            raise ValueError(f"{where}: duplicate token in vocabulary: {t!r} has ids {vocab[t]} and {i}")
        vocab[t] = i
    index = dict(vocab)  # text -> id for callers; vocab below is what the tokenizers library sees
    # A token that is not valid UTF-8 (the GGUF reader keeps such bytes as surrogate escapes) can
    # never match input text; the tokenizers library only takes valid strings, so it gets a
    # placeholder name there. Decoding still uses the original bytes.
    for i, t in enumerate(tokens):
        if not t.isascii():
            try:
                t.encode("utf-8")
            except UnicodeEncodeError:
                del vocab[t]
                vocab[f"[INVALID_UTF8_{i}]"] = i

    if model == "gpt2":
        if pre not in _PRE:
            raise ValueError(f"{where}: unsupported pre-tokenizer tokenizer.ggml.pre={pre!r} "
                             f"(known: {', '.join(sorted(_PRE))})")
        regexes, ignore_merges = _PRE[pre]
        raw_merges = meta.get("tokenizer.ggml.merges")
        if raw_merges is None:
            raise ValueError(f"{where}: BPE tokenizer without tokenizer.ggml.merges")
        merges = []
        for m in _as_list(raw_merges):
            pos = m.find(" ", 1)
            if pos < 0:
                continue
            left, right = m[:pos], m[pos + 1:]
            # a merge whose parts or result are not tokens can never apply (llama.cpp skips it
            # silently); the tokenizers library would refuse the whole table
            if left in vocab and right in vocab and left + right in vocab:
                merges.append((left, right))
        bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges)
        hf = HFTokenizer(bpe)
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif model == "llama":
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None:
            raise ValueError(f"{where}: SentencePiece tokenizer without tokenizer.ggml.scores")
        scores = np.asarray(scores, dtype=np.float64)[:n]
        hf = HFTokenizer(models.BPE(vocab=vocab, merges=_spm_merges(tokens, types, scores, vocab),
                                    byte_fallback=True))
        # spaces become the "▁" marker; add_space_prefix is handled per raw-text segment, like llama.cpp
        add_space = _scalar(meta, "tokenizer.ggml.add_space_prefix", None)
        norm = [normalizers.Replace(" ", "\u2581")]
        if add_space is None or bool(add_space):
            norm.insert(0, normalizers.Prepend(" "))
        hf.normalizer = normalizers.Sequence(norm)
    else:
        raise ValueError(f"{where}: unsupported tokenizer type tokenizer.ggml.model={model!r} "
                         f"(supported: gpt2, llama)")

    specials, user = [], []
    for i in np.nonzero((types == TokenType.CONTROL) | (types == TokenType.UNKNOWN)
                        | (types == TokenType.USER_DEFINED))[0].tolist():
        is_special = types[i] != TokenType.USER_DEFINED
        if tokens[i] not in vocab:
            continue
        tok = AddedToken(tokens[i], special=is_special, normalized=False, lstrip=False, rstrip=False,
                         single_word=False)
        (specials if is_special else user).append(tok)
    if user:
        hf.add_tokens(user)
    if specials:
        hf.add_special_tokens(specials)
    return hf, tokens, types, index


def _spm_merges(tokens: Sequence[str], types: np.ndarray, scores: np.ndarray, vocab: dict):
    """SentencePiece BPE as a merge table: every split (left, right) of a normal token into two
    vocabulary pieces, ranked by the merged token's score (best first), which makes "merge the
    adjacent pair whose result scores best" the same as "apply the lowest-ranked merge"."""
    normal = np.nonzero((types == TokenType.NORMAL) | (types == TokenType.UNDEFINED))[0]
    order = normal[np.argsort(-scores[normal], kind="stable")]
    pieces = set(vocab)  # set membership is cheaper than dict lookup in this 1-2M step loop
    ordered = [t for t in (tokens[i] for i in order.tolist()) if t in pieces]
    return [(t[:k], t[k:]) for t in ordered for k in range(1, len(t))
            if t[:k] in pieces and t[k:] in pieces]
