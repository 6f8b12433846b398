"""Constrained decoding: a grammar decides which tokens may come next (llguidance).

A :class:`Grammar` is compiled once per request from what the caller asked for (a JSON schema,
any JSON object, GBNF, Lark, a regex) and checked against the model's vocabulary; a
:class:`Constraint` is its state in one sequence: the set of tokens allowed next, then the token
drawn. The model's end-of-generation tokens are allowed only where the grammar accepts, and a
grammar that can take nothing more ends the text at once.

llguidance is an optional extra (``pip install "stowlm[structured]"``): without it, asking for a
grammar raises :class:`StructuredUnavailable`, naming the extra. Masks of several sequences are
filled together by its executor, which runs without the GIL, so the batch engine's other
sequences and the event loop do not wait on them.
"""
from __future__ import annotations

import json
import threading
from typing import Any, List, Mapping, Optional, Sequence

import numpy as np

__all__ = ["EXTRA", "FieldError", "GrammarError", "StructuredUnavailable", "Grammar", "Constraint", "available",
           "from_request", "json_schema", "any_json_object", "gbnf", "lark", "regex", "fill_masks"]

EXTRA = 'pip install "stowlm[structured]"'
# JSON as people and models write it: ", " and ": ", no other whitespace (free whitespace lets a
# small model wander into runs of newlines that never end).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class StructuredUnavailable(RuntimeError):
    """llguidance, which structured output needs, is not installed."""


class FieldError(ValueError):
    """A request field that cannot be honoured as given; ``param`` names it (OpenAI's error param)."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(f"'{param}': {message}" if param else message)
        self.param = param
        self.reason = message


class GrammarError(FieldError):
    """A schema, grammar or regex that cannot be compiled."""


def _llg():
    try:
        import llguidance
    except ImportError:
        raise StructuredUnavailable(f"structured output (response_format, grammar, json_schema, tool_choice) needs "
                                    f"llguidance: {EXTRA}") from None
    return llguidance


def available() -> bool:
    try:
        _llg()
        return True
    except StructuredUnavailable:
        return False


# -- grammars from what a request says ----------------------------------------------------------------
# Each returns llguidance's grammar text (a JSON string); nothing here needs the vocabulary yet.

def json_schema(schema: Any, strict: bool = True, param: str = "json_schema") -> str:
    """Output valid against ``schema`` (a dict, or its JSON text). strict=False ignores keywords
    llguidance does not implement instead of refusing them."""
    llg = _llg()
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise GrammarError(f"the schema is not valid JSON: {e}", param) from None
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise GrammarError(f"the schema must be a JSON object, got {type(schema).__name__}", param)
    check_schema(schema, param)
    if strict:
        schema = tightened(schema)
    try:
        return llg.LLMatcher.grammar_from_json_schema(schema, overrides=dict(JSON_OPTIONS, lenient=not strict))
    except (ValueError, TypeError) as e:
        raise GrammarError(f"invalid schema: {e}", param) from None


MAX_INTEGER = 10 ** 16 - 1  # llama.cpp's JSON grammars also stop integers at 16 digits


def tightened(schema: Any) -> Any:
    """The schema as a strict one is read: every object that lists its properties is closed to
    others where it does not say (OpenAI's strict mode requires that), and an integer without
    bounds has at most 16 digits. Left open, a small model keeps inventing keys or digits."""
    if isinstance(schema, list):
        return [tightened(x) for x in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {k: (v if k in ("const", "enum", "default", "examples") else tightened(v)) for k, v in schema.items()}
    if isinstance(out.get("properties"), Mapping):
        out["properties"] = {k: tightened(v) for k, v in schema["properties"].items()}
        out.setdefault("additionalProperties", False)
    if out.get("type") == "integer":
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = MAX_INTEGER
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -MAX_INTEGER
    return out


def check_schema(schema: dict, param: str) -> None:
    """What jsonschema's own meta-schema check says, where jsonschema is installed (llguidance
    checks only the keywords it compiles)."""
    try:
        import jsonschema
    except ImportError:
        return
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.path)
        raise GrammarError(f"invalid schema{' at ' + where if where else ''}: {e.message}", param) from None


def any_json_object() -> str:
    return json_schema({"type": "object"}, param="response_format")


def gbnf(text: str, param: str = "grammar") -> str:
    """llama.cpp's GBNF (or Lark, which llguidance recognises by its syntax)."""
    llg = _llg()
    if not isinstance(text, str) or not text.strip():
        raise GrammarError("the grammar must be a non-empty string (GBNF)", param)
    try:
        return llg.grammar_from("gbnf", text)
    except ValueError as e:
        raise GrammarError(str(e), param) from None


