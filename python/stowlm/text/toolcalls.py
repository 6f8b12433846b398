"""Tool calls: how a model's chat template asks for them and the grammar that forces one (the
parser that finds them in the generated text is stowlm.text.toolparser).

The format is recognised from the template's source:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen 2.5/3, Hermes);
- ``llama3``: a bare JSON object ``{"name": ..., "parameters": {...}}`` (Llama 3.1-3.3);
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]``, or in newer templates
  ``[TOOL_CALLS]name[ARGS]{...}`` (``mistral-args``);
- ``harmony``: gpt-oss's ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}``;
- ``generic``: a template that knows no tools. As llama-server does, the tools and a JSON answer
  format are described in a system message, and the answer is always JSON, forced by the grammar:
  ``{"tool_call": {"name", "arguments"}}`` (``"tool_calls": [...]`` with parallel calls) or
  ``{"response": "..."}``. The server names the format in its ``X-Stowlm-Tool-Format`` header.

``tool_choice`` "required" and a named function are forced by a grammar in every format; "auto"
lets the model choose (the generic format still forces its JSON); "none" renders no tools.
"""
from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Sequence

from .grammar import JSON_OPTIONS, FieldError, check_schema, tightened
from .toolparser import ToolParser

__all__ = ["FORMATS", "detect_format", "ToolRequest", "parse_tool_request", "template_messages"]

FORMATS = ("hermes", "llama3", "mistral", "mistral-args", "harmony", "generic")
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def detect_format(template_source: Optional[str]) -> str:
    src = template_source or ""
    if "<tool_call>" in src:
        return "hermes"
    if "[TOOL_CALLS]" in src:
        return "mistral-args" if "[ARGS]" in src else "mistral"
    if "<|channel|>" in src and "to=functions" in src:
        return "harmony"
    if "<|start_header_id|>" in src and "tools" in src:
        return "llama3"
    return "generic"


# -- the request's tools ------------------------------------------------------------------------------

@dataclass
class Tool:
    name: str
    description: str
    parameters: dict
    raw: dict  # as the client sent it, for the template


def _check_tools(tools: Any) -> List[Tool]:
    if not isinstance(tools, list):
        raise FieldError("must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    out, seen = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, Mapping) or t.get("type") != "function" or not isinstance(t.get("function"), Mapping):
            raise FieldError("must be {\"type\": \"function\", \"function\": {\"name\", \"parameters\"}}", where)
        bad = set(t) - {"type", "function"}
        if bad:
            raise FieldError(f"unknown field {sorted(bad)[0]!r}", where)
        f = t["function"]
        bad = set(f) - {"name", "description", "parameters", "strict"}
        if bad:
            raise FieldError(f"unknown field {sorted(bad)[0]!r}", f"{where}.function")
        name = f.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise FieldError("must be 1-64 letters, digits, '_', '-' or '.'", f"{where}.function.name")
        if name in seen:
            raise FieldError(f"the function {name!r} is defined twice", f"{where}.function.name")
        seen.add(name)
        desc = f.get("description", "")
        if not isinstance(desc, str):
            raise FieldError("must be a string", f"{where}.function.description")
        params = f.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, Mapping):
            raise FieldError("must be a JSON schema object", f"{where}.function.parameters")
        check_schema(dict(params), f"{where}.function.parameters")
        strict = f.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise FieldError("must be true or false", f"{where}.function.strict")
        out.append(Tool(name, desc, tightened(params), {"type": "function", "function": dict(f)}))
    return out


