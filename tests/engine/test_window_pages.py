"""Hybrid KV memory (`jaxserve.engine.window_pages`): the window pool's size, pages freed as a
sequence slides past them, vLLM's prefix-cache rule and the cache's sizing, each against
hand-counted cases (no jax programs)."""

import jax.numpy as jnp
import pytest

from jaxserve.config.engine import EngineConfig
from jaxserve.engine.kv_cache import page_bytes, pages_for_memory
from jaxserve.engine.page_allocator import PageAllocator
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.sequence import Sequence
from jaxserve.config.window import WindowLayout
from jaxserve.engine.window_pages import (WindowPages, window_layout,
                                          window_pool_pages)
from jaxserve.model.config import ModelConfig
from jaxserve.sampling_params import SamplingParams

pytestmark = pytest.mark.quick  # seconds, no engine: `pytest -m quick`

WINDOW = 20  # tokens; pages of 16: a token sees its own page and at most 2 before it


def model_config(layer_types=("sliding_attention", "full_attention") * 2, window=WINDOW):
    return ModelConfig(model_type="gemma3_text", vocab_size=64, hidden_size=32,
                       intermediate_size=64, num_layers=len(layer_types), num_heads=4,
                       num_kv_heads=2, head_dim=8, sliding_window=window,
                       layer_types=tuple(layer_types))


