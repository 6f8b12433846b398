"""Tool calls in generated text: :class:`ToolParser` finds them as the text streams, in the format
stowlm.text.toolcalls recognised from the chat template; :func:`gather` makes its items OpenAI's."""
from __future__ import annotations

import json
import re
import uuid
from typing import Any, List, Tuple

from .stream import held_prefix

__all__ = ["ToolParser", "gather", "new_call_id"]


def gather(items: List[Tuple[str, Any]], fmt: str) -> Tuple[str, str, List[dict]]:
    """A ToolParser's items as (content, reasoning, calls in OpenAI's shape with fresh ids)."""
    content = "".join(x for k, x in items if k == "content")
    reasoning = "".join(x for k, x in items if k == "reasoning")
    calls = [{"id": new_call_id(fmt), "type": "function", "function": x} for k, x in items if k == "call"]
    return content, reasoning, calls


def new_call_id(fmt: str = "") -> str:
    if fmt.startswith("mistral"):  # Mistral's templates take nine letters and digits only
        return uuid.uuid4().hex[:9]
    return "call_" + uuid.uuid4().hex[:24]


class ToolParser:
    """Generated text in, content and tool calls out. feed(piece) returns what is certain so far:
    ("content", text), ("call", {"name", "arguments"}) items, arguments as a JSON string, and
    ("reasoning", text) where the format separates it (harmony's analysis channel); finish() the
    rest. Text that may still become a call is held back, as stop strings are."""

    def __init__(self, fmt: str, names: set, parallel: bool = True):
        self.format, self.names, self.parallel = fmt, names, parallel
        self.buf = ""
        self.started = False  # content has been given out (a bare JSON call must come first)
        self.calls = 0

    def feed(self, piece: str) -> List[Tuple[str, Any]]:
        self.buf += piece
        f = self.format
        if f == "hermes":
            return self._hermes(final=False)
        if f in ("mistral", "mistral-args"):
            return self._marker("[TOOL_CALLS]", final=False)
        if f == "harmony" or f == "generic":
            return []  # decided at the end
        if f == "llama3":
            return self._llama3(final=False)
        raise AssertionError(f)

    def finish(self) -> List[Tuple[str, Any]]:
        f = self.format
        if f == "hermes":
            return self._hermes(final=True)
        if f in ("mistral", "mistral-args"):
            return self._marker("[TOOL_CALLS]", final=True)
        if f == "harmony":
            return self._harmony()
        if f == "generic":
            return self._generic()
        return self._llama3(final=True)

    def parse(self, text: str) -> Tuple[str, List[dict]]:
        """The whole text at once: (content, calls)."""
        items = self.feed(text) + self.finish()
        content = "".join(x for k, x in items if k == "content")
        return content, [x for k, x in items if k == "call"]

    # -- the formats -------------------------------------------------------------------------------
    def _content(self, text: str) -> List[Tuple[str, Any]]:
        if text:
            self.started = True
            return [("content", text)]
        return []

    def _call(self, name: Any, args: Any) -> List[Tuple[str, Any]]:
        if not isinstance(name, str) or name not in self.names:
            return []
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return []
        if not isinstance(args, dict):
            return []
        if self.calls and not self.parallel:
            return []
        self.calls += 1
        return [("call", {"name": name, "arguments": json.dumps(args, ensure_ascii=False)})]

    def _hermes(self, final: bool) -> List[Tuple[str, Any]]:
        out: List[Tuple[str, Any]] = []
        open_, close = "<tool_call>", "</tool_call>"
        if self._bare_json_ahead():
            if not final:
                return []
            calls = self._bare_calls(self.buf)
            if calls:
                self.buf = ""
                return calls
        while True:
            i = self.buf.find(open_)
            if i < 0:
                keep = 0 if final else _held(self.buf, open_)
                text = self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                if self.calls:
                    text = text.strip() if final else text.lstrip()  # separators between calls
                out += self._content(text)
                return out
            out += self._content(self.buf[:i].rstrip() if self.calls == 0 else self.buf[:i].strip())
            j = self.buf.find(close, i)
            body = self.buf[i + len(open_):j if j >= 0 else len(self.buf)]
            if j < 0 and not final:
                self.buf = self.buf[i:]
                return out
            call = _loads(body.strip())
            got = self._call(call.get("name"), call.get("arguments", call.get("parameters"))) \
                if isinstance(call, dict) else []
            if not got:  # not a call after all: keep it as text
                out += self._content(self.buf[i:j + len(close)] if j >= 0 else self.buf[i:])
            out += got
            self.buf = self.buf[j + len(close):] if j >= 0 else ""

    def _bare_json_ahead(self) -> bool:
        """Nothing given out yet and the text opens like a JSON object or a fenced block: small
        models often write the call without its tags. Held back until the end decides."""
        if self.started or self.calls:
            return False
        s = self.buf.lstrip()
        return s.startswith("{") or s.startswith("```") or (s != "" and "```".startswith(s)) or s == ""

    def _bare_calls(self, text: str) -> List[Tuple[str, Any]]:
        """Calls written as bare JSON ({"name", "arguments"}), alone or in one ```json block."""
        s = text.strip()
        m = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", s, re.S)
        if m:
            s = m.group(1)
        objs = _json_objects(s)
        if not objs or not all(isinstance(o, dict) and o.get("name") in self.names for o in objs):
            return []
        out: List[Tuple[str, Any]] = []
        for o in objs:
            out += self._call(o.get("name"), o.get("arguments", o.get("parameters")))
        return out

    def _marker(self, marker: str, final: bool) -> List[Tuple[str, Any]]:
        i = self.buf.find(marker)
        if i < 0:
            keep = 0 if final else _held(self.buf, marker)
            text, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
            return self._content(text)
        out = self._content(self.buf[:i].rstrip())
        self.buf = self.buf[i:]
        if not final:
            return out
        rest, self.buf = self.buf, ""
        calls: List[Tuple[str, Any]] = []
        if self.format == "mistral":
            arr = _loads(rest[len(marker):].strip())
            for c in arr if isinstance(arr, list) else []:
                if isinstance(c, dict):
                    calls += self._call(c.get("name"), c.get("arguments"))
        else:  # [TOOL_CALLS]name[ARGS]{...} repeated
            for part in rest.split(marker)[1:]:
                name, sep, args = part.partition("[ARGS]")
                if sep:
                    calls += self._call(name.strip(), _loads(args.strip()))
        return out + (calls or self._content(rest))

    def _llama3(self, final: bool) -> List[Tuple[str, Any]]:
        s = self.buf.lstrip()
        looks = not self.started and (s.startswith("{") or s.startswith("<|python_tag|>") or
                                      (not s and not final) or "<|python_tag|>".startswith(s))
        if not looks:
            text, self.buf = self.buf, ""
            return self._content(text)
        if not final:
            return []
        body = s[len("<|python_tag|>"):] if s.startswith("<|python_tag|>") else s
        calls: List[Tuple[str, Any]] = []
        for part in _json_objects(body):
            if isinstance(part, dict):
                calls += self._call(part.get("name"), part.get("parameters", part.get("arguments")))
        text, self.buf = self.buf, ""
        return calls or self._content(text)

    def _harmony(self) -> List[Tuple[str, Any]]:
        text, self.buf = self.buf, ""
        content: List[str] = []
        reasoning: List[str] = []
        calls: List[Tuple[str, Any]] = []
        for msg in re.split(r"<\|start\|>", text):
            header, sep, body = msg.partition("<|message|>")
            if not sep:
                continue
            body = re.split(r"<\|end\|>|<\|return\|>|<\|call\|>", body)[0]
            m = re.search(r"to=functions\.([^\s<]+)", header)
            if m:
                calls += self._call(m.group(1), _loads(body.strip()))
            elif "<|channel|>final" in header:
                content.append(body)
            elif "<|channel|>analysis" in header:
                reasoning.append(body)
        if not calls and not content and not reasoning:
            return self._content(text)  # no channels at all: the text as it is
        return ([("reasoning", "".join(reasoning))] if reasoning else []) + self._content("".join(content)) + calls

    def _generic(self) -> List[Tuple[str, Any]]:
        text, self.buf = self.buf, ""
        obj = _loads(text.strip())
        if isinstance(obj, dict):
            if isinstance(obj.get("response"), str):
                return self._content(obj["response"])
            calls = obj.get("tool_calls") if "tool_calls" in obj else [obj.get("tool_call")]
            out: List[Tuple[str, Any]] = []
            for c in calls if isinstance(calls, list) else []:
                if isinstance(c, dict):
                    out += self._call(c.get("name"), c.get("arguments"))
            if out:
                return out
        return self._content(text)


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _json_objects(text: str) -> List[Any]:
    """JSON values one after the other (separated by whitespace or ';', as Llama 3 writes several
    calls); [] unless the whole text is made of them."""
    dec, out, i = json.JSONDecoder(), [], 0
    while i < len(text):
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i >= len(text):
            break
        try:
            v, i = dec.raw_decode(text, i)
        except ValueError:
            return []
        out.append(v)
    return out


def _held(buf: str, marker: str) -> int:
    """How much of buf's tail to hold back: what may start the marker, and the whitespace before
    it (content before a call is given without its trailing whitespace)."""
    n = held_prefix(buf, (marker,))
    return n + len(buf[:len(buf) - n]) - len(buf[:len(buf) - n].rstrip())
