"""`tools` and `tool_choice` of a chat request: checked, and turned into what the engine runs.

- `"none"`: the tools reach the chat template, the reply is plain content.
- `"auto"` (the default when tools are given): the reply is parsed by the server's
  `--tool-call-parser` (`tool_parsers`); a server without one answers 400, as vLLM does.
- `"required"`: the reply is constrained by a JSON schema to a list of calls,
  `[{"name": ..., "parameters": {...}}, ...]` (vLLM's shape), each call's parameters by its
  function's schema: exactly one call, or one or more with `parallel_tool_calls: true`.
- `{"type": "function", "function": {"name": ...}}`: the reply is constrained to that
  function's arguments, a JSON object of its parameters' schema.

The constrained choices hold whatever the model: the structured-output engine only lets it
write text the schema accepts. They also end whatever the model: `bounds.bounded` caps what
each schema leaves open (string lengths, digits, items, extra keys), and one call is the
default, since a model that cannot call tools never closes the list on its own (OpenAI's and
vLLM's default is `parallel_tool_calls: true`; docs/tool-calling.md gives the reasons).
`ConstrainedCalls` reads that text as it streams: each call's name when it is whole, then its
arguments in pieces as the tokens arrive.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from jaxserve.errors import InvalidRequestError
from jaxserve.structured_output import StructuredOutputsParams
from jaxserve.tool_calling.bounds import bounded
from jaxserve.tool_calling.events import ArgumentsPiece, CallStart, Content, Event
from jaxserve.tool_calling.text_parser import TextParser

_NAME = re.compile(r"^[A-Za-z0-9_\-.]{1,64}$")  # OpenAI's rule for function names
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclasses.dataclass(frozen=True)
class ToolChoice:
    """A request's checked tools and how they may be called."""

    tools: list[dict]  # OpenAI's {"type": "function", "function": {...}}, parameters filled
    mode: str  # "none", "auto", "required" or "named"
    name: str | None = None  # the function of a named choice
    parallel: bool = False  # several calls: only when parallel_tool_calls is true

    def constraint(self) -> StructuredOutputsParams | None:
        """The JSON schema a required or named choice puts on the reply, each function's
        parameters bounded (`bounds.bounded`) so that the reply ends."""
        if self.mode == "named":
            return StructuredOutputsParams(json=bounded(self.parameters(self.name)))
        if self.mode != "required":
            return None
        calls = [{"type": "object",
                  "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                 "parameters": bounded(t["function"]["parameters"])},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for t in self.tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)

    def parameters(self, name: str) -> dict:
        return next(t["function"]["parameters"] for t in self.tools
                    if t["function"]["name"] == name)


def check_tool_choice(tools: list[Any] | None, tool_choice: Any,
                      parallel_tool_calls: bool | None) -> ToolChoice | None:
    """The request's ToolChoice (None without tools and with no choice, or with "none" and
    no tools); InvalidRequestError naming `tools.<i>...` or `tool_choice` when malformed."""
    checked = [_checked_tool(tool, i) for i, tool in enumerate(tools or ())]
    if tools is not None and not checked:
        raise InvalidRequestError("tools", "tools must list at least one function")
    if tool_choice is None:
        if not checked:
            return None
        tool_choice = "auto"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise InvalidRequestError("tool_choice", "tool_choice must be 'none', 'auto', "
                                      "'required' or {'type': 'function', 'function': "
                                      f"{{'name': ...}}}}, got {tool_choice!r}")
        if tool_choice == "none" and not checked:
            return None
        if not checked:
            raise InvalidRequestError("tool_choice", f"tool_choice {tool_choice!r} needs "
                                      "tools")
        return ToolChoice(checked, tool_choice, parallel=parallel_tool_calls is True)
    name = _named_function(tool_choice)
    names = [t["function"]["name"] for t in checked]
    if name not in names:
        raise InvalidRequestError("tool_choice.function.name", f"tool_choice names function "
                                  f"{name!r}, which is not in tools ({', '.join(names) or 'none'})")
    return ToolChoice(checked, "named", name, parallel=parallel_tool_calls is True)


def _named_function(choice: Any) -> str:
    if not (isinstance(choice, dict) and choice.get("type") == "function"
            and isinstance(choice.get("function"), dict)
            and isinstance(choice["function"].get("name"), str)):
        raise InvalidRequestError("tool_choice", "tool_choice must be 'none', 'auto', "
                                  "'required' or {'type': 'function', 'function': {'name': "
                                  f"...}}}}, got {choice!r}")
    return choice["function"]["name"]


def _checked_tool(tool: Any, i: int) -> dict:
    """One entry of `tools`, its parameters schema filled in (an object with no properties
    when absent) and checked to be a JSON schema of an object."""
    where = f"tools.{i}"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise InvalidRequestError(f"{where}.type", "each tool must be {'type': 'function', "
                                  "'function': {...}}")
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequestError(f"{where}.function.name", "a tool's function needs a name")
    if not _NAME.match(function["name"]):
        raise InvalidRequestError(f"{where}.function.name", "a function name is 1-64 "
                                  "letters, digits, '_', '-' or '.', got "
                                  f"{function['name']!r}")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = _EMPTY_PARAMETERS
    if not isinstance(parameters, dict):
        raise InvalidRequestError(f"{where}.function.parameters", "parameters must be a JSON "
                                  f"schema object, got {parameters!r}")
    kind = parameters.get("type", "object")
    if kind != "object":
        raise InvalidRequestError(f"{where}.function.parameters.type", "a function's "
                                  f"parameters are a JSON object ('type': 'object'), got {kind!r}")
    return {"type": "function", "function": {**function, "parameters": parameters}}


class ConstrainedCalls(TextParser):
    """Calls out of a reply constrained by `ToolChoice.constraint()`.

    named: the whole reply is the arguments, streamed as it comes. required: a JSON list of
    {"name", "parameters"}; a call starts when its name is whole and its arguments stream
    until their object closes. Text the schema did not produce (a reply cut by max_tokens
    before a name completed) is content.
    """

    _head = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*')
    _tail = re.compile(r"\s*\}\s*([,\]])")

    def __init__(self, choice: ToolChoice):
        super().__init__()
        self.named = choice.name if choice.mode == "named" else None
        self.mode = "arguments" if self.named else "list"
        self.calls = 0
        self.started = False
        self._depth, self._in_string, self._escaped = 0, False, False

    def scan(self, text, final):
        if self.named:
            events: list[Event] = [] if self.started else [CallStart(0, self.named)]
            self.started = True
            return events + [ArgumentsPiece(0, text)], len(text)
        if self.mode == "list":
            rest = text.lstrip()
            if not rest:
                return [], len(text)
            if not rest.startswith("["):
                return self._stray(text)
            self.mode = "head"
            return [], len(text) - len(rest) + 1
        if self.mode == "head":
            match = self._head.match(text)
            if match is None:
                return ([], 0) if not final else self._stray(text)
            self.mode = "arguments"
            events = [CallStart(self.calls, json.loads(match.group(1)))]
            return events, match.end()
        if self.mode == "arguments":
            end = self._value_end(text)
            piece = text if end is None else text[:end]
            if end is not None:
                self.mode = "tail"
            return [ArgumentsPiece(self.calls, piece)], len(piece)
        if self.mode == "tail":
            match = self._tail.match(text)
            if match is None:
                return ([], 0) if not final and not text.strip("} \n") else self._stray(text)
            self.calls += 1
            self.mode = "head" if match.group(1) == "," else "done"
            return [], match.end()
        return self._stray(text)

    def _value_end(self, text: str) -> int | None:
        """Where the arguments object closes in `text` (its end), tracking nesting and strings
        across pieces; None while it is open."""
        for i, char in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return None

    def _stray(self, text: str) -> tuple[list[Event], int]:
        self.mode = "stray"
        return [Content(text)], len(text)
