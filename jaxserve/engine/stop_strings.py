"""Stop-string detection on streamed text.

The returned text ends before the stop string and the token ids end with the token that
completed it, as in vLLM. Only the tail that new text can have changed is searched, so the
cost per token does not grow with the length of the output.
"""

from __future__ import annotations


def find_stop(text: str, new_text_len: int, stops: list[str]) -> int | None:
    """Index in `text` where the earliest stop string begins, if the last `new_text_len`
    characters completed one; else None."""
    best = None
    for stop in stops:
        start = max(0, len(text) - new_text_len - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best):
            best = index
    return best
