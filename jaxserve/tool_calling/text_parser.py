"""`TextParser`: the incremental scanning that every output parser shares.

Text arrives in pieces of any size (a token can hold half a marker, or a whole call). A
parser keeps what it has not yet decided on in a buffer and asks its `scan` to decide on a
prefix of it; `scan` sees only the buffer and whether more text can come, so a reply gives
the same events however it was split — the property SGLang's streaming tool parsers lost
(sgl-project/sglang#35564). Text that could be the start of a marker is held back until the
next piece says whether it is one; at the end nothing is held.
"""

from __future__ import annotations

from jaxserve.tool_calling.events import Content, Event


def partial_marker_start(text: str, marker: str) -> int:
    """Where a proper prefix of `marker` that ends `text` begins (`len(text)` if none): the
    text from there must wait for the next piece."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return len(text) - size
    return len(text)


def content_until(text: str, marker: str, final: bool) -> tuple[list[Event], int, bool]:
    """Content up to `marker` in `text`: (events, characters used, marker found at `used`).
    Without the marker, a possible start of it at the end is held back unless `final`."""
    at = text.find(marker)
    if at >= 0:
        return ([Content(text[:at])] if at else []), at, True
    safe = len(text) if final else partial_marker_start(text, marker)
    return ([Content(text[:safe])] if safe else []), safe, False


class TextParser:
    """Buffers text and turns it into events through `scan`, which subclasses write."""

    def __init__(self):
        self._buffer = ""

    def feed(self, text: str) -> list[Event]:
        """Events for the text so far that are certain; the rest stays buffered."""
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        """Events for everything left: the reply has ended."""
        events = self._drain(final=True)
        if self._buffer:
            events.append(Content(self._buffer))
            self._buffer = ""
        return events

    def parse(self, text: str) -> list[Event]:
        """The events of a whole reply."""
        return self.feed(text) + self.finish()

    def _drain(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while self._buffer:
            found, used = self.scan(self._buffer, final)
            if used == 0 and not found:
                break
            events += found
            self._buffer = self._buffer[used:]
        return events

    def scan(self, text: str, final: bool) -> tuple[list[Event], int]:
        """(events, characters of `text` they account for) for a prefix of `text`; (..., 0)
        with no events waits for more text. `final`: no more text will come."""
        raise NotImplementedError
