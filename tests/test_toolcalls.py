"""Tool calls (stowlm.toolcalls): each format's parser on the text its templates write (whole and
streamed in every split), each format's forcing grammar accepting exactly its calls (tokens fed
to the grammar, the call read back by the parser), messages rendered through a real template, and
calls from a real model whose arguments validate against the function's parameters."""
import json

import numpy as np
import pytest

llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

import stowlm  # noqa: E402
from stowlm.text import grammar as gm  # noqa: E402
from stowlm.gguffile import GGUFFile  # noqa: E402
from stowlm.text.tokenizer import TokenType, Tokenizer  # noqa: E402
from stowlm.text.toolcalls import ToolParser, detect_format, parse_tool_request, template_messages  # noqa: E402

from conftest import get_model  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "a + b",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                                    "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
                   "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
NAMES = {"get_weather", "add"}
W = '{"city": "Paris", "unit": "c"}'
A = '{"a": 2, "b": 3}'

# (format, generated text, content, calls [(name, arguments)])
CASES = [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": ' + W + '}\n</tool_call>',
     "Let me look.", [("get_weather", W)]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": ' + W + '}\n</tool_call>\n<tool_call>\n'
     '{"name": "add", "arguments": ' + A + '}\n</tool_call>', "", [("get_weather", W), ("add", A)]),
    ("hermes", '```json\n{"name": "add", "arguments": ' + A + '}\n```', "", [("add", A)]),
    ("hermes", "No tools needed: 2 + 3 = 5.", "No tools needed: 2 + 3 = 5.", []),
    ("hermes", '{"answer": 5} is not a call', '{"answer": 5} is not a call', []),
    ("hermes", '<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>', []),
    ("llama3", '{"name": "get_weather", "parameters": ' + W + '}', "", [("get_weather", W)]),
    ("llama3", '<|python_tag|>{"name": "add", "parameters": ' + A + '}', "", [("add", A)]),
    ("llama3", "The answer is 5.", "The answer is 5.", []),
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "add", "arguments": ' + A + '}, {"name": "get_weather", "arguments": '
     + W + '}]', "Sure.", [("add", A), ("get_weather", W)]),
    ("mistral-args", '[TOOL_CALLS]get_weather[ARGS]' + W + '[TOOL_CALLS]add[ARGS]' + A, "",
     [("get_weather", W), ("add", A)]),
    ("harmony", '<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
     'to=functions.get_weather <|constrain|>json<|message|>' + W, "", [("get_weather", W)]),
    ("harmony", '<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 5.',
     "It is 5.", []),
    ("generic", '{"tool_call": {"name": "add", "arguments": ' + A + '}}', "", [("add", A)]),
    ("generic", '{"tool_calls": [{"name": "add", "arguments": ' + A + '}, {"name": "get_weather", "arguments": '
     + W + '}]}', "", [("add", A), ("get_weather", W)]),
    ("generic", '{"response": "Five."}', "Five.", []),
]


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_parsers_whole_and_streamed_in_every_split(fmt, text, content, calls):
    def norm(cs):
        return [(c["name"], json.loads(c["arguments"])) for c in cs]

    want = [(n, json.loads(a)) for n, a in calls]
    got_content, got_calls = ToolParser(fmt, NAMES).parse(text)
    assert got_content == content and norm(got_calls) == want
    for step in (1, 3, 7):  # every split of the text into pieces of this size, and at every position
        for start in range(step):
            p, items = ToolParser(fmt, NAMES), []
            pieces = [text[:start]] + [text[i:i + step] for i in range(start, len(text), step)]
            for piece in pieces:
                items += p.feed(piece)
            items += p.finish()
            assert "".join(x for k, x in items if k == "content") == content
            assert norm([x for k, x in items if k == "call"]) == want


def test_content_streams_before_the_end_and_calls_are_not_leaked():
    p = ToolParser("hermes", NAMES)
    assert p.feed("It is ") == [("content", "It is")]  # a trailing space waits for what follows
    assert p.feed("sunny. <tool") == [("content", " sunny.")]  # "<tool" may start a call: held back
    out = p.feed('_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>') + p.finish()
    assert [k for k, _ in out] == ["call"]