def _check_choice(choice: Any, tools: List[Tool]) -> str:
    """'auto' | 'none' | 'required' | a function's name."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise FieldError(f"must be 'auto', 'none', 'required' or {{\"type\": \"function\", ...}}, got {choice!r}",
                             "tool_choice")
        if choice == "required" and not tools:
            raise FieldError("'required' needs 'tools'", "tool_choice")
        return choice
    if isinstance(choice, Mapping) and choice.get("type") == "function" and isinstance(choice.get("function"), Mapping):
        name = choice["function"].get("name")
        if not any(t.name == name for t in tools):
            raise FieldError(f"names the function {name!r}, which 'tools' does not define", "tool_choice")
        return name
    raise FieldError("must be 'auto', 'none', 'required' or {\"type\": \"function\", \"function\": {\"name\"}}",
                     "tool_choice")


def parse_tool_request(tools: Any, tool_choice: Any, parallel: Any, template_source: Optional[str]) \
        -> Optional["ToolRequest"]:
    """The request's tools, or None where it has none (or tool_choice 'none')."""
    if tools is None:
        if tool_choice not in (None, "none", "auto"):
            raise FieldError("needs 'tools'", "tool_choice")
        if parallel is not None and not isinstance(parallel, bool):
            raise FieldError("must be true or false", "parallel_tool_calls")
        return _channels_only(template_source)
    checked = _check_tools(tools)
    choice = _check_choice(tool_choice, checked)
    if parallel is not None and not isinstance(parallel, bool):
        raise FieldError("must be true or false", "parallel_tool_calls")
    if choice == "none" or not checked:
        return _channels_only(template_source)
    # One call per turn unless asked for more, as llama-server does: small models asked for a
    # list of calls tend to repeat the first.
    return ToolRequest(detect_format(template_source), checked, choice, parallel is True)


def _channels_only(template_source: Optional[str]) -> Optional["ToolRequest"]:
    """A harmony (gpt-oss) answer has channels even without tools: its parser still separates the
    final answer from the reasoning. Other formats need nothing without tools."""
    fmt = detect_format(template_source)
    return ToolRequest(fmt, [], "auto", False) if fmt == "harmony" else None


class ToolRequest:
    """The tools of one request in one template's format: the prompt, the grammar, the parser."""

    def __init__(self, fmt: str, tools: List[Tool], choice: str, parallel: bool):
        self.format, self.tools, self.choice, self.parallel = fmt, tools, choice, parallel

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    @property
    def needs_special(self) -> bool:
        """The format's markers are control tokens, which the text must keep for the parser."""
        return self.format in ("mistral", "mistral-args", "harmony", "llama3")

    def _chosen(self) -> List[Tool]:
        return [t for t in self.tools if t.name == self.choice] if self.forced and self.choice != "required" \
            else self.tools

    # -- the prompt ---------------------------------------------------------------------------------
    def template_tools(self) -> Optional[list]:
        """What the template's `tools` variable gets (the generic format describes them itself)."""
        return None if self.format == "generic" or not self.tools else [t.raw for t in self.tools]

    def prompt_messages(self, messages: List[dict]) -> List[dict]:
        if self.format != "generic" or not self.tools:
            return messages
        note = ("You can call these tools:\n" + "\n".join(json.dumps(t.raw["function"], ensure_ascii=False)
                                                        for t in self.tools) +
                "\n\nAnswer with one JSON object: " +
                ('{"tool_calls": [{"name": <tool name>, "arguments": {<its arguments>}}, ...]}'
                 if self.parallel else '{"tool_call": {"name": <tool name>, "arguments": {<its arguments>}}}') +
                " to call " + ("tools" if self.parallel else "a tool") +
                ("" if self.forced else ', or {"response": <your answer as a string>} to answer directly') + ".")
        out = [dict(m) for m in messages]
        if out and out[0]["role"] == "system":
            out[0]["content"] = (out[0].get("content") or "") + "\n\n" + note
        else:
            out.insert(0, {"role": "system", "content": note})
        return out

    # -- the grammar ------------------------------------------------------------------------------------
    def grammar(self, tokenizer) -> Optional[str]:
        """llguidance grammar text: forced calls, or (generic format) the JSON answer; None: free text."""
        from . import grammar as gm

        if not self.forced and self.format != "generic":
            return None
        tools = self._chosen()
        many = self.parallel and self.choice == "required"
        if self.format == "generic":
            call = {"anyOf": [_call_schema(t, "arguments") for t in tools]}
            calls = ({"type": "object", "properties": {"tool_calls": {"type": "array", "items": call, "minItems": 1}},
                      "required": ["tool_calls"], "additionalProperties": False} if self.parallel else
                     {"type": "object", "properties": {"tool_call": call}, "required": ["tool_call"],
                      "additionalProperties": False})
            if not self.forced:
                answer = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                          "additionalProperties": False}
                calls = {"anyOf": [calls, answer]}
            return gm.json_schema(calls, param="tools")
        sp = _Specials(tokenizer)
        if self.format == "hermes":
            call = {"anyOf": [_call_schema(t, "arguments") for t in tools]}
            more = ' ("\\n" call)*' if many else ""
            lark = f'start: call{more}\ncall: "<tool_call>\\n" {_json(call)} "\\n</tool_call>"\n'
        elif self.format == "llama3":
            lark = "start: " + _json({"anyOf": [_call_schema(t, "parameters") for t in tools]}) + "\n"
        elif self.format == "mistral":
            arr = {"type": "array", "items": {"anyOf": [_call_schema(t, "arguments") for t in tools]}, "minItems": 1}
            if not many:
                arr["maxItems"] = 1
            lark = f"start: {sp.ref('[TOOL_CALLS]')} {_json(arr)}\n"
        elif self.format == "mistral-args":
            alts = " | ".join(f"{sp.ref('[TOOL_CALLS]')} {json.dumps(t.name)} {sp.ref('[ARGS]')} {_json(t.parameters)}"
                              for t in tools)
            lark = f"start: call{'+' if many else ''}\ncall: {alts}\n"
        elif self.format == "harmony":
            alts = " | ".join(f"{json.dumps(t.name)} \" \" {sp.ref('<|constrain|>')} \"json\" {sp.ref('<|message|>')} "
                              f"{_json(t.parameters)}" for t in tools)
            lark = f"start: {sp.ref('<|channel|>')} \"commentary to=functions.\" call\ncall: {alts}\n"
        else:
            raise AssertionError(self.format)
        return gm.lark(lark, param="tools")

    def parser(self) -> "ToolParser":
        return ToolParser(self.format, {t.name for t in self.tools}, self.parallel)


