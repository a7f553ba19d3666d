"""Scheduler: token budget, chunked prefill, preemption, multi-step decode (no jax)."""

import pytest

from jaxserve.config.engine import EngineConfig
from jaxserve.engine.page_allocator import PageAllocator
from jaxserve.sampling_params import SamplingParams
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.sequence import Sequence, Status

pytestmark = pytest.mark.quick  # seconds, no engine: `pytest -m quick`


def make_scheduler(num_pages=40, budget=32, max_num_seqs=4, decode_steps=4, caching=False):
    config = EngineConfig(max_model_len=64, page_size=16, num_pages=num_pages,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          num_decode_steps=decode_steps, enable_prefix_caching=caching)
    return Scheduler(config, PageAllocator(num_pages, 16, caching))


def seq(name, prompt_len, max_new=8, output_kind="final_only"):
    params = SamplingParams(max_tokens=max_new, output_kind=output_kind)
    return Sequence(name, list(range(1, prompt_len + 1)), params, seed=0,
                    max_new_tokens=max_new, stop_token_ids=frozenset())


def run_step(sched, out):
    """Pretend the device ran the step: every row due a token samples 7."""
    steps = out.num_decode_steps
    sampled = [[7] * steps if steps > 1 else [7] * chunk.samples for chunk in out.chunks]
    fed = [steps if steps > 1 else chunk.num_tokens for chunk in out.chunks]
    return sched.postprocess(out, sampled, fed)


def test_long_prompt_is_chunked_within_the_budget():
    sched = make_scheduler(budget=32)
    long = seq("long", 50)
    sched.add(long)
    out = sched.schedule()
    assert [(c.seq.request_id, c.num_tokens, c.samples)
            for c in out.chunks] == [("long", 32, False)]
    run_step(sched, out)
    out = sched.schedule()
    assert [(c.num_tokens, c.samples) for c in out.chunks] == [(18, True)]


def test_decode_tokens_go_first_then_prefill_fills_the_rest():
    sched = make_scheduler(budget=32)
    a = seq("a", 10)
    sched.add(a)
    run_step(sched, sched.schedule())  # a prefilled, now decoding
    sched.add(seq("b", 40))
    out = sched.schedule()
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 31)]
    assert out.num_decode_steps == 1  # a prefill is in the step


def test_all_decode_step_runs_several_decode_steps_with_pages_reserved():
    sched = make_scheduler(decode_steps=4)
    a = seq("a", 15)
    sched.add(a)
    run_step(sched, sched.schedule())
    out = sched.schedule()
    assert out.num_decode_steps == 4
    assert len(a.pages) * 16 >= a.num_computed_tokens + 4


@pytest.mark.parametrize("limit, steps", [(1, 1), (3, 3), (16, 4)])
def test_a_decode_loop_is_capped_by_the_callers_limit(limit, steps):
    sched = make_scheduler(decode_steps=4)
    a = seq("a", 15)
    sched.add(a)
    run_step(sched, sched.schedule())
    out = sched.schedule(max_decode_steps=limit)
    assert out.decode_only and out.num_decode_steps == steps
    assert len(a.pages) == -(-(a.num_computed_tokens + steps) // 16)  # pages for those only


def test_a_streamed_request_decodes_one_token_per_step_for_its_whole_batch():
    sched = make_scheduler(decode_steps=4, budget=64)
    batch = seq("batch", 15), seq("streamed", 15, output_kind="delta")
    for s in batch:
        sched.add(s)
    run_step(sched, sched.schedule())
    out = sched.schedule()
    assert out.decode_only and out.num_decode_steps == 1
    assert all(len(s.pages) == 1 for s in batch)  # no pages reserved for later steps


def test_max_num_seqs_limits_admission():
    sched = make_scheduler(max_num_seqs=2, budget=64)
    for i in range(3):
        sched.add(seq(f"r{i}", 5))
    out = sched.schedule()
    assert [c.seq.request_id for c in out.chunks] == ["r0", "r1"]
    assert [s.request_id for s in sched.waiting] == ["r2"]


def test_out_of_pages_preempts_the_newest_and_it_recomputes_later():
    # 5 usable pages of 16 tokens; two 30-token prompts take 2 pages each.
    sched = make_scheduler(num_pages=6, budget=64, decode_steps=1)
    old, new = seq("old", 30, max_new=30), seq("new", 31, max_new=30)
    sched.add(old)
    sched.add(new)
    run_step(sched, sched.schedule())
    for _ in range(3):  # decode until both need a third page and only one is left
        out = sched.schedule()
        run_step(sched, out)
        if out.preempted:
            break
    assert out.preempted == [new] and new.status is Status.WAITING
    assert new.pages == [] and new.num_computed_tokens == 0
    assert [c.seq for c in out.chunks] == [old]
    assert sched.num_preemptions == 1
    sched.abort("old")
    out = sched.schedule()
    assert out.chunks[0].seq is new and out.chunks[0].num_tokens == new.num_tokens


def test_abort_frees_pages_wherever_the_request_is():
    sched = make_scheduler()
    a, b = seq("a", 20), seq("b", 20)
    sched.add(a)
    run_step(sched, sched.schedule())
    sched.add(b)
    free_before = sched.allocator.num_free_pages
    assert sched.abort("a") is a and a.finish_reason == "abort"
    assert sched.allocator.num_free_pages == free_before + 2
    assert sched.abort("b") is b and not sched.has_work()
    assert sched.abort("missing") is None


@pytest.mark.parametrize("field, kwargs", [
    ("page_size", dict(page_size=20)),
    ("max_num_batched_tokens", dict(max_num_batched_tokens=8)),
    ("max_num_batched_tokens", dict(max_num_batched_tokens=32, max_num_seqs=64)),
    ("num_pages", dict(num_pages=3)),
    ("kv_cache_memory_fraction", dict(kv_cache_memory_fraction=1.5)),
    ("gpu_memory_utilization", dict(gpu_memory_utilization=0.0)),
    ("token_buckets", dict(token_buckets=(16, 32))),
    ("attention_backend", dict(attention_backend="cuda")),
    ("num_decode_steps", dict(num_decode_steps=0)),
])
def test_engine_config_rejects_values_that_cannot_work(field, kwargs):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{"max_model_len": 64, **kwargs})


def test_default_ladders_are_powers_of_two_up_to_the_limits():
    config = EngineConfig(max_num_batched_tokens=256, max_num_seqs=24)
    assert config.token_buckets == (16, 32, 64, 128, 256)
    assert config.seq_buckets == (1, 2, 4, 8, 16, 24)
