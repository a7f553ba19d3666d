"""Page allocator: reference counts, the prefix cache and LRU eviction (no jax)."""

import pytest

from jaxserve.engine.page_allocator import PageAllocator, root_key

pytestmark = pytest.mark.quick  # seconds, no engine: `pytest -m quick`

PAGE = 4


def test_pages_are_unique_and_page_zero_is_never_given():
    alloc = PageAllocator(num_pages=9, page_size=PAGE)
    pages = alloc.allocate(8)
    assert sorted(pages) == list(range(1, 9))
    assert alloc.allocate(1) is None and alloc.usage == 1.0
    alloc.free(pages)
    assert alloc.num_free_pages == 8 and alloc.usage == 0.0


def test_allocation_is_all_or_nothing():
    alloc = PageAllocator(num_pages=5, page_size=PAGE)
    assert alloc.allocate(5) is None
    assert alloc.num_free_pages == 4


def test_double_free_is_caught():
    alloc = PageAllocator(num_pages=5, page_size=PAGE)
    pages = alloc.allocate(1)
    alloc.free(pages)
    with pytest.raises(RuntimeError, match="freed more often"):
        alloc.free(pages)


def _fill(alloc, tokens):
    """Allocate and register pages for `tokens` as if a step had computed them all."""
    pages = alloc.allocate(-(-len(tokens) // PAGE))
    hashes = []
    alloc.register_full_pages(tokens, pages, hashes, len(tokens))
    return pages, hashes


def test_prefix_is_shared_and_stops_at_first_difference():
    alloc = PageAllocator(num_pages=20, page_size=PAGE)
    first = list(range(13))  # 3 full pages + 1 token
    pages, hashes = _fill(alloc, first)
    assert len(hashes) == 3
    other = list(range(8)) + [99, 99, 99, 99, 5]  # same first 2 pages only
    hit, hit_hashes = alloc.match_prefix(other)
    assert hit == pages[:2] and hit_hashes == hashes[:2]
    assert [alloc.refcount(p) for p in pages] == [2, 2, 1, 1]
    assert (alloc.prefix_queries, alloc.prefix_hits) == (13, 8)


def test_a_fully_cached_prompt_still_leaves_one_token_to_compute():
    alloc = PageAllocator(num_pages=20, page_size=PAGE)
    tokens = list(range(8))
    _fill(alloc, tokens)
    hit, _ = alloc.match_prefix(tokens)
    assert len(hit) == 1  # (8 - 1) // 4: the last page is recomputed for its logits


def test_same_page_contents_after_a_different_prefix_do_not_match():
    alloc = PageAllocator(num_pages=20, page_size=PAGE)
    _fill(alloc, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    hit, _ = alloc.match_prefix([9, 9, 9, 9, 5, 6, 7, 8, 0])
    assert hit == []


def test_freed_cached_pages_stay_until_evicted_least_recently_used_first():
    alloc = PageAllocator(num_pages=5, page_size=PAGE)  # 4 usable pages
    a_pages, _ = _fill(alloc, [1] * 8 + [0])  # 3 pages, 2 of them keyed
    alloc.free(a_pages)
    assert alloc.num_free_pages == 4
    hit, _ = alloc.match_prefix([1] * 8 + [7])
    assert hit == a_pages[:2]  # still cached after being freed
    alloc.free(hit)  # the tail page is freed first, so it is the least recently used
    fresh = alloc.allocate(3)  # the 2 unkeyed pages, then 1 eviction
    assert a_pages[1] in fresh and a_pages[0] not in fresh
    assert alloc.match_prefix([1] * 8 + [7])[0] == [a_pages[0]]  # evicted key forgotten
    assert alloc.allocate(1) is None


def test_prefix_caching_off_never_matches():
    alloc = PageAllocator(num_pages=20, page_size=PAGE, enable_prefix_caching=False)
    _fill(alloc, list(range(13)))
    assert alloc.match_prefix(list(range(13))) == ([], [])


def test_page_keys_are_sha256_chained_from_the_salt():
    """Each key is SHA-256 of the parent key and the page's tokens (int64), from a root that
    hashes the cache salt and the LoRA adapter's key, each as its length (int64, -1 for
    none) then its UTF-8 bytes; recomputed here with hashlib."""
    import hashlib
    import struct
    alloc = PageAllocator(num_pages=20, page_size=PAGE)
    tokens = list(range(9))
    _, keys = _fill(alloc, tokens)
    salted = PageAllocator(num_pages=20, page_size=PAGE)
    salted_keys = []
    salted.register_full_pages(tokens, salted.allocate(3), salted_keys, 9,
                               root=root_key("t1", "k"))
    for (salt, lora), got in (((None, None), keys), (("t1", "k"), salted_keys)):
        fields = b"".join(struct.pack("<q", -1) if v is None
                          else struct.pack("<q", len(v)) + v.encode() for v in (salt, lora))
        parent = hashlib.sha256(b"jaxserve-prefix\0" + fields).digest()
        for i, key in enumerate(got):
            page = struct.pack(f"{PAGE}q", *tokens[i * PAGE:(i + 1) * PAGE])
            parent = hashlib.sha256(parent + page).digest()
            assert key == parent
    assert keys != salted_keys
    assert alloc.match_prefix(tokens, root=root_key("t1")) == ([], [])
    assert salted.match_prefix(tokens, root=root_key("t1\0lora:k")) == ([], [])
    assert len(salted.match_prefix(tokens, root=root_key("t1", "k"))[0]) == 2


def test_a_hit_must_hold_the_same_tokens_whatever_the_key_function():
    alloc = PageAllocator(num_pages=20, page_size=PAGE, key_of=lambda parent, tokens: b"k")
    pages, _ = _fill(alloc, list(range(8)))
    assert alloc.match_prefix(list(range(50, 59))) == ([], [])
    hit, _ = alloc.match_prefix(list(range(9)))
    assert hit == pages[:1]  # the second page's key is the first's: registered once only
