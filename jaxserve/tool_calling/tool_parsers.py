"""Tool-call parsers for `tool_choice: "auto"`: find the calls a model wrote in its own format.

One class per format, chosen by `--tool-call-parser` with vLLM's names:
- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen2.5,
  Qwen3), any number, text around them is content.
- `llama3_json`: a reply that opens with `{` (or `<|python_tag|>`) is `;`-separated
  `{"name": ..., "parameters": {...}}` objects (Llama 3.1-3.3); any other reply is content.
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` (older tokenizers) or
  `name[ARGS]{...}` / `name{...}` (newer); text before it is content.
- `qwen3_coder`: `<tool_call><function=NAME><parameter=P>value</parameter></function>
  </tool_call>` (Qwen3-Coder); parameter values are typed by the tool's schema.

A call is reported when its text is complete and parses: its whole name, then its arguments
as one JSON piece. A call that never completes, or does not parse, stays content, so a
client never sees a partial name or arguments that are not JSON, streamed or not.
"""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

from jaxserve.tool_calling.events import Content, Event, whole_call
from jaxserve.tool_calling.text_parser import TextParser, content_until

_JSON = json.JSONDecoder()


def _object_arguments(value: Any) -> dict | None:
    """A call's arguments as a dict: given as an object, as the JSON text of one, or absent."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


def json_call(value: Any, arguments_keys: tuple[str, ...]) -> tuple[str, dict] | None:
    """(name, arguments) of a decoded `{"name": ..., <arguments key>: {...}}`, else None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    given = [k for k in arguments_keys if k in value]
    arguments = _object_arguments(value[given[0]] if given else None)
    return None if arguments is None else (value["name"], arguments)


class ToolParser(TextParser):
    """Incremental parser of one reply; `tools` are the request's (OpenAI's shape)."""

    name: ClassVar[str]
    # Text every chat template that teaches this format contains (a model whose template
    # lacks it was never shown how to write these calls).
    template_marker: ClassVar[str]
    # The format's markers are special tokens, so the reply is detokenized with them kept.
    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self, tools: list[dict] | None = None):
        super().__init__()
        self.functions = {t["function"]["name"]: t["function"] for t in tools or ()}
        self.calls = 0
        self._after_call_skipped = True  # whitespace after the latest call is dropped

    def call(self, name: str, arguments: dict) -> list[Event]:
        events = whole_call(self.calls, name, arguments)
        self.calls += 1
        return events


class TaggedCallParser(ToolParser):
    """Calls between an opening and a closing tag, content around them."""

    start: ClassVar[str]
    end: ClassVar[str]

    def scan(self, text, final):
        if self.calls and not self._after_call_skipped:  # the newlines between calls
            rest = text.lstrip()
            self._after_call_skipped = bool(rest)
            if len(rest) < len(text):
                return [], len(text) - len(rest)
        events, used, found = content_until(text, self.start, final)
        if used or not found:
            return events, used
        close = text.find(self.end, len(self.start))
        if close < 0 and not final:
            return [], 0
        used = len(text) if close < 0 else close + len(self.end)
        call = self.parse_body(text[len(self.start):close if close >= 0 else len(text)])
        self._after_call_skipped = False
        return (self.call(*call) if call else [Content(text[:used])]), used

    def parse_body(self, body: str) -> tuple[str, dict] | None:
        raise NotImplementedError


class HermesParser(TaggedCallParser):
    name = "hermes"
    template_marker = "<tool_call>"
    start, end = "<tool_call>", "</tool_call>"

    def parse_body(self, body):
        try:
            return json_call(json.loads(body), ("arguments", "parameters"))
        except ValueError:
            return None


