"""Constrained decoding (stowlm.grammar): token masks against oracles computed here from the token
bytes and Python's `re`, JSON outputs against `jsonschema`, greedy text the same alone and in a
batch, and every bad schema or grammar refused naming its field."""
import json
import random
import re
import sys

import numpy as np
import pytest

llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

import stowlm  # noqa: E402
from stowlm.text import grammar as gm  # noqa: E402
from stowlm.gguffile import GGUFFile  # noqa: E402
from stowlm.text.sampling import Sampler, SamplingParams  # noqa: E402
from stowlm.text.tokenizer import Tokenizer  # noqa: E402

from conftest import get_model  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    with GGUFFile(get_model("smollm2-135m")) as f:
        return Tokenizer.from_metadata(f.metadata)


@pytest.fixture(scope="module")
def llm():
    with stowlm.LLM(str(get_model("smollm2-135m")), n_ctx=2048, progress=False) as m:
        yield m


def _text_tokens(tok, special=False):
    return [i for i in range(tok.vocab_size) if special or not tok.is_special(i)]


def test_first_mask_is_exactly_the_tokens_that_start_the_language(tok):
    """For a two-word language, the allowed set is computed here by brute force over the token
    bytes: every non-empty token that is a prefix of "yes" or "no" (and nothing else, not EOS)."""
    g = gm.Grammar(tok, gm.gbnf('root ::= "yes" | "no"'))
    c = g.start()
    allowed = set(np.nonzero(c.allowed())[0].tolist())
    want = {i for i in range(tok.vocab_size) if not tok.is_special(i)
            and (b := tok.token_bytes(i)) and (b"yes".startswith(b) or b"no".startswith(b))}
    assert allowed == want and tok.encode("yes", add_special=False)[0] in allowed
    c.accept(tok.encode("no", add_special=False)[0])
    assert c.done and c.accepting
    after = np.nonzero(c.allowed())[0].tolist()
    assert set(after) <= tok.eog_ids and after  # nothing but the end


def test_end_of_generation_only_where_the_grammar_accepts(tok):
    g = gm.Grammar(tok, gm.regex(r"[0-9]{2,4}"))
    digit = {d: tok.encode(d, add_special=False)[0] for d in "0123456789"}
    c = g.start()
    for n in range(4):
        m = c.allowed()
        assert all(m[e] == (n >= 2) for e in tok.eog_ids), n
        assert m[digit[str(n)]]
        c.accept(digit[str(n)])
    assert c.done  # four digits: only the end may follow


@pytest.mark.parametrize("pattern", [r"[a-c]{2,5}-(x|yy)[0-9]{1,3}", r"(true|false|null)", r"\([0-9]+(,[0-9]+){0,3}\)",
                                     r"[A-Z][a-z]{0,6}( [A-Z][a-z]{0,6}){0,2}\."])
def test_sampling_under_a_regex_always_matches_it(tok, pattern):
    """A fake model (random logits, favouring short tokens so the text ends) sampled at
    temperature 1 through the grammar's masks: Python's `re` accepts every text."""
    g = gm.Grammar(tok, gm.regex(pattern))
    lengths = np.array([len(tok.token_bytes(i)) for i in range(tok.vocab_size)])
    rng = np.random.default_rng(0)
    for seed in range(25):
        sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed))
        c, ids = g.start(), []
        for _ in range(64):
            logits = (rng.normal(size=tok.vocab_size) * 2 - lengths).astype(np.float32)
            t = sampler.sample(logits, allowed=c.allowed())
            if tok.is_eog(t):
                break
            c.accept(t)
            ids.append(t)
            if c.done:
                break
        text = tok.decode(ids)
        assert re.fullmatch(pattern, text), (pattern, text)


def _random_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["string", "integer", "enum", "boolean", "array", "object"] if depth < 2 else \
        ["string", "integer", "enum", "boolean"]
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.choice([8, 16, 24])}
    if kind == "integer":
        return {"type": "integer", "minimum": rng.choice([0, -100]), "maximum": rng.choice([100, 10000])}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "north", "south", "yes", "no", "maybe"], rng.randint(2, 4))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        return {"type": "array", "items": _random_schema(rng, depth + 1), "minItems": 1, "maxItems": rng.randint(1, 3)}
    names = rng.sample(["name", "age", "color", "city", "tags", "ok", "size", "owner", "id", "kind"], rng.randint(1, 4))
    props = {n: _random_schema(rng, depth + 1) for n in names}
    return {"type": "object", "properties": props, "required": rng.sample(names, rng.randint(1, len(names)))}