def _call_schema(t: Tool, key: str) -> dict:
    return {"type": "object", "properties": {"name": {"const": t.name}, key: t.parameters},
            "required": ["name", key], "additionalProperties": False}


def _json(schema: dict) -> str:
    """A JSON-schema rule inside a Lark grammar, written as our other JSON is."""
    return "%json " + json.dumps(dict(schema, **{"x-guidance": dict(JSON_OPTIONS)}))


class _Specials:
    """Lark references to control tokens (`<[id]>`), or their text where the vocabulary has no such token."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def ref(self, text: str) -> str:
        i = self.tok.token_to_id(text) if self.tok is not None else None
        if i is not None and self.tok.is_special(i):
            return f"<[{i}]>"
        return json.dumps(text)


# -- messages for the template ----------------------------------------------------------------------------

def template_messages(messages: Sequence[Mapping], fmt: str) -> List[dict]:
    """OpenAI messages as chat templates expect them: tool call arguments as objects (templates
    write them with tojson), no None content; for the generic format, calls and tool results as
    the JSON text the model was asked for (its template knows no tool roles)."""
    out = []
    for m in messages:
        if not isinstance(m, Mapping):
            out.append(m)  # the template's own check names it
            continue
        m = dict(m)
        if m.get("content") is None:
            m["content"] = ""
        calls = m.get("tool_calls")
        if calls:
            m["tool_calls"] = [_template_call(c) for c in calls]
        if fmt == "generic":
            if calls:
                items = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                         for c in m["tool_calls"]]
                m = {"role": "assistant", "content": json.dumps({"tool_calls": items} if len(items) > 1 else
                                                                {"tool_call": items[0]}, ensure_ascii=False)}
            elif m["role"] == "tool":
                m = {"role": "user", "content": json.dumps({"tool_response": {
                    k: v for k, v in (("tool_call_id", m.get("tool_call_id")), ("name", m.get("name")),
                                      ("content", m["content"])) if v is not None}}, ensure_ascii=False)}
        out.append(m)
    return out


def _template_call(c: Mapping) -> dict:
    c = copy.deepcopy(dict(c))
    f = c.get("function")
    if isinstance(f, dict) and isinstance(f.get("arguments"), str):
        try:
            args = json.loads(f["arguments"])
            if isinstance(args, dict):
                f["arguments"] = args
        except ValueError:
            pass  # the template gets the string as it was
    return c