def lark(text: str, param: str = "grammar") -> str:
    if not isinstance(text, str) or not text.strip():
        raise GrammarError("the grammar must be a non-empty string (Lark)", param)
    return _llg().LLMatcher.grammar_from_lark(text)


def regex(text: str, param: str = "regex") -> str:
    if not isinstance(text, str) or not text:
        raise GrammarError("the regex must be a non-empty string", param)
    return _llg().LLMatcher.grammar_from_regex(text)


def from_request(response_format: Any = None, grammar: Any = None, json_schema_: Any = None) -> Optional[str]:
    """The grammar of OpenAI's ``response_format`` or llama-server's ``grammar`` / ``json_schema``
    fields (at most one of them), or None for free text. GrammarError names the field."""
    given = [n for n, v in (("response_format", response_format), ("grammar", grammar),
                            ("json_schema", json_schema_)) if v is not None]
    if isinstance(response_format, Mapping) and response_format.get("type") == "text":
        given.remove("response_format")
    if len(given) > 1:
        raise GrammarError(f"give one of {', '.join(given)}, not several", given[1])
    if grammar is not None:
        return gbnf(grammar, "grammar")
    if json_schema_ is not None:
        return json_schema(json_schema_, param="json_schema")
    if response_format is None:
        return None
    rf = response_format
    if not isinstance(rf, Mapping) or not isinstance(rf.get("type"), str):
        raise GrammarError("must be an object with a 'type': text, json_object or json_schema", "response_format")
    kind = rf["type"]
    extra = set(rf) - {"type", "json_schema", "schema"}
    if extra:
        raise GrammarError(f"unknown field {sorted(extra)[0]!r}", "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        # llama-server also takes {"type": "json_object", "schema": {...}}
        return any_json_object() if rf.get("schema") is None else json_schema(rf["schema"], param="response_format.schema")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if js is None and rf.get("schema") is not None:  # llama-server's shorter form
            return json_schema(rf["schema"], param="response_format.schema")
        if not isinstance(js, Mapping):
            raise GrammarError("'json_schema' must be an object {name, schema, strict}", "response_format.json_schema")
        bad = set(js) - {"name", "schema", "strict", "description"}
        if bad:
            raise GrammarError(f"unknown field {sorted(bad)[0]!r}", "response_format.json_schema")
        name = js.get("name")
        if name is not None and not isinstance(name, str):
            raise GrammarError("'name' must be a string", "response_format.json_schema.name")
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise GrammarError("'strict' must be true or false", "response_format.json_schema.strict")
        schema = js.get("schema")
        if schema is None:
            schema = {}  # OpenAI: no schema is any JSON value
        return json_schema(schema, strict=strict is not False, param="response_format.json_schema.schema")
    raise GrammarError(f"unknown type {kind!r} (text, json_object or json_schema)", "response_format.type")


# -- the vocabulary, as llguidance sees it -----------------------------------------------------------

_TOKENIZERS_LOCK = threading.Lock()


def lltokenizer(tokenizer, n_vocab: Optional[int] = None):
    """llguidance's view of a stowlm Tokenizer (built once per tokenizer; ~1 s for 150k tokens):
    every token's bytes, control tokens marked as special (0xFF in front, so no grammar text can
    match them), the end-of-generation tokens as its EOS, our own encoder for its lookahead."""
    llg = _llg()
    n_vocab = n_vocab or tokenizer.vocab_size
    with _TOKENIZERS_LOCK:
        cached = getattr(tokenizer, "_llg_tokenizer", None)
        if cached is not None and cached[0] == n_vocab:
            return cached[1]
        from .tokenizer import TokenType

        types = tokenizer.token_types
        special = [i for i in range(tokenizer.vocab_size) if int(types[i]) in (TokenType.CONTROL, TokenType.UNKNOWN)]
        tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        for i in special:
            tokens[i] = b"\xff" + tokens[i]
        tokens += [b""] * (n_vocab - len(tokens))  # rows of the output matrix past the vocabulary

        class _View:
            eos_token_id = tokenizer.eos_id
            bos_token_id = tokenizer.bos_id
            special_token_ids = special

            def __init__(self):
                self.tokens = tokens

            def __call__(self, text):
                if isinstance(text, bytes):
                    text = text.decode("utf-8", "surrogateescape")
                return tokenizer.encode(text, add_special=False, parse_special=False)

        eos = sorted(tokenizer.eog_ids) or ([tokenizer.eos_id] if tokenizer.eos_id is not None else [])
        built = llg.LLTokenizer(llg.TokenizerWrapper(_View()), n_vocab=n_vocab, eos_token=eos)
        tokenizer._llg_tokenizer = (n_vocab, built)
        return built


# -- compiled grammars and their state in a sequence ---------------------------------------------------

class Grammar:
    """A grammar checked against one model's vocabulary; start() gives a fresh Constraint."""

    def __init__(self, tokenizer, grammar: str, n_vocab: Optional[int] = None, param: Optional[str] = None):
        llg = _llg()
        self.tokenizer = tokenizer
        self.lltok = lltokenizer(tokenizer, n_vocab)
        self.text = grammar
        self.n_vocab = self.lltok.vocab_size
        # the matcher compiles the grammar and keeps its error (validate_grammar would compile it twice)
        self._initial = llg.LLMatcher(self.lltok, grammar, log_level=0)
        if self._initial.is_error():
            raise GrammarError(f"invalid grammar: {self._initial.get_error()}", param)

    def start(self) -> "Constraint":
        return Constraint(self._initial.deep_copy(), self.n_vocab)


class Constraint:
    """One sequence's place in a grammar: allowed() is the set of tokens that may come next,
    accept(token) moves on; done is set once nothing but the end may follow."""

    def __init__(self, matcher, n_vocab: int):
        self.matcher = matcher
        self.n_vocab = n_vocab
        self.words = np.full((1, (n_vocab + 31) // 32), -1, dtype=np.int32)

    active = True  # a grammar that only starts on a trigger is inactive before it

    @property
    def done(self) -> bool:
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()

    def allowed(self) -> np.ndarray:
        """Booleans over the vocabulary: the tokens the grammar allows next."""
        self.matcher.unsafe_compute_mask_ptr(self.words.ctypes.data, self.words.nbytes)
        return self.unpack()

    def unpack(self) -> np.ndarray:
        bits = np.unpackbits(self.words.view(np.uint8), bitorder="little")[:self.n_vocab]
        return bits.view(np.bool_)

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")


_EXECUTOR = None


def fill_masks(constraints: Sequence[Constraint]) -> List[np.ndarray]:
    """allowed() of several constraints at once, filled in parallel without the GIL."""
    global _EXECUTOR
    if len(constraints) == 1:
        return [constraints[0].allowed()]
    llg = _llg()
    if _EXECUTOR is None:
        _EXECUTOR = llg.LLExecutor()
    n_words = max(c.words.shape[1] for c in constraints)
    words = np.full((len(constraints), n_words), -1, dtype=np.int32)
    _EXECUTOR.unsafe_compute_mask_ptr([(c.matcher, i) for i, c in enumerate(constraints)], words.ctypes.data,
                                      n_words * 4, len(constraints))
    out = []
    for i, c in enumerate(constraints):
        c.words[0, :] = words[i, :c.words.shape[1]]
        out.append(c.unpack())
    return out
