"""KV-cache page allocator with reference counts and a prefix cache (plain Python, no jax).

Page 0 is never handed out: padding tokens and padding sequences point at it.

Prefix caching: a full page is keyed by SHA-256 chained over every token before it and in it,
starting from a root key of whatever else changes K/V (a request's `cache_salt` and LoRA
adapter, as separate length-prefixed fields, so no salt can spell another salt and adapter),
as vLLM keys its pages: a crafted prompt cannot be steered onto another request's K/V by a hash
collision. Each cached page also keeps its parent key and tokens, and a hit must match them,
so even a colliding key function (see the tests) only costs a recomputation. A new request
reuses the pages of its longest cached prefix (reference counted; full pages are never
written again, so no copy-on-write is needed).
A page whose count drops to zero keeps its key and waits in an LRU list; it is evicted, and
its key forgotten, only when a fresh page is needed and none is free.
"""

from __future__ import annotations

import collections
import hashlib
import struct
from array import array
from collections.abc import Callable


def root_key(cache_salt: str | None = None, lora_key: str | None = None) -> bytes:
    """The key the first page of a sequence chains from: distinct per (`cache_salt`, LoRA
    adapter `lora_key`), so requests differing in either never share a page. Each field is
    its UTF-8 length (8 bytes, -1 for None) then its bytes: joining them with a separator
    instead would let a salt holding that separator equal another salt and adapter."""
    fields = b""
    for value in (cache_salt, lora_key):
        data = b"" if value is None else value.encode("utf-8", "surrogatepass")
        fields += struct.pack("<q", -1 if value is None else len(data)) + data
    return hashlib.sha256(b"jaxserve-prefix\0" + fields).digest()


def page_key(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    """SHA-256 of a full page: the key of the page before it (or the root) and its tokens."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


PageKey = Callable[[bytes, tuple[int, ...]], bytes]


class PageAllocator:
    """Hands out page ids; tracks sharing and the prefix cache."""

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True,
                 key_of: PageKey = page_key):
        if num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is padding), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.key_of = key_of
        self._refcount = [0] * num_pages
        self._free = collections.deque(range(1, num_pages))  # unkeyed pages, count 0
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._page_of_hash: dict[bytes, int] = {}
        self._hash_of_page: dict[int, bytes] = {}
        # What each keyed page holds, checked on every hit: (parent key, tokens).
        self._content_of_page: dict[int, tuple[bytes, tuple[int, ...]]] = {}
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found

    def stats(self) -> dict[str, int]:
        """Prefix-cache counters, for the engine's `stats()`."""
        return {"prefix_cache_queries": self.prefix_queries,
                "prefix_cache_hits": self.prefix_hits}

    @property
    def num_free_pages(self) -> int:
        """Pages that `allocate` can hand out now (free or evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of usable pages held by sequences (0..1)."""
        return 1.0 - self.num_free_pages / (self.num_pages - 1)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def allocate(self, count: int) -> list[int] | None:
        """`count` fresh pages, or None (nothing taken) if there are not enough."""
        if count > self.num_free_pages:
            return None
        pages = []
        for _ in range(count):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._evictable.popitem(last=False)  # least recently used
                del self._page_of_hash[self._hash_of_page.pop(page)]
                del self._content_of_page[page]
            self._refcount[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page; unreferenced keyed pages stay cached."""
        for page in reversed(pages):  # the tail of a sequence is evicted first
            self._refcount[page] -= 1
            if self._refcount[page] < 0:
                raise RuntimeError(f"page {page} freed more often than allocated")
            if self._refcount[page] == 0:
                if page in self._hash_of_page:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    def forget(self, pages: list[int]) -> None:
        """Take `pages` out of the prefix cache (their contents are not to be trusted); an
        unreferenced one becomes free."""
        for page in pages:
            key = self._hash_of_page.pop(page, None)
            if key is None:
                continue
            del self._page_of_hash[key]
            del self._content_of_page[page]
            if page in self._evictable:
                del self._evictable[page]
                self._free.append(page)

    def forget_all(self) -> None:
        """Empty the prefix cache (the KV cache behind it was lost)."""
        self.forget(list(self._hash_of_page))

    def match_prefix(self, token_ids: list[int],
                     root: bytes | None = None) -> tuple[list[int], list[bytes]]:
        """Cached pages of the longest prefix of `token_ids` made of full pages, with their
        keys, chained from `root` (`root_key` of the sequence; None: `root_key()`); the
        pages are referenced for the caller. At least one token is left uncomputed, since
        the step that computes it produces the next token's logits."""
        if not self.enable_prefix_caching:
            return [], []
        usable = (len(token_ids) - 1) // self.page_size
        self.prefix_queries += len(token_ids)
        pages, hashes, parent = [], [], root or root_key()
        for i in range(usable):
            tokens = tuple(token_ids[i * self.page_size:(i + 1) * self.page_size])
            key = self.key_of(parent, tokens)
            page = self.cached(key, parent, tokens)
            if page is None:
                break
            self.hold([page])
            pages.append(page)
            hashes.append(key)
            parent = key
        self.prefix_hits += len(pages) * self.page_size
        return pages, hashes

    def unmatch(self, pages: list[int]) -> None:
        """Give back pages `match_prefix` matched that the caller cannot use after all (the
        tail of its match): freed, and no longer counted as hits."""
        self.free(pages)
        self.prefix_hits -= len(pages) * self.page_size

    def cached(self, key: bytes, parent: bytes, tokens: tuple[int, ...]) -> int | None:
        """The cached page keyed `key` if it holds `tokens` after `parent`, else None
        (nothing referenced)."""
        page = self._page_of_hash.get(key)
        if page is None or self._content_of_page[page] != (parent, tokens):
            return None
        return page

    def hold(self, pages: list[int]) -> None:
        """Reference cached pages (`cached`) for a sequence that reuses them."""
        for page in pages:
            if self._refcount[page] == 0:
                del self._evictable[page]
            self._refcount[page] += 1

    def register_full_pages(self, token_ids: list[int], pages: list[int],
                            page_hashes: list[bytes], num_computed: int,
                            root: bytes | None = None) -> None:
        """Key the pages that `num_computed` tokens have filled, chained from `root` (as in
        `match_prefix`); extends `page_hashes`."""
        if not self.enable_prefix_caching:
            return
        full = num_computed // self.page_size
        for i in range(len(page_hashes), full):
            parent = page_hashes[-1] if page_hashes else (root or root_key())
            tokens = tuple(token_ids[i * self.page_size:(i + 1) * self.page_size])
            key = self.key_of(parent, tokens)
            page_hashes.append(key)
            self.key_page(pages[i], key, parent, tokens)

    def key_page(self, page: int, key: bytes, parent: bytes, tokens: tuple[int, ...]) -> None:
        """Enter a full page in the prefix cache under `key` (unless the key or the page is
        already there)."""
        if key not in self._page_of_hash and page not in self._hash_of_page:
            self._page_of_hash[key] = page
            self._hash_of_page[page] = key
            self._content_of_page[page] = (parent, tokens)
