"""One chat reply's text turned into OpenAI's message: `content`, `reasoning_content` and
`tool_calls`, whole (`message`) or as it streams (`delta`).

The reasoning parser sees the text first; what it calls content goes on to the tool-call
parser (the server's for `tool_choice: "auto"`, `ConstrainedCalls` for required and named).
The streamed deltas of a reply add up to its whole message: both come from the same events.
"""

from __future__ import annotations

import uuid

from jaxserve.tool_calling.events import (ArgumentsPiece, CallStart, Content, Event, Reasoning,
                                          merged)
from jaxserve.tool_calling.reasoning import ReasoningParser
from jaxserve.tool_calling.text_parser import TextParser


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ReplyParser:
    """Events of one reply: reasoning split off first, then tool calls found in the rest."""

    def __init__(self, reasoning: ReasoningParser | None, calls: TextParser | None,
                 include_reasoning: bool = True):
        self.reasoning, self.calls = reasoning, calls
        self.include_reasoning = include_reasoning
        self.call_ids: dict[int, str] = {}  # call index → its id, given at CallStart
        self.made_calls = False

    def feed(self, text: str) -> list[Event]:
        return self._route(self.reasoning.feed(text) if self.reasoning else [Content(text)])

    def finish(self) -> list[Event]:
        events = self._route(self.reasoning.finish()) if self.reasoning else []
        if self.calls is not None:
            events += self.calls.finish()
        return self._kept(merged(events))

    def _route(self, events: list[Event]) -> list[Event]:
        out: list[Event] = []
        for event in events:
            if isinstance(event, Content) and self.calls is not None:
                out += self.calls.feed(event.text)
            else:
                out.append(event)
        return self._kept(merged(out))

    def _kept(self, events: list[Event]) -> list[Event]:
        for event in events:
            if isinstance(event, CallStart):
                self.call_ids[event.index] = new_call_id()
                self.made_calls = True
        if self.include_reasoning:
            return events
        return [e for e in events if not isinstance(e, Reasoning)]

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's finish_reason: "tool_calls" for a reply that ended by calling tools."""
        return "tool_calls" if reason == "stop" and self.made_calls else reason

    # ---- OpenAI bodies ------------------------------------------------------------------
    def delta(self, events: list[Event]) -> dict:
        """A streamed `delta` of `events`: content, reasoning_content and tool_calls, each
        call's first piece with its id, type and name."""
        delta: dict = {}
        calls: dict[int, dict] = {}
        for event in events:
            if isinstance(event, Content):
                delta["content"] = delta.get("content", "") + event.text
            elif isinstance(event, Reasoning):
                delta["reasoning_content"] = delta.get("reasoning_content", "") + event.text
            elif isinstance(event, CallStart):
                calls[event.index] = {"index": event.index, "id": self.call_ids[event.index],
                                      "type": "function",
                                      "function": {"name": event.name, "arguments": ""}}
            elif isinstance(event, ArgumentsPiece):
                entry = calls.setdefault(event.index, {"index": event.index,
                                                       "function": {"arguments": ""}})
                entry["function"]["arguments"] += event.text
        if calls:
            delta["tool_calls"] = list(calls.values())
        return delta

    def message(self, events: list[Event]) -> dict:
        """The whole `message` of a reply's events (content None when it only calls tools)."""
        delta = self.delta(events)
        message = {"role": "assistant", "content": delta.get("content", "")}
        if "reasoning_content" in delta:
            message["reasoning_content"] = delta["reasoning_content"]
        if "tool_calls" in delta:
            message["content"] = message["content"] or None
            message["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": c["function"]}
                for c in delta["tool_calls"]]
        return message