class Qwen3CoderParser(TaggedCallParser):
    name = "qwen3_coder"
    template_marker = "<function="
    start, end = "<tool_call>", "</tool_call>"
    _function = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?$", re.DOTALL)
    _parameter = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)",
                            re.DOTALL)

    def parse_body(self, body):
        match = self._function.match(body)
        if match is None:
            return None
        name = match.group(1).strip()
        schema = self.functions.get(name, {}).get("parameters") or {}
        properties = schema.get("properties") or {}
        arguments = {}
        for param in self._parameter.finditer(match.group(2)):
            key = param.group(1).strip()
            value = param.group(2).removeprefix("\n").removesuffix("\n")
            arguments[key] = typed_value(value, properties.get(key, {}).get("type"))
        return name, arguments


def typed_value(text: str, kind: Any) -> Any:
    """A qwen3_coder parameter's text as the value its schema type says (strings stay
    text; other types are read as JSON, and kept as text when they are not)."""
    kinds = kind if isinstance(kind, list) else [kind]
    if "string" in kinds and len(kinds) == 1:
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    template_marker = '"parameters"'
    tag = "<|python_tag|>"

    def __init__(self, tools=None):
        super().__init__(tools)
        self.mode = "opening"  # then "calls" or "content"

    def scan(self, text, final):
        if self.mode == "content":
            return [Content(text)], len(text)
        if self.mode == "opening":
            rest = text.lstrip()
            if not final and (not rest or (self.tag.startswith(rest) and rest != self.tag)):
                return [], 0
            if rest.startswith(self.tag):
                self.mode = "calls"
                return [], len(text) - len(rest) + len(self.tag)
            self.mode = "calls" if rest.startswith("{") else "content"
            return self.scan(text, final)
        return self._next_call(text, final)

    def _next_call(self, text: str, final: bool) -> tuple[list[Event], int]:
        rest = text.lstrip(" \t\r\n;")
        skipped = len(text) - len(rest)
        if not rest:
            return [], skipped
        if not rest.startswith("{"):
            self.mode = "content"
            return [Content(rest)], len(text)
        try:
            value, end = _JSON.raw_decode(rest)
        except ValueError:
            if not final:
                return [], 0
            value, end = None, 0
        call = json_call(value, ("parameters", "arguments"))
        if call is None:
            self.mode = "content"
            return [Content(rest)], len(text)
        return self.call(*call), skipped + end


class MistralParser(ToolParser):
    name = "mistral"
    template_marker = "[TOOL_CALLS]"
    keeps_special_tokens = True
    marker = "[TOOL_CALLS]"
    _call_name = re.compile(r"[A-Za-z0-9_.\-]+")

    def scan(self, text, final):
        events, used, found = content_until(text, self.marker, final)
        if used or not found:
            return events, used
        after = len(self.marker)
        rest = text[after:].lstrip()
        start = len(text) - len(rest)
        if rest.startswith("["):
            return self._listed(text, start, final)
        match = self._call_name.match(rest)
        if match is None or match.end() == len(rest):
            return self._undecided(text, final)
        body = rest[match.end():]
        args = "[ARGS]"
        if body.startswith(args):
            body = body[len(args):]
        elif args.startswith(body) and not final:
            return [], 0
        try:
            value, end = _JSON.raw_decode(body)
        except ValueError:
            return self._undecided(text, final)
        arguments = _object_arguments(value)
        if arguments is None:
            return [Content(text)], len(text)
        return self.call(match.group(0), arguments), len(text) - len(body) + end

    def _listed(self, text: str, start: int, final: bool) -> tuple[list[Event], int]:
        try:
            value, end = _JSON.raw_decode(text[start:])
        except ValueError:
            return self._undecided(text, final)
        calls = [json_call(v, ("arguments", "parameters")) for v in value] \
            if isinstance(value, list) and value else [None]
        if None in calls:
            return [Content(text[:start + end])], start + end
        return [e for call in calls for e in self.call(*call)], start + end

    def _undecided(self, text: str, final: bool) -> tuple[list[Event], int]:
        """A call still being written waits; at the end it is content."""
        return ([Content(text)], len(text)) if final else ([], 0)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesParser, Llama3JsonParser, MistralParser,
                                       Qwen3CoderParser)}
