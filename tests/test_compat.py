"""LLM.create_completion / create_chat_completion: llama-cpp-python's calls and dict shapes, the
text the same as LLM.generate/chat gives for the same request (the oracle), streamed chunks adding
up to the whole answer, and bad arguments refused as ValueError naming the field."""
import json

import pytest

import stowlm

from conftest import get_model

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")


@pytest.fixture(scope="module")
def llm():
    with stowlm.LLM(str(get_model("smollm2-135m")), n_ctx=2048, progress=False) as m:
        yield m


def test_completion_dicts_match_generate(llm):
    want = llm.generate("The capital of France is", max_tokens=12, temperature=0)
    # llama-cpp-python's defaults and arguments, as its users pass them
    r = llm.create_completion("The capital of France is", max_tokens=12, temperature=0.0, top_p=0.95, top_k=40,
                              min_p=0.05, typical_p=1.0, stop=[], repeat_penalty=1.0, mirostat_mode=0,
                              mirostat_tau=5.0, mirostat_eta=0.1, tfs_z=1.0, seed=None, logprobs=None, echo=False)
    assert r["object"] == "text_completion" and r["id"].startswith("cmpl-")
    assert r["choices"][0]["text"] == want.text and r["choices"][0]["finish_reason"] == "length"
    assert r["usage"] == {"prompt_tokens": want.prompt_tokens, "completion_tokens": 12,
                          "total_tokens": want.prompt_tokens + 12, "prompt_tokens_details": {"cached_tokens": 0}}
    assert llm("The capital of France is", max_tokens=12, temperature=0)["choices"][0]["text"] == want.text
    chunks = list(llm.create_completion("The capital of France is", max_tokens=12, temperature=0, stream=True))
    assert "".join(c["choices"][0]["text"] for c in chunks) == want.text
    lp = llm.create_completion("The capital of France is", max_tokens=3, temperature=0, logprobs=2)
    assert len(lp["choices"][0]["logprobs"]["top_logprobs"][0]) == 2


def test_chat_dicts_match_chat(llm):
    msgs = [{"role": "user", "content": "Name a colour."}]
    want = llm.chat(msgs, max_tokens=16, temperature=0)
    r = llm.create_chat_completion(msgs, max_tokens=16, temperature=0)
    assert r["object"] == "chat.completion"
    assert r["choices"][0]["message"] == {"role": "assistant", "content": want.text}
    chunks = list(llm.create_chat_completion(msgs, max_tokens=16, temperature=0, stream=True))
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == want.text
    assert chunks[-1]["choices"][0]["finish_reason"] == want.finish_reason


def test_chat_with_a_schema_and_with_tools(llm):
    msgs = [{"role": "user", "content": "A city and its population, as JSON."}]
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer"}}, "required": ["city", "population"]}
    r = llm.create_chat_completion(msgs, max_tokens=60, temperature=0,
                                   response_format={"type": "json_object", "schema": schema})
    jsonschema.validate(json.loads(r["choices"][0]["message"]["content"]), schema)
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}]
    r = llm.create_chat_completion(msgs, tools=tools, tool_choice="required", max_tokens=60, temperature=0)
    call = r["choices"][0]["message"]["tool_calls"][0]
    assert r["choices"][0]["finish_reason"] == "tool_calls" and call["function"]["name"] == "lookup"
    assert "city" in json.loads(call["function"]["arguments"])


def test_echo_puts_the_prompt_before_the_completion(llm):
    """llama-cpp-python's own first example: llm(prompt, ..., echo=True)."""
    prompt = "Q: Name the planets in the solar system? A: "
    want = llm.generate(prompt, max_tokens=16, temperature=0, stop=["Q:", "\n"]).text
    r = llm(prompt, max_tokens=16, stop=["Q:", "\n"], echo=True, temperature=0)
    assert r["choices"][0]["text"] == prompt + want
    assert r["usage"]["prompt_tokens"] == len(llm.tokenize(prompt))
    chunks = list(llm(prompt, max_tokens=16, stop=["Q:", "\n"], echo=True, temperature=0, stream=True))
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == prompt + want
    ids = llm.tokenize("Once upon a time")
    r = llm.create_completion(ids, max_tokens=4, temperature=0, echo=True)
    assert r["choices"][0]["text"].startswith(llm.detokenize(ids))


@pytest.mark.parametrize("kwargs,param", [({"tfs_z": 0.5}, "tfs_z"), ({"typical_p": 1.5}, "typical_p"),
                                          ({"temperature": -1}, "temperature"), ({"suffix": "x"}, "suffix"),
                                          ({"echo": True, "logprobs": 2}, "echo")])
def test_bad_arguments_are_value_errors_naming_the_field(llm, kwargs, param):
    with pytest.raises(ValueError) as e:
        llm.create_completion("Hi", max_tokens=2, **kwargs)
    assert e.value.param == param and param in str(e.value)
    with pytest.raises(ValueError, match="logits_processor"):
        llm.create_completion("Hi", logits_processor=[lambda ids, x: x])


def test_suffix_fills_in_the_middle():
    """OpenAI's and llama-cpp-python's suffix: PRE prompt SUF suffix MID around the model's FIM
    tokens, the same text as generating from those tokens spelled out by their vocabulary text."""
    with stowlm.LLM(str(get_model("qwen2.5-coder-0.5b")), n_ctx=1024, progress=False) as coder:
        prefix, suffix = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"
        r = coder.create_completion(prefix, suffix=suffix, max_tokens=8, temperature=0)
        tid = coder.tokenizer.token_to_id
        ids = [tid("<|fim_prefix|>")] + coder.tokenize(prefix, add_special=False) + [tid("<|fim_suffix|>")] + \
            coder.tokenize(suffix, add_special=False) + [tid("<|fim_middle|>")]
        assert r["choices"][0]["text"] == coder.generate(ids, max_tokens=8, temperature=0).text
        assert r["choices"][0]["text"].lstrip().startswith("return a + b")
        assert r["usage"]["prompt_tokens"] == len(ids)
        with pytest.raises(ValueError, match="echo"):
            coder.create_completion(prefix, suffix=suffix, echo=True)
        with pytest.raises(ValueError, match="as text"):
            coder.create_completion(coder.tokenize(prefix), suffix=suffix)


def test_mirostat_and_typical_p_reach_the_sampler(llm):
    """llama-cpp-python's mirostat_mode / mirostat_tau / mirostat_eta and typical_p are honoured, not
    dropped: the text of generate() with the same sampler settings and seed, not the text without."""
    kw = dict(max_tokens=12, temperature=1.0, seed=3)
    plain = llm.generate("Once upon a time", **kw).text
    for extra, same in ((dict(mirostat_mode=2, mirostat_tau=1.0, mirostat_eta=0.3),
                         dict(mirostat=2, mirostat_tau=1.0, mirostat_eta=0.3)),
                        (dict(mirostat_mode=1, mirostat_tau=1.0), dict(mirostat=1, mirostat_tau=1.0)),
                        (dict(typical_p=0.2), dict(typical_p=0.2))):
        text = llm.create_completion("Once upon a time", **kw, **extra)["choices"][0]["text"]
        assert text == llm.generate("Once upon a time", **kw, **same).text and text != plain, extra
