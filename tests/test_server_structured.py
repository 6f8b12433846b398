"""`stowlm serve` with structured outputs and tools, through the official openai client (no mocks).

Oracles: `jsonschema` for every JSON answer and every call's arguments, pydantic through the
client's own parse(), the server's answers alone against the same requests sent concurrently
and streamed, the in-process tokenizer for /tokenize, and a 400 naming `param` for every field
that cannot be honoured."""
import concurrent.futures as cf
import json

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
pydantic = pytest.importorskip("pydantic")

import stowlm  # noqa: E402

from conftest import get_model, start_server, stop_server  # noqa: E402
from test_structured import random_object_schema  # noqa: E402
from test_toolcalls import TOOLS  # noqa: E402

MODEL = "smollm2-135m"
ASK = [{"role": "user", "content": "Describe a thing as JSON."}]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def server():
    proc, port = start_server(get_model(MODEL), "--parallel", "4", "-c", "4096")
    yield port
    rc = stop_server(proc)
    err = "".join(getattr(proc, "rest_of_stderr", []))
    assert rc == 0 and "Traceback" not in err, err


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def qwen():
    """qwen2.5-coder's template writes Hermes tool calls."""
    proc, port = start_server(get_model("qwen2.5-coder-0.5b"), "--parallel", "2", "-c", "4096")
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
    assert stop_server(proc) == 0


def _schema_format(schema, name="thing"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_random_json_schemas_always_validate_alone_and_concurrently(client):
    schemas = [random_object_schema(100 + i) for i in range(16)]

    def ask(i):
        r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200, temperature=0.8, seed=i,
                                           response_format=_schema_format(schemas[i]))
        return r.choices[0].message.content, r.choices[0].finish_reason

    alone = [ask(i) for i in range(len(schemas))]
    for (text, finish), schema in zip(alone, schemas):
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), schema)
    with cf.ThreadPoolExecutor(6) as ex:
        together = list(ex.map(ask, range(len(schemas))))
    assert together == alone  # the same seeded text among other requests


