"""Hybrid KV memory: the sliding-window layers' pages in a pool of their own, freed as they
slide out of the window (plain Python, no jax).

A layer with a window of W tokens reads, for a token at position p, only the keys at
positions p - W + 1 .. p. Once a sequence has computed its first n tokens, every later
token's window starts at n - W + 1 or after, so its pages before that position are dead for
those layers. Full-context pages for them, as the other layers need, waste most of a long
sequence's KV bytes in a model like Gemma 3 (five sliding layers to one global) or gpt-oss
(one in two).

So the layers whose window is shorter than `max_model_len` ("window layers") keep their
pages in a second pool, with a second page table per sequence (`Sequence.window_pages`,
as long as `Sequence.pages`, its logical page i holding the same tokens). As the sequence
advances, the pages before its window go back to that pool and their entries become the
padding page 0, which the kernels never visit (their work starts at the window). The
full-context pool keeps serving the other layers, the prefix cache's keys, admission and
preemption, exactly as without windows.

The window pool is sized to what the running sequences can hold at once
(`window_pool_pages`): each its window plus the tokens reserved ahead of it, a step's worth
in all. Everything else goes to the full-context pool, so a model with few global layers
fits several times more sequences (`jaxserve plan` reports by how much). Should the window
pool still run dry, a reservation fails as with the full pool: the scheduler preempts.

Prefix caching follows vLLM's rule: a cached prefix of n pages is reusable only if the
window pool still holds its last pages, those a token at position n * page_size can see;
the scheduler takes the longest prefix for which it does. Window pages are keyed with the
full pages' keys when both fill, and freed ones wait in the window pool's LRU like any
cached page.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxserve.config.engine import EngineConfig
from jaxserve.config.window import WindowLayout
from jaxserve.engine.page_allocator import PageAllocator
from jaxserve.engine.sequence import Sequence

if TYPE_CHECKING:  # the plain-Python core starts no jax (tests/test_layering.py)
    from jaxserve.model.config import ModelConfig


def window_layout(model: ModelConfig, engine: EngineConfig) -> WindowLayout | None:
    """The window pool for `model` served as `engine` says, or None: hybrid memory is off
    (`disable_hybrid_kv_cache_manager`) or no layer's window is shorter than
    `max_model_len`. (Stacked layers share their kind, window included: a stack is in the
    pool whole or not at all.)"""
    if engine.disable_hybrid_kv_cache_manager:
        return None
    windows = model.layer_windows
    layers = tuple(i for i, w in enumerate(windows)
                   if w is not None and w < engine.max_model_len)
    if not layers:
        return None
    window = max(windows[i] for i in layers)
    return WindowLayout(layers, window, window_pool_pages(engine, window))


def window_pool_pages(engine: EngineConfig, window: int) -> int:
    """Pages the running sequences can hold in the window pool at once. A sequence whose
    next step computes tokens [n, n + r) holds the pages from position n - W + 1 to
    n + r - 1: at most ceil((W - 1) / page_size) + 2 + r / page_size. Its r tokens ahead are
    a step's chunk or decode token, or a decode loop's steps (times k + 1 when speculating);
    all rows' together at most `ahead`. Capped by full-length pages for every sequence."""
    page = engine.page_size
    spec = engine.speculative_config
    per_round = 1 if spec is None else spec.num_speculative_tokens + 1
    ahead = max(engine.max_num_batched_tokens,
                engine.max_num_seqs * engine.num_decode_steps * per_round)
    per_seq = -(-(window - 1) // page) + 2
    held = engine.max_num_seqs * per_seq + -(-ahead // page)
    return 1 + min(held, engine.max_num_seqs * engine.pages_per_seq)


class WindowPages:
    """A scheduler's book of its sequences' window pages (`Sequence.window_pages`)."""

    def __init__(self, layout: WindowLayout, allocator: PageAllocator):
        self.window = layout.window
        self.allocator = allocator
        self.page_size = allocator.page_size

    def first_visible(self, position: int) -> int:
        """The first logical page a token at `position` (or after) can see."""
        return max(0, position - self.window + 1) // self.page_size

    def reserve(self, seq: Sequence, num_pages: int) -> bool:
        """Free the pages slid out of `seq`'s window (its next token is at
        `num_computed_tokens`) and extend its table to `num_pages` entries; False (nothing
        taken, the freeing kept) if the pool cannot."""
        pages = seq.window_pages
        # freed entries are a prefix of zeros: walk back from the window's start to it, so a
        # step costs the pages it frees, not the sequence's length
        first = min(self.first_visible(seq.num_computed_tokens), len(pages))
        dead = first
        while dead > 0 and pages[dead - 1]:
            dead -= 1
        self.allocator.free(pages[dead:first])
        pages[dead:first] = [0] * (first - dead)
        needed = num_pages - len(pages)
        if needed <= 0:
            return True
        new = self.allocator.allocate(needed)
        if new is None:
            return False
        pages.extend(new)
        return True

    def trim(self, seq: Sequence, num_pages: int) -> None:
        """Free the entries from `num_pages` on (reserved, then not used)."""
        self.allocator.free([p for p in seq.window_pages[num_pages:] if p])
        del seq.window_pages[num_pages:]

    def release(self, seq: Sequence) -> None:
        self.trim(seq, 0)

    def forget(self, seq: Sequence) -> None:
        """Take the sequence's pages out of the prefix cache (a failed step)."""
        self.allocator.forget([p for p in seq.window_pages if p])

    def match(self, seq: Sequence) -> int:
        """After the full pool matched `seq.page_hashes`' pages: the longest prefix of them
        whose pages a next token can see are cached here too. Those are referenced into
        `seq.window_pages` (0 before the window); returns how many full pages are usable."""
        hashes, tokens, page = seq.page_hashes, seq.token_ids, self.page_size
        for usable in range(len(hashes), 0, -1):
            first = self.first_visible(usable * page)
            found = []
            for i in range(first, usable):
                parent = hashes[i - 1] if i else seq.prefix_root
                cached = self.allocator.cached(hashes[i], parent,
                                               tuple(tokens[i * page:(i + 1) * page]))
                if cached is None:
                    break
                found.append(cached)
            if len(found) == usable - first:
                self.allocator.hold(found)
                seq.window_pages = [0] * first + found
                return usable
        seq.window_pages = []
        return 0

    def register(self, seq: Sequence, first: int) -> None:
        """Key the window pages of full pages `first` on, just keyed in the full pool (those
        already slid out are not cached)."""
        hashes, tokens, page = seq.page_hashes, seq.token_ids, self.page_size
        for i in range(first, len(hashes)):
            if i < len(seq.window_pages) and seq.window_pages[i]:
                parent = hashes[i - 1] if i else seq.prefix_root
                self.allocator.key_page(seq.window_pages[i], hashes[i], parent,
                                        tuple(tokens[i * page:(i + 1) * page]))

