"""Chat templates: the models' own Jinja templates, rendered in the sandbox, against the prompt
format of each family; tokenization of a rendered chat against llama.cpp's ids."""
import pytest

from _meta import read_metadata
from conftest import get_model, load_fixture
from stowlm.text.chat import BUILTIN_TEMPLATES, ChatTemplate, render_chat
from stowlm.text.tokenizer import Tokenizer

MSGS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is 2+2?"},
]


def load(name):
    meta = read_metadata(str(get_model(name)))
    return meta, Tokenizer.from_metadata(meta, name)


def chatml(messages, gen=True):
    s = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return s + ("<|im_start|>assistant\n" if gen else "")


def test_smollm2_template_is_chatml_with_default_system():
    meta, tok = load("smollm2-135m")
    ct = ChatTemplate.from_metadata(meta, tok, "smollm2-135m")
    assert ct.render(MSGS) == chatml(MSGS)
    assert ct.render(MSGS, add_generation_prompt=False) == chatml(MSGS, gen=False)
    # without a system message the template supplies its own
    default_sys = {"role": "system",
                   "content": "You are a helpful AI assistant named SmolLM, trained by Hugging Face"}
    assert ct.render(MSGS[1:]) == chatml([default_sys] + MSGS[1:])


def test_qwen_template_is_chatml_and_renders_tools():
    meta, tok = load("qwen2.5-coder-0.5b")
    ct = ChatTemplate.from_metadata(meta, tok, "qwen2.5-coder-0.5b")
    assert ct.render(MSGS) == chatml(MSGS)
    default_sys = {"role": "system",
                   "content": "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."}
    assert ct.render(MSGS[1:]) == chatml([default_sys] + MSGS[1:])
    tool = {"type": "function", "function": {"name": "add", "description": "a<b & c>d",
                                             "parameters": {"type": "object"}}}
    text = ct.render(MSGS[1:2], tools=[tool])
    assert text.startswith("<|im_start|>system\nYou are Qwen")
    # tojson is plain JSON (no HTML escaping of < > &), as in transformers
    assert '{"type": "function", "function": {"name": "add", "description": "a<b & c>d"' in text
    assert text.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")


def test_gemma_has_no_template_and_builtin_renders_gemma_format():
    meta, tok = load("gemma3-270m")
    assert "tokenizer.chat_template" not in meta
    with pytest.raises(ValueError, match="gemma3-270m has no chat template"):
        ChatTemplate.from_metadata(meta, tok, "gemma3-270m")
    ct = ChatTemplate.from_metadata(meta, tok, "gemma3-270m", template="gemma")
    assert ct.render(MSGS) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n"
        "<start_of_turn>model\n")
    with pytest.raises(ValueError, match="alternate"):
        ct.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_rendered_chat_tokenizes_like_llama_cpp():
    # llama.cpp's ids for a chat turn (fixture), found inside the tokenized rendered chat
    for name, text in [("smollm2-135m", "<|im_start|>user\nHi there<|im_end|>"),
                       ("qwen2.5-coder-0.5b", "<|im_start|>user\nHi there<|im_end|>"),
                       ("gemma3-270m", "<start_of_turn>user\nHi<end_of_turn>")]:
        meta, tok = load(name)
        ref = next(r["ids"] for r in load_fixture(name)
                   if r["kind"] == "tok" and r["text"] == text and not r["add_special"])
        template = "gemma" if name.startswith("gemma") else None
        ct = ChatTemplate.from_metadata(meta, tok, name, template=template)
        msgs = [{"role": "user", "content": "Hi there" if "there" in text else "Hi"}]
        ids = ct.encode(tok, msgs)
        assert any(ids[k:k + len(ref)] == ref for k in range(len(ids))), (name, ids, ref)
        # one BOS at most, even though the gemma template writes <bos> itself
        if tok.bos_id is not None and tok.add_bos:
            assert ids.count(tok.bos_id) == 1 and ids[0] == tok.bos_id
        assert ids[-1] != tok.eos_id
        assert tok.decode(ids) == ct.render(msgs)


def test_sandbox_helpers_and_errors():
    assert render_chat("{{ raise_exception is defined and strftime_now('%Y') | length }}", []) == "4"
    with pytest.raises(ValueError, match="boom"):
        render_chat("{{ raise_exception('boom') }}", [])
    # the sandbox refuses attribute access to Python internals
    with pytest.raises(ValueError, match="rendering failed"):
        render_chat("{{ messages.__class__.__mro__[1].__subclasses__() }}", [])
    with pytest.raises(ValueError, match="immutable|rendering failed"):
        render_chat("{% set _ = messages.append(1) %}", [])
    with pytest.raises(ValueError, match="rendering failed"):  # None content in a str concatenation
        render_chat("{{ messages[0]['content'] + 'x' }}", [{"role": "user", "content": None}])
    with pytest.raises(ValueError, match="compile"):
        ChatTemplate("{% for %}")
    with pytest.raises(ValueError, match="role"):
        render_chat("chatml", [{"content": "x"}])
    with pytest.raises(ValueError, match="content"):
        render_chat("chatml", [{"role": "user", "content": 3}])
    assert render_chat("chatml", [{"role": "user", "content": "x"}]) == chatml([{"role": "user", "content": "x"}])
    assert set(BUILTIN_TEMPLATES) == {"chatml", "gemma"}
