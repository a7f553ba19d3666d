"""Tool calling and reasoning for the chat API: what turns a reply's text into OpenAI's
`tool_calls` and `reasoning_content`.

- `tool_choice`: checks a request's `tools` and `tool_choice`; "required" and named choices
  become a JSON-schema constraint for the structured-output engine, so their arguments always
  parse, whatever the model (`ConstrainedCalls` reads them back as they stream).
- `bounds`: bounds what those schemas leave open (string lengths, digits, items, extra keys),
  so that a forced reply ends even from a model that cannot call tools.
- `tool_parsers`: `tool_choice: "auto"` finds calls in the model's own format (vLLM's
  `--tool-call-parser` names: hermes, llama3_json, mistral, qwen3_coder).
- `reasoning`: `--reasoning-parser` (deepseek_r1, qwen3) splits `<think>` text off.
- `reply`: composes them per reply into `message` and streamed `delta` bodies.

Every parser is incremental and split-proof (`text_parser`): a reply streamed token by token
gives the same calls, content and reasoning as the whole reply. Pure Python: no jax.
"""

from __future__ import annotations

import dataclasses

from jaxserve.errors import InvalidRequestError
from jaxserve.tool_calling.reasoning import REASONING_PARSERS
from jaxserve.tool_calling.reply import ReplyParser
from jaxserve.tool_calling.tool_choice import ConstrainedCalls, ToolChoice, check_tool_choice
from jaxserve.tool_calling.tool_parsers import TOOL_PARSERS

__all__ = ["ChatParsing", "REASONING_PARSERS", "TOOL_PARSERS", "ReplyParser", "ToolChoice",
           "check_tool_choice"]


@dataclasses.dataclass(frozen=True)
class ChatParsing:
    """The server's flags for chat replies (vLLM's): `--enable-auto-tool-choice`,
    `--tool-call-parser`, `--reasoning-parser`."""

    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None

    def __post_init__(self):
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {sorted(TOOL_PARSERS)}, got "
                             f"{self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the format "
                             "the model writes its calls in)")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser must be one of {sorted(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")

    def check(self, choice: ToolChoice | None, chat_template: str | None) -> None:
        """Refuse `tool_choice: "auto"` (HTTP 400 naming it) on a server that cannot parse
        calls, or for a model whose chat template never writes the parser's format."""
        if choice is None or choice.mode != "auto":
            return
        if not self.enable_auto_tool_choice:
            raise InvalidRequestError("tool_choice", '"auto" tool choice (the default when '
                                      "tools are given) needs a server started with "
                                      "--enable-auto-tool-choice and --tool-call-parser; "
                                      'send "required", a named function or "none"')
        marker = TOOL_PARSERS[self.tool_call_parser].template_marker
        if marker not in (chat_template or ""):
            raise InvalidRequestError("tool_choice", f"this model's chat template never writes "
                                      f"{self.tool_call_parser} tool calls (it has no "
                                      f"{marker!r}), so \"auto\" would find none; send "
                                      '"required" or a named function, which work with any '
                                      "model")

    def keeps_special_tokens(self, choice: ToolChoice | None) -> bool:
        """Whether the reply's text must keep special tokens (the parser's markers are)."""
        return (choice is not None and choice.mode == "auto"
                and TOOL_PARSERS[self.tool_call_parser].keeps_special_tokens)

    def reply_parser(self, choice: ToolChoice | None, include_reasoning: bool) -> ReplyParser:
        """A fresh parser for one reply of a request with `choice`."""
        calls = None
        if choice is not None and choice.mode == "auto":
            calls = TOOL_PARSERS[self.tool_call_parser](choice.tools)
        elif choice is not None and choice.mode in ("required", "named"):
            calls = ConstrainedCalls(choice)
        reasoning = (REASONING_PARSERS[self.reasoning_parser]()
                     if self.reasoning_parser and (choice is None or choice.mode in
                                                   ("none", "auto")) else None)
        return ReplyParser(reasoning, calls, include_reasoning)
