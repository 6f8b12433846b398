"""The conversation side of an LLM: chat templates, tools, structured output and llama-cpp-python's
create_* calls, all of them made into a prompt and a generate() call (stowlm.llm)."""
from __future__ import annotations

import json
from typing import List, Mapping, Optional, Sequence

from .generation import ToolCalls
from .text import toolcalls
from .text.chat import check_messages

__all__ = ["Conversation"]


class Conversation:
    """LLM's chat(), its prompt and grammar helpers; the LLM gives generate(), tokenizer, model,
    _template (_template_error where the template did not load) and the grammar cache."""

    def chat(self, messages: Sequence[Mapping[str, str]], stream: bool = False, tools=None, tool_choice=None,
             parallel_tool_calls: Optional[bool] = None, **kwargs):
        """Answer a conversation rendered with the model's chat template (GGUF
        ``tokenizer.chat_template``). Same sampling and structured-output options as generate().

        tools (OpenAI's [{"type": "function", "function": {"name", "description", "parameters"}}])
        are rendered through the template; tool_choice "auto" (default), "none", "required" or
        {"type": "function", "function": {"name": ...}} (the last two forced by a grammar). The
        Completion's tool_calls then holds the calls the model made (OpenAI's shape, arguments
        as a JSON string) and its finish_reason is "tool_calls"; its text is the rest (gpt-oss's
        answer channel, its reasoning in the Completion's reasoning)."""
        tokens, req = self.chat_prompt(messages, tools, tool_choice, parallel_tool_calls)
        if req is None:
            return self.generate(tokens, stream=stream, **kwargs)
        if req.tools:
            given = [k for k in ("response_format", "grammar", "json_schema") if kwargs.get(k) is not None]
            if given:
                raise ValueError(f"{given[0]} cannot be combined with tools (give tool_choice='none', or no tools)")
            from .text.grammar import Grammar

            text = req.grammar(self.tokenizer)
            kwargs["grammar"] = None if text is None else Grammar(self.tokenizer, text, self.model.n_vocab, "tools")
        it = ToolCalls(self.generate(tokens, stream=True, _special=req.needs_special, **kwargs), req)
        if stream:
            return it
        for _ in it:
            pass
        return it.completion

    def chat_prompt(self, messages: Sequence[Mapping], tools=None, tool_choice=None,
                    parallel_tool_calls: Optional[bool] = None):
        """(prompt tokens, stowlm.text.toolcalls.ToolRequest or None): the conversation rendered with
        the template, the tools in the template's format (FieldError, a ValueError, names a bad one)."""
        if self._template is None:
            raise ValueError(self._template_error)
        messages = check_messages(messages)
        req = toolcalls.parse_tool_request(tools, tool_choice, parallel_tool_calls, self._template.source)
        msgs = toolcalls.template_messages(messages, req.format if req else self.tool_format)
        if req is not None:
            msgs = req.prompt_messages(msgs)
        tokens = self._template.encode(self.tokenizer, msgs, add_generation_prompt=True,
                                       tools=req.template_tools() if req else None)
        return tokens, req

    @property
    def tool_format(self) -> str:
        """How this model's chat template writes tool calls (stowlm.text.toolcalls.FORMATS)."""
        return toolcalls.detect_format(self._template.source if self._template else None)

    def create_completion(self, prompt, **kwargs):
        """llama-cpp-python's Llama.create_completion: an OpenAI text_completion dict (an iterator of
        chunk dicts with stream=True), checked and made as the server makes them."""
        from .compat import create

        return create(self, dict(kwargs, prompt=prompt), chat=False)

    __call__ = create_completion

    def create_chat_completion(self, messages, **kwargs):
        """llama-cpp-python's Llama.create_chat_completion: an OpenAI chat.completion dict (chunks
        with stream=True), with tools, tool_choice and response_format as the server takes them."""
        from .compat import create

        return create(self, dict(kwargs, messages=messages), chat=True)

    def grammar(self, response_format=None, grammar=None, json_schema=None):
        """The compiled Grammar (stowlm.text.grammar) of these request fields, None for free text;
        GrammarError (a ValueError) names the field that is wrong. Kept for the next request."""
        from .text import grammar as gm

        if isinstance(grammar, gm.Grammar):
            if response_format is not None or json_schema is not None:
                raise gm.GrammarError("give one of response_format, grammar, json_schema, not several", "grammar")
            return grammar
        key = json.dumps([response_format, grammar, json_schema], sort_keys=True, default=str)
        with self._grammars_lock:  # the server asks from several threads
            hit = self._grammars.get(key)
        if hit is not None:
            return hit
        text = gm.from_request(response_format, grammar, json_schema)
        if text is None:
            return None
        g = gm.Grammar(self.tokenizer, text, self.model.n_vocab)
        with self._grammars_lock:
            if len(self._grammars) >= 32:
                self._grammars.pop(next(iter(self._grammars)))
            self._grammars[key] = g
        return g

    def chat_tokens(self, messages: Sequence[Mapping[str, str]]) -> List[int]:
        """The prompt tokens of a conversation, rendered with the chat template."""
        return self.chat_prompt(messages)[0]
