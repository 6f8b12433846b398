"""Chat prompts: render a model's ``tokenizer.chat_template`` (Jinja) the way Hugging Face does.

Templates run in Jinja's immutable sandbox with the variables HF templates expect: ``messages``,
``add_generation_prompt``, ``bos_token``, ``eos_token``, ``tools`` and the helpers
``raise_exception`` and ``strftime_now``. Models without a template (gemma3-270m is a base model)
can use a built-in one by name: ``"chatml"`` or ``"gemma"``.
"""
from __future__ import annotations

import datetime
import json
from typing import Any, Iterable, List, Mapping, Optional, Sequence

__all__ = ["BUILTIN_TEMPLATES", "ChatTemplate", "render_chat"]

# Written for stowlm: the two prompt formats of the models we ship in the registry.
BUILTIN_TEMPLATES = {
    # <|im_start|>role\ncontent<|im_end|>\n ... (SmolLM2, Qwen2.5 and many others)
    "chatml": (
        "{%- for message in messages -%}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
    ),
    # Gemma: no system role (a system message is put in front of the first user turn), the
    # assistant is called "model", turns must alternate starting with the user.
    "gemma": (
        "{{- bos_token -}}"
        "{%- set sys = '' -%}"
        "{%- set turns = messages -%}"
        "{%- if messages and messages[0]['role'] == 'system' -%}"
        "{%- set sys = messages[0]['content'] + '\n\n' -%}"
        "{%- set turns = messages[1:] -%}"
        "{%- endif -%}"
        "{%- for message in turns -%}"
        "{%- set expect_user = loop.index0 % 2 == 0 -%}"
        "{%- if (message['role'] == 'user') != expect_user -%}"
        "{{- raise_exception('gemma chat: roles must alternate user, assistant, user, ...') -}}"
        "{%- endif -%}"
        "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
        "{{- '<start_of_turn>' + role + '\n' -}}"
        "{%- if loop.first -%}{{- sys -}}{%- endif -%}"
        "{{- message['content'] | trim -}}"
        "{{- '<end_of_turn>\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"
    ),
}


class _TemplateRaised(Exception):
    pass


def _raise_exception(message: str):
    raise _TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # HF's tojson: plain json.dumps, no HTML escaping (Jinja's own filter escapes < > & ')
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _environment():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def check_messages(messages) -> List[dict]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Iterable):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}] has no 'role' string")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError(f"messages[{i}]['content'] must be a string (or a list of parts), "
                             f"got {type(content).__name__}")
        out.append(dict(m))
    return out


class ChatTemplate:
    """A compiled chat template with the model's BOS/EOS token texts."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", name: str = ""):
        from jinja2 import TemplateError

        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.name = name
        try:
            self._template = _environment().from_string(source)
        except TemplateError as e:
            raise ValueError(f"{name or 'chat template'}: cannot compile the chat template: {e}") from None

    @classmethod
    def from_metadata(cls, meta: Mapping, tokenizer=None, name: str = "",
                      template: Optional[str] = None) -> "ChatTemplate":
        """The model's template (``tokenizer.chat_template``), or ``template``: a built-in name
        (see BUILTIN_TEMPLATES) or Jinja source. Raises ValueError when there is none."""
        source = None
        if template is not None:
            source = BUILTIN_TEMPLATES.get(template, template)
        else:
            source = meta.get("tokenizer.chat_template")
        if not source:
            raise ValueError(
                f"{name or 'this model'} has no chat template (no tokenizer.chat_template in its GGUF "
                f"metadata); use plain completion, or pass a template: one of "
                f"{', '.join(sorted(BUILTIN_TEMPLATES))} or Jinja source")
        bos = eos = ""
        if tokenizer is not None:
            if tokenizer.bos_id is not None:
                bos = tokenizer.id_to_token(tokenizer.bos_id)
            if tokenizer.eos_id is not None:
                eos = tokenizer.id_to_token(tokenizer.eos_id)
        return cls(source, bos, eos, name)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Optional[list] = None, **kwargs) -> str:
        from jinja2 import TemplateError

        msgs = check_messages(messages)
        try:
            return self._template.render(messages=msgs, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token,
                                         tools=tools, **kwargs)
        except _TemplateRaised as e:
            raise ValueError(f"{self.name or 'chat template'}: {e}") from None
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            # e.g. a template concatenating a None content: report it as bad input, naming the template
            raise ValueError(f"{self.name or 'chat template'}: rendering failed: "
                             f"{type(e).__name__}: {e}") from None

    def encode(self, tokenizer, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Optional[list] = None, **kwargs) -> List[int]:
        """Render and tokenize, special tokens parsed. A BOS the template writes itself is not
        added a second time."""
        text = self.render(messages, add_generation_prompt, tools, **kwargs)
        if tokenizer.add_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        return tokenizer.encode(text, add_special=True, parse_special=True)


def render_chat(template: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "", tools: Optional[list] = None, **kwargs) -> str:
    """One-shot render of Jinja ``template`` source (or a built-in template name)."""
    source = BUILTIN_TEMPLATES.get(template, template)
    return ChatTemplate(source, bos_token, eos_token).render(messages, add_generation_prompt, tools, **kwargs)
