"""Reasoning parsers (`--reasoning-parser`, vLLM's names): the thinking a reasoning model
writes between `<think>` and `</think>` becomes `reasoning_content`, the rest `content`.

- `deepseek_r1`: the chat template opens `<think>` in the prompt, so the reply is reasoning
  from its first character up to `</think>` (a `<think>` the model repeats is dropped); a
  reply with no `</think>` is all reasoning (it was cut off while thinking).
- `qwen3`: the reply is reasoning only when it opens with `<think>` (Qwen3 with thinking on);
  otherwise all content (`enable_thinking: false`, whose template writes an empty think block
  into the prompt).

The newlines a model writes after `</think>` are dropped from the content.
"""

from __future__ import annotations

from typing import ClassVar

from jaxserve.tool_calling.events import Content, Event, Reasoning
from jaxserve.tool_calling.text_parser import TextParser, content_until

OPEN, CLOSE = "<think>", "</think>"


class ReasoningParser(TextParser):
    """Splits one reply into reasoning and content."""

    name: ClassVar[str]
    # Whether a reply that does not open with <think> is reasoning (deepseek_r1) or content.
    starts_thinking: ClassVar[bool]

    def __init__(self):
        super().__init__()
        self.mode = "opening"  # then "reasoning", "after" (dropping newlines), "content"

    def scan(self, text: str, final: bool) -> tuple[list[Event], int]:
        if self.mode == "opening":
            rest = text.lstrip()
            if not final and OPEN.startswith(rest) and rest != OPEN:
                return [], 0
            if rest.startswith(OPEN):
                self.mode = "reasoning"
                return [], len(text) - len(rest) + len(OPEN)
            self.mode = "reasoning" if self.starts_thinking else "content"
            return self.scan(text, final)
        if self.mode == "reasoning":
            events, used, found = content_until(text, CLOSE, final)
            events = [Reasoning(e.text) for e in events]
            if found and not used:
                self.mode = "after"
                return [], len(CLOSE)
            return events, used
        if self.mode == "after":
            rest = text.lstrip("\n")
            if rest:
                self.mode = "content"
            return [], len(text) - len(rest)
        return [Content(text)], len(text)


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"
    starts_thinking = True


class Qwen3Parser(ReasoningParser):
    name = "qwen3"
    starts_thinking = False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1Parser, Qwen3Parser)}