def test_formats_are_recognised_from_the_template():
    with GGUFFile(get_model("qwen2.5-coder-0.5b")) as f:
        assert detect_format(f.metadata["tokenizer.chat_template"]) == "hermes"
    with GGUFFile(get_model("smollm2-135m")) as f:
        assert detect_format(f.metadata["tokenizer.chat_template"]) == "generic"
    assert detect_format("...[TOOL_CALLS]...") == "mistral"
    assert detect_format("...[TOOL_CALLS]{{ name }}[ARGS]...") == "mistral-args"
    assert detect_format("<|start_header_id|>ipython {% if tools %}") == "llama3"
    assert detect_format("<|channel|>commentary to=functions.") == "harmony"
    assert detect_format(None) == "generic"


SPECIALS = ["[TOOL_CALLS]", "[ARGS]", "<|channel|>", "<|constrain|>", "<|message|>", "<|start|>", "<|end|>",
            "<|python_tag|>"]


@pytest.fixture(scope="module")
def tok():
    """smollm2's vocabulary with the formats' markers added as control tokens."""
    with GGUFFile(get_model("smollm2-135m")) as f:
        meta = dict(f.metadata)
    meta["tokenizer.ggml.tokens"] = list(meta["tokenizer.ggml.tokens"]) + SPECIALS
    meta["tokenizer.ggml.token_type"] = list(meta["tokenizer.ggml.token_type"]) + [TokenType.CONTROL] * len(SPECIALS)
    return Tokenizer.from_metadata(meta, cache=False)


FORCED = {  # what each format's grammar must accept for tool_choice "required" (one call)
    "hermes": '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
    "llama3": '{"name": "add", "parameters": {"a": 2, "b": 3}}',
    "mistral": '[TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 3}}]',
    "mistral-args": '[TOOL_CALLS]add[ARGS]{"a": 2, "b": 3}',
    "harmony": '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 2, "b": 3}',
    "generic": '{"tool_call": {"name": "add", "arguments": {"a": 2, "b": 3}}}',
}
TEMPLATES = {"hermes": "<tool_call>", "llama3": "<|start_header_id|> tools", "mistral": "[TOOL_CALLS]",
             "mistral-args": "[TOOL_CALLS][ARGS]", "harmony": "<|channel|> to=functions", "generic": ""}


@pytest.mark.parametrize("fmt", sorted(FORCED))
def test_forcing_grammar_accepts_the_formats_call_and_refuses_others(tok, fmt):
    req = parse_tool_request(TOOLS, "required", None, TEMPLATES[fmt])
    assert req.format == fmt
    g = gm.Grammar(tok, req.grammar(tok))
    ids = tok.encode(FORCED[fmt], add_special=False, parse_special=True)
    c = g.start()
    for t in ids:
        assert c.allowed()[t], (fmt, tok.decode(ids[:ids.index(t) + 1], skip_special=False))
        c.accept(t)
    assert c.accepting
    text = tok.decode(ids, skip_special=False)
    content, calls = req.parser().parse(text)
    assert content == "" and [(x["name"], json.loads(x["arguments"])) for x in calls] == [("add", {"a": 2, "b": 3})]
    # an argument outside the parameters' schema is refused somewhere on the way
    bad = tok.encode(FORCED[fmt].replace('"b": 3', '"b": 3000'), add_special=False, parse_special=True)
    c = g.start()
    assert not all(c.allowed()[t] and (c.accept(t) or True) for t in bad)
    # a named function allows only that one
    named = parse_tool_request(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None, TEMPLATES[fmt])
    c = gm.Grammar(tok, named.grammar(tok)).start()
    assert not all(c.allowed()[t] and (c.accept(t) or True) for t in ids)


@pytest.mark.parametrize("tools,choice,param", [
    ([{"type": "function", "function": {"name": "bad name!"}}], None, "tools[0].function.name"),
    ([{"type": "function"}], None, "tools[0]"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "tools[0].function.parameters"),
    ([WEATHER, WEATHER], None, "tools[1].function.name"),
    ([WEATHER], "sometimes", "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    (None, "required", "tool_choice"),
    ("get_weather", None, "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": {}, "extra": 1}}], None, "tools[0].function"),
])
def test_bad_tools_are_refused_naming_the_field(tools, choice, param):
    with pytest.raises(gm.FieldError) as e:
        parse_tool_request(tools, choice, None, "<tool_call>")
    assert e.value.param == param


