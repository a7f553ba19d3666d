"""The window pool of hybrid KV memory, as the layers below the engine see it (the attention
backends address its pages; `jaxserve.engine.window_pages` sizes and books it)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class WindowLayout:
    """Which layers keep their pages in the window pool, and its size."""

    layers: tuple[int, ...]  # the window layers, in order
    window: int  # the widest of their windows, in tokens
    num_pages: int  # pages in the window pool, the padding page 0 included