def random_object_schema(seed: int) -> dict:
    rng = random.Random(seed)
    while True:
        s = _random_schema(rng, 1)
        if s.get("type") == "object":
            return s


def test_json_schemas_give_valid_json_from_the_real_model(llm):
    for seed in range(12):
        schema = random_object_schema(seed)
        out = llm.chat([{"role": "user", "content": "Describe something as JSON."}], max_tokens=160,
                       temperature=0.7, seed=seed, json_schema=schema)
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)


def test_response_format_forms(llm):
    msgs = [{"role": "user", "content": "Give me a small JSON object."}]
    # json_object bounds no string: a prompt that asks for a short object, which a 135M model
    # ends (on "a small JSON object" it may fill a string until max_tokens, whose text is cut)
    ask = [{"role": "user", "content": 'Reply with exactly this JSON object: {"ok": true}'}]
    a = llm.chat(ask, max_tokens=120, temperature=0, response_format={"type": "json_object"})
    assert a.finish_reason == "stop" and isinstance(json.loads(a.text), dict)
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
    b = llm.chat(msgs, max_tokens=30, temperature=0,
                 response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}})
    assert json.loads(b.text)["answer"] in ("yes", "no")
    # streamed: the same text in pieces
    s = llm.chat(msgs, max_tokens=30, temperature=0, stream=True,
                 response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert "".join(s) == b.text and s.completion.text == b.text


def test_grammar_and_the_text_stream_agree(llm):
    g = 'root ::= " " ("yes" | "no") "."'
    out = llm.generate("Is water wet? Answer:", max_tokens=10, temperature=0, grammar=g)
    assert out.text in (" yes.", " no.") and out.finish_reason == "stop"
    # the grammar ends the text without the model's end token: no token after the grammar's last
    assert out.completion_tokens == len(out.tokens)


def test_constrained_greedy_text_is_the_same_alone_and_in_a_batch():
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "rank": {"type": "integer", "minimum": 1, "maximum": 99}},
              "required": ["city", "rank"]}
    prompts = ["A city as JSON:", "Another city, JSON:", "Once upon a time", "JSON please:"]
    kinds = [{"json_schema": schema}, {"json_schema": schema}, {}, {"response_format": {"type": "json_object"}}]
    path = str(get_model("smollm2-135m"))
    with stowlm.LLM(path, n_ctx=4 * 512, n_seq=4, progress=False) as batched:
        alone = [batched.generate(p, max_tokens=40, temperature=0, **k).text for p, k in zip(prompts, kinds)]
        runs = [batched.generate(p, max_tokens=40, temperature=0, stream=True, **k) for p, k in zip(prompts, kinds)]
        together = ["".join(r) for r in runs]
    assert together == alone
    for t, k in zip(alone, kinds):
        if "json_schema" in k:
            jsonschema.validate(json.loads(t), schema)


@pytest.mark.parametrize("kwargs,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "stict": True}}},
     "response_format.json_schema"),
    ({"response_format": "json"}, "response_format"),
    ({"json_schema": {"type": "object", "properties": {"a": {"type": "integer", "minimum": "zero"}}}}, "json_schema"),
    ({"grammar": 'root ::= "a" | undefined_rule'}, "grammar"),
    ({"grammar": ""}, "grammar"),
    ({"grammar": 'root ::= "a"', "json_schema": {}}, "json_schema"),
])
def test_bad_grammars_are_refused_naming_the_field(llm, kwargs, param):
    with pytest.raises(gm.FieldError) as e:
        llm.generate("x", max_tokens=2, **kwargs)
    assert e.value.param == param, str(e.value)
    assert llm.generate("x", max_tokens=2, temperature=0).completion_tokens >= 1  # still serves


def test_without_llguidance_the_error_names_the_extra(llm, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(gm.StructuredUnavailable) as e:
        llm.generate("x", max_tokens=2, json_schema={"type": "object", "properties": {"q": {"type": "string"}}})
    assert gm.EXTRA in str(e.value)
    from stowlm.serve.protocol import APIError, parse_chat

    with pytest.raises(APIError) as e:
        parse_chat({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object",
                                                                                         "schema": {"type": "array"}}},
                   llm)
    assert e.value.status == 400 and e.value.code == "structured_output_unavailable" and "stowlm[structured]" in \
        e.value.message