def test_window_pool_holds_every_sequences_window_and_a_step_ahead():
    config = EngineConfig(max_model_len=128, page_size=16, max_num_seqs=4,
                          max_num_batched_tokens=64, num_decode_steps=8)
    # a sequence: ceil(39 / 16) + 2 = 5 pages; the step ahead: max(64, 4 x 8) tokens = 4
    # pages; and the padding page
    assert window_pool_pages(config, 40) == 1 + 4 * 5 + 4
    spec = EngineConfig(max_model_len=128, page_size=16, max_num_seqs=4,
                        max_num_batched_tokens=64, num_decode_steps=8,
                        speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert window_pool_pages(spec, 40) == 1 + 4 * 5 + 4 * 8 * 4 // 16
    # never more than every sequence at full length
    assert window_pool_pages(config, 127) == 1 + 4 * 8


def test_window_layers_are_those_shorter_than_max_model_len():
    config = EngineConfig(max_model_len=128, page_size=16)
    assert window_layout(model_config(), config) == WindowLayout(
        (0, 2), WINDOW, window_pool_pages(config, WINDOW))
    # a window the context never outgrows frees nothing
    assert window_layout(model_config(window=128), config) is None
    assert window_layout(model_config(), EngineConfig(
        max_model_len=128, disable_hybrid_kv_cache_manager=True)) is None


def scheduler(budget=16, window_pages=12, caching=False):
    config = EngineConfig(max_model_len=128, page_size=16, num_pages=40, max_num_seqs=4,
                          max_num_batched_tokens=budget, enable_prefix_caching=caching)
    windows = WindowPages(WindowLayout((0,), WINDOW, window_pages),
                          PageAllocator(window_pages, 16, caching))
    return Scheduler(config, PageAllocator(40, 16, caching), windows=windows)


def sequence(name, prompt):
    return Sequence(name, list(prompt), SamplingParams(max_tokens=4), seed=0,
                    max_new_tokens=4, stop_token_ids=frozenset())


def run(sched):
    """Schedule a step and book it as run, every sampling row drawing token 7."""
    out = sched.schedule()
    sched.postprocess(out, [[7] * c.samples for c in out.chunks],
                      [c.num_tokens for c in out.chunks])
    return out


def test_pages_slide_out_of_the_window_as_the_sequence_advances():
    sched = scheduler(budget=16)
    pool = sched.windows.allocator
    seq = sequence("a", range(1, 61))
    sched.add(seq)
    # chunks of 16: before computing tokens [n, n + 16) it needs pages from position
    # n - 19 on: from n = 48 that is page 1 (positions 29..), so page 0 goes
    expected = {0: [1], 16: [1, 2], 32: [1, 2, 3], 48: [0, 2, 3, 4]}
    for start, window_pages in expected.items():
        assert seq.num_computed_tokens == start
        run(sched)
        assert seq.window_pages == window_pages
        assert pool.num_free_pages == 11 - sum(p > 0 for p in window_pages)
    assert len(seq.pages) == 4  # the full-context table keeps every page
    run(sched)  # decoding at 60, which sees 41..60: page 1 goes too
    assert seq.window_pages == [0, 0, 3, 4]
    sched.abort("a")
    assert pool.num_free_pages == 11 and sched.allocator.num_free_pages == 39


def test_window_pool_running_dry_preempts_like_the_full_pool():
    sched = scheduler(budget=64, window_pages=4)  # 3 usable window pages
    first, second = sequence("a", range(1, 17)), sequence("b", range(40, 56))
    sched.add(first)
    run(sched)  # a: 16 tokens, 1 window page
    sched.add(second)
    run(sched)  # a decodes at 16 (a second page), b prefills 16 tokens (1 page)
    assert [s.request_id for s in sched.running] == ["a", "b"]
    assert first.window_pages == [1, 2] and second.window_pages == [3]
    # b decodes at 16 and needs a second page: none is left, though the full pool has 35
    out = sched.schedule()
    assert sched.allocator.num_free_pages > 30
    assert [s.request_id for s in out.preempted] == ["b"]
    assert [c.seq.request_id for c in out.chunks] == ["a"]
    assert second.window_pages == [] and second.pages == []


def test_a_prefix_is_reused_only_as_far_as_its_window_pages_are_cached():
    sched = scheduler(budget=64, window_pages=12, caching=True)
    prompt = list(range(1, 66))  # 4 full pages and one token
    first = sequence("a", prompt)
    sched.add(first)
    run(sched)  # 64 tokens computed: pages 0-3 keyed in both pools
    keyed, full = list(first.window_pages), list(first.pages)
    run(sched)  # the last prompt token, at 64: window pages 0 and 1 slid out (still keyed)
    sched.abort("a")
    assert sched.windows.allocator.num_free_pages == 11  # cached pages are evictable
    # the window page of positions 48..63 is lost: a token at 64 needs pages 2 and 3, so
    # the 4-page prefix is useless; at 48 it needs pages 1 and 2, which are cached
    sched.windows.allocator.forget([keyed[3]])
    second = sequence("b", prompt)
    sched.add(second)
    sched.schedule()
    assert second.num_computed_tokens == 48 and len(second.pages) == 5
    assert second.window_pages[:3] == [0, keyed[1], keyed[2]]
    assert second.pages[:3] == full[:3] and sched.allocator.refcount(full[3]) == 0
    assert sched.allocator.prefix_hits == 48  # the unusable page is not counted as a hit


def test_the_window_pool_is_sized_first_and_the_rest_goes_to_full_context_pages():
    model = model_config()  # 2 window layers, 2 full: a page of one layer's K and V in
    layer_page = 2 * 16 * 2 * 8 * 4  # float32 is 2 x 16 tokens x 2 heads x 8 x 4 bytes
    assert page_bytes(model, 16, jnp.float32) == 4 * layer_page
    config = EngineConfig(max_model_len=1024, page_size=16, max_num_seqs=4,
                          max_num_batched_tokens=64, kv_cache_memory_fraction=0.5)
    window = window_layout(model, config)
    assert window.num_pages == 1 + 4 * 4 + 4  # ceil(19 / 16) + 2 a sequence, 64 tokens ahead
    budget = (10 - 2) * 2**20 // 2  # half of what 10 MiB leave after 2 MiB of weights
    hybrid = pages_for_memory(model, config, jnp.float32, 10 * 2**20, 2 * 2**20,
                              window=window)
    assert hybrid == (budget - window.num_pages * 2 * layer_page) // (2 * layer_page)
    flat = pages_for_memory(model, config, jnp.float32, 10 * 2**20, 2 * 2**20)
    assert flat == budget // (4 * layer_page)
    assert (hybrid - 1) // 64 == 15 and (flat - 1) // 64 == 7  # full-length sequences
    # a window pool larger than the cache's share is refused by name
    with pytest.raises(ValueError, match="window pool .* max_num_seqs=4"):
        pages_for_memory(model, config, jnp.float32, 2 * 2**20 + 2 * window.num_pages
                         * 2 * layer_page - 1, 2 * 2**20, window=window)