def test_streamed_and_whole_agree_and_n_choices_all_validate(client):
    schema = random_object_schema(7)
    kw = dict(model=MODEL, messages=ASK, max_tokens=200, temperature=0, response_format=_schema_format(schema))
    whole = client.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(whole), schema)
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200, temperature=0.7, seed=3, n=3,
                                       response_format=_schema_format(schema))
    assert len(r.choices) == 3 and len({c.message.content for c in r.choices}) > 1
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), schema)
    # json_object bounds no string: a prompt whose short object a 135M model ends
    r = client.chat.completions.create(model=MODEL, max_tokens=200, temperature=0, response_format={"type": "json_object"},
                                       messages=[{"role": "user", "content": 'Reply with exactly this JSON object: {"ok": true}'}])
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
    # llama-server's fields on /v1/completions
    c = client.completions.create(model=MODEL, prompt="The answer (yes or no):", max_tokens=5, temperature=0,
                                  extra_body={"grammar": 'root ::= " " ("yes" | "no")'})
    assert c.choices[0].text in (" yes", " no")
    c = client.completions.create(model=MODEL, prompt="A JSON object:", max_tokens=60, temperature=0,
                                  extra_body={"json_schema": {"type": "object", "properties": {
                                      "n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}})
    assert 0 <= json.loads(c.choices[0].text)["n"] <= 9


class Person(pydantic.BaseModel):
    name: str
    age: int
    city: str


def test_the_clients_parse_with_a_pydantic_model(client):
    parse = client.chat.completions.parse if hasattr(client.chat.completions, "parse") else \
        client.beta.chat.completions.parse
    r = parse(model=MODEL, messages=[{"role": "user", "content": "Invent a person."}], response_format=Person,
              max_tokens=80, temperature=0)
    p = r.choices[0].message.parsed
    assert isinstance(p, Person) and p.name


def _calls(r):
    return [(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls]


@pytest.mark.parametrize("which", ["smollm2", "qwen"])
def test_required_and_named_tool_calls_validate(which, client, qwen):
    c, model = (client, MODEL) if which == "smollm2" else (qwen, "qwen2.5-coder-0.5b")
    questions = ["What's the weather in Rome?", "Please add 12 and 30.", "Is it cold in Oslo, in fahrenheit?"]
    for q in questions:
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            raw = c.chat.completions.with_raw_response.create(
                model=model, messages=[{"role": "user", "content": q}],
                tools=TOOLS, tool_choice=choice, max_tokens=80, temperature=0)
            assert raw.headers["x-stowlm-tool-format"] == ("generic" if which == "smollm2" else "hermes")
            r = raw.parse()
            assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
            (name, args), = _calls(r)
            if isinstance(choice, dict):
                assert name == "get_weather"
            jsonschema.validate(args, PARAMS[name])
            assert r.choices[0].message.tool_calls[0].id.startswith("call_")
            # streamed: the deltas assemble into the same call
            chunks = list(c.chat.completions.create(messages=[{"role": "user", "content": q}], tools=TOOLS,
                                                    tool_choice=choice, max_tokens=80, temperature=0, stream=True,
                                                    model=model))
            parts = {}
            for ch in chunks:
                for d in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
                    p = parts.setdefault(d.index, {"name": "", "arguments": ""})
                    p["name"] += d.function.name or ""
                    p["arguments"] += d.function.arguments or ""
            assert [(p["name"], json.loads(p["arguments"])) for p in parts.values()] == [(name, args)]
            assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == \
                ["tool_calls"]


def test_a_tool_conversation_round_trips(qwen):
    q = [{"role": "user", "content": "What's the weather in Rome?"}]
    r = qwen.chat.completions.create(model="qwen2.5-coder-0.5b", messages=q, tools=TOOLS, tool_choice="required",
                                     max_tokens=80, temperature=0)
    msg = r.choices[0].message
    follow = q + [msg.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "21 C and sunny"}]
    r2 = qwen.chat.completions.create(model="qwen2.5-coder-0.5b", messages=follow, tools=TOOLS, tool_choice="none",
                                      max_tokens=40, temperature=0)
    assert r2.choices[0].finish_reason in ("stop", "length") and r2.choices[0].message.content


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"grammar": "root ::= ("}, "grammar"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces allowed"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "maximum": "ten"}}}}}], "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"audio": {"voice": "alloy"}}, "audio"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tfs_z": 0.9}, "tfs_z"),
    ({"xtc_probability": 0.5}, "xtc_probability"),
    ({"mirostat": 3}, "mirostat"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x", "foo": 1}]}, "messages[0].foo"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]}]},
     "messages[0].tool_calls[0]"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
]


def test_what_cannot_be_honoured_is_refused_naming_it_and_the_server_keeps_serving(server, client):
    url = f"http://127.0.0.1:{server}/v1/chat/completions"
    with httpx.Client(timeout=60) as h:
        for extra, param in BAD:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
            r = h.post(url, json=body)
            assert r.status_code == 400, (extra, r.text)
            assert r.json()["error"]["param"] == param, (extra, r.json())
        # neutral values of samplers stowlm lacks, and fields with no effect on a local model, are accepted
        ok = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "typical_p": 1.0, "mirostat": 0,
              "user": "u1", "store": False, "service_tier": "auto", "cache_prompt": True, "top_k": 5, "min_p": 0.1}
        assert h.post(url, json=ok).status_code == 200
        r = h.post(f"http://127.0.0.1:{server}/v1/completions", json={"prompt": "x", "echo": True, "logprobs": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
        r = h.post(url, json={"messages": [{"role": "user", "content": "hi"}], "echo": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "echo"  # a completions field only
    assert client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3).usage.completion_tokens >= 1


def test_llama_server_extensions_are_honoured(server, client):
    h = httpx.Client(timeout=60)
    url = f"http://127.0.0.1:{server}/v1/completions"
    r = h.post(url, json={"prompt": "Hello", "n_predict": 3, "temperature": 0}).json()
    assert r["usage"]["completion_tokens"] == 3
    r = h.post(url, json={"prompt": "Hello", "max_tokens": 40, "temperature": 0, "ignore_eos": True}).json()
    assert r["usage"]["completion_tokens"] == 40 and r["choices"][0]["finish_reason"] == "length"
    r = h.post(url, json={"prompt": "Hello", "max_tokens": 2, "temperature": 0, "n_probs": 3}).json()
    assert len(r["choices"][0]["logprobs"]["top_logprobs"][0]) == 3


def test_tokenize_and_detokenize(server):
    with stowlm.LLM(str(get_model(MODEL)), n_ctx=256, progress=False) as local:
        text = "Hello <|im_start|> world é"
        with httpx.Client(timeout=30) as h:
            r = h.post(f"http://127.0.0.1:{server}/tokenize", json={"content": text}).json()
            assert r["tokens"] == local.tokenizer.encode(text, add_special=False, parse_special=True)
            plain = h.post(f"http://127.0.0.1:{server}/tokenize", json={"content": text, "parse_special": False,
                                                                        "with_pieces": True}).json()["tokens"]
            assert [p["id"] for p in plain] == local.tokenizer.encode(text, add_special=False, parse_special=False)
            assert "".join(p["piece"] if isinstance(p["piece"], str) else bytes(p["piece"]).decode("latin-1")
                           for p in plain).startswith("Hello <|im_start|>")
            back = h.post(f"http://127.0.0.1:{server}/detokenize", json={"tokens": r["tokens"]}).json()
            assert back["content"] == local.detokenize(r["tokens"])
            bad = h.post(f"http://127.0.0.1:{server}/detokenize", json={"tokens": [10 ** 9]})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
            bad = h.post(f"http://127.0.0.1:{server}/tokenize", json={"content": "x", "add_bos": True})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "add_bos"
