"""Caps on what one request may make the server do, checked before any of it is done.

Each cap bounds a cost that grows with a field the client chooses and that the body-size
limit alone leaves too large:

- stop strings are searched for after every generated token, on the engine thread that
  serves every request (`jaxserve.engine.stop_strings`): their count and each one's length
  bound that search. OpenAI allows 4 stop sequences; vLLM sets no cap.
- tools: the chat template renders each one into the prompt, and each one's parameters are
  compiled as a grammar to check them. OpenAI allows 128 tools.
- schemas and grammars (each tool entry, and the request's own output constraint:
  `response_format`, `structured_outputs`, `guided_json`, `guided_regex`,
  `guided_choice`, `guided_grammar`): compiling one takes time that grows with its size
  (faster than linearly for a long list of choices), so a flood of large, distinct ones
  would keep the grammar compiler busy. llguidance's own limits (`LLParserLimits`: lexer
  fuel and grammar size, left at its defaults) bound the work of compiling what passes.
- log-probabilities (`logprobs`, `top_logprobs`, `prompt_logprobs`): vLLM's `--max-logprobs`;
  the engine computes at most `MAX_LOGPROBS` per token, so the cap cannot exceed it.

A request past a cap is a `InvalidRequestError` naming the field (HTTP 400).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jaxserve.errors import InvalidRequestError
from jaxserve.sampling_params import MAX_LOGPROBS


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """The caps; the defaults suit an interactive server (the flags of `jaxserve serve`
    change them)."""

    max_stop_strings: int = 32
    max_stop_string_chars: int = 256
    max_tools: int = 128  # OpenAI's limit
    max_schema_bytes: int = 64 << 10  # each tool entry, and the output constraint
    max_logprobs: int = MAX_LOGPROBS  # vLLM's default (20) too

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            least = 0 if field.name == "max_logprobs" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                kind = "a positive" if least else "a non-negative"
                raise ValueError(f"{field.name} must be {kind} integer, got {value!r}")
        if self.max_logprobs > MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be at most {MAX_LOGPROBS} (the engine "
                             f"computes that many per token), got {self.max_logprobs}")

    def check(self, body) -> None:
        """Raise `InvalidRequestError` naming the first field of `body` (a completion or
        chat request, `jaxserve.server.protocol`) past a cap."""
        for field in ("logprobs", "top_logprobs", "prompt_logprobs"):
            value = getattr(body, field, None)
            if not isinstance(value, bool) and value is not None and value > self.max_logprobs:
                raise InvalidRequestError(field, f"{field} is {value}; at most "
                                          f"{self.max_logprobs} are allowed (--max-logprobs)")
        stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if len(stops) > self.max_stop_strings:
            raise InvalidRequestError("stop", f"stop has {len(stops)} strings; at most "
                                      f"{self.max_stop_strings} are allowed")
        for i, stop in enumerate(stops):
            if len(stop) > self.max_stop_string_chars:
                raise InvalidRequestError(
                    "stop", f"stop[{i}] has {len(stop)} characters; at most "
                            f"{self.max_stop_string_chars} are allowed")
        tools = getattr(body, "tools", None) or []
        if len(tools) > self.max_tools:
            raise InvalidRequestError("tools", f"tools has {len(tools)} entries; at most "
                                      f"{self.max_tools} are allowed")
        for i, tool in enumerate(tools):
            self._check_size(f"tools.{i}", tool)
        for field in ("response_format", "structured_outputs", "guided_json", "guided_regex",
                      "guided_choice", "guided_grammar"):
            if getattr(body, field) is not None:
                self._check_size(field, getattr(body, field))

    def _check_size(self, field: str, value: Any) -> None:
        """`value` (text, or JSON counted as compact JSON) fits in `max_schema_bytes`."""
        text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"),
                                                               ensure_ascii=False)
        size = len(text.encode())
        if size > self.max_schema_bytes:
            raise InvalidRequestError(field, f"{field} is {size} bytes; at most "
                                      f"{self.max_schema_bytes} are allowed")