def test_messages_round_trip_into_the_templates():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": W}}
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    with stowlm.LLM(str(get_model("qwen2.5-coder-0.5b")), n_ctx=1024, progress=False) as qwen:
        toks, req = qwen.chat_prompt(msgs, tools=TOOLS)
        text = qwen.detokenize(toks)
        assert req.format == "hermes" and '"name": "get_weather"' in text and "<tools>" in text
        assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": ' + W + '}\n</tool_call>' \
            '<|im_end|>' in text
        assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>" in text
    generic = template_messages(msgs, "generic")
    assert json.loads(generic[1]["content"]) == {"tool_call": {"name": "get_weather", "arguments": json.loads(W)}}
    assert generic[2]["role"] == "user" and json.loads(generic[2]["content"])["tool_response"]["content"] == "18 C"


@pytest.mark.parametrize("model", ["qwen2.5-coder-0.5b", "smollm2-135m"])
def test_forced_calls_from_real_models_validate(model):
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    questions = ["What is the weather in Oslo?", "Add 40 and 2.", "Is it raining in Lima?", "What is 7 plus 8?"]
    with stowlm.LLM(str(get_model(model)), n_ctx=2048, progress=False) as llm:
        for q in questions:
            for choice in ("required", {"type": "function", "function": {"name": "add"}}):
                out = llm.chat([{"role": "user", "content": q}], tools=TOOLS, tool_choice=choice, max_tokens=60,
                               temperature=0)
                assert out.finish_reason == "tool_calls" and len(out.tool_calls) == 1, (q, out)
                f = out.tool_calls[0]["function"]
                if isinstance(choice, dict):
                    assert f["name"] == "add"
                jsonschema.validate(json.loads(f["arguments"]), params[f["name"]])
                assert out.tool_calls[0]["id"].startswith("call_") and out.tool_calls[0]["type"] == "function"
        s = llm.chat([{"role": "user", "content": questions[0]}], tools=TOOLS, tool_choice="required", max_tokens=60,
                     temperature=0, stream=True)
        assert "".join(s) == "" and s.completion.finish_reason == "tool_calls"
        whole = llm.chat([{"role": "user", "content": questions[0]}], tools=TOOLS, tool_choice="required",
                         max_tokens=60, temperature=0)
        assert whole.tool_calls[0]["function"] == s.completion.tool_calls[0]["function"]


def test_gpt_oss_answers_are_split_from_their_reasoning(tok):
    """harmony: the turn ends at <|return|> or <|call|>, not at <|end|> (which closes the reasoning,
    after which the answer follows), and even without tools the answer is only the final channel."""
    with GGUFFile(get_model("smollm2-135m")) as f:
        meta = dict(f.metadata)
    extra = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>"]
    meta["tokenizer.ggml.tokens"] = list(meta["tokenizer.ggml.tokens"]) + extra
    meta["tokenizer.ggml.token_type"] = list(meta["tokenizer.ggml.token_type"]) + [TokenType.CONTROL] * len(extra)
    harmony = Tokenizer.from_metadata(meta, cache=False)
    ids = {t: harmony.token_to_id(t) for t in extra}
    assert harmony.is_eog(ids["<|return|>"]) and harmony.is_eog(ids["<|call|>"]) and not harmony.is_eog(ids["<|end|>"])
    assert tok.is_eog(tok.token_to_id("<|end|>"))  # elsewhere <|end|> still ends the turn
    req = parse_tool_request(None, None, None, "<|channel|> to=functions")
    assert req is not None and req.needs_special and req.grammar(harmony) is None and req.template_tools() is None
    text = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hi!"
    p = req.parser()
    items = p.feed(text) + p.finish()
    assert ("reasoning", "Think.") in items and "".join(x for k, x in items if k == "content") == "Hi!"
