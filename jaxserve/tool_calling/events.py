"""What the chat output parsers produce while a reply streams: content, reasoning and tool
calls, as events in the order the text carried them.

A tool call is announced once with its whole name (`CallStart`), then its arguments follow
as one or more `ArgumentsPiece`s whose concatenation is the arguments' JSON text. The HTTP
layer (`jaxserve.server.handlers`) turns events into OpenAI's `delta` and `message` bodies.
"""

from __future__ import annotations

import dataclasses
import json


@dataclasses.dataclass(frozen=True)
class Content:
    text: str


@dataclasses.dataclass(frozen=True)
class Reasoning:
    text: str


@dataclasses.dataclass(frozen=True)
class CallStart:
    index: int  # the call's position among this reply's calls
    name: str


@dataclasses.dataclass(frozen=True)
class ArgumentsPiece:
    index: int
    text: str


Event = Content | Reasoning | CallStart | ArgumentsPiece


def whole_call(index: int, name: str, arguments: dict) -> list[Event]:
    """The events of a call known whole: its name, then its arguments as one piece."""
    return [CallStart(index, name),
            ArgumentsPiece(index, json.dumps(arguments, ensure_ascii=False))]


def merged(events: list[Event]) -> list[Event]:
    """`events` without empty pieces, neighbouring pieces of one kind (and one call) joined."""
    out: list[Event] = []
    for event in events:
        if isinstance(event, CallStart):
            out.append(event)
        elif event.text:
            last = out[-1] if out else None
            if type(last) is type(event) and getattr(last, "index", None) == getattr(
                    event, "index", None):
                out[-1] = dataclasses.replace(last, text=last.text + event.text)
            else:
                out.append(event)
    return out
