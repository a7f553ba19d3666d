"""Serving while the larger buckets compile: requests run on the smallest rung's programs
with transformers' tokens, the caps rise as programs land, and nothing compiles after."""

import threading

import pytest
import transformers

from jaxserve.engine.background_compile import fits, rungs
from jaxserve.config.engine import EngineConfig
from jaxserve.engine.engine import Engine
from jaxserve.engine.runner import CompileAfterWarmupError, Runner
from jaxserve.model.hf_config import load_config
from jaxserve.loading.tokenizer import Tokenizer
from jaxserve.loading.weights import load_weights
from jaxserve.sampling_params import SamplingParams
from tiny_models import LADDERS, SMALL_ENGINE, transformers_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# tokens 16/64 and rows 2/8: rung 0 is step (16, 2) and decode 2; rung 1 the other four
SMALLEST = {("step", 16, 2), ("decode", 2, 2)}


def test_rungs_climb_both_ladders_and_hold_every_program():
    config = EngineConfig(**{**SMALL_ENGINE, **LADDERS})
    everything = [("step", t, s) for t in (16, 64) for s in (2, 8)] + [
        ("decode", 2, 2), ("decode", 8, 8)]
    ladder = rungs(config, everything)
    assert [(r.max_tokens, r.max_rows) for r in ladder] == [(16, 2), (64, 8)]
    assert set(ladder[0].buckets) == SMALLEST
    assert sorted(b for r in ladder for b in r.buckets) == sorted(everything)
    # a ladder of rows longer than the tokens': the token cap stays at its top
    tall = EngineConfig(**{**SMALL_ENGINE, "token_buckets": (64,), "seq_buckets": (1, 2, 8)})
    programs = [(kind, 64 if kind == "step" else s, s) for s in (1, 2, 8)
                for kind in ("step", "decode")]
    assert [(r.max_tokens, r.max_rows) for r in rungs(tall, programs)] == [
        (64, 1), (64, 2), (64, 8)]
    assert not fits(("step", 64, 2), 16, 8) and fits(("decode", 8, 8), 16, 8)


@pytest.fixture
def gated_compiles(monkeypatch):
    """Background compiles wait for the returned event (warm-up's own do not)."""
    gate = threading.Event()
    build = Runner.build_program

    def gated(self, kind, tokens, rows, shared_args=None, quick=False):
        if shared_args is not None:
            assert gate.wait(timeout=600)
        return build(self, kind, tokens, rows, shared_args=shared_args, quick=quick)

    monkeypatch.setattr(Runner, "build_program", gated)
    return gate


def test_serves_before_background_compiles_land_then_never_compiles(folder, gated_compiles):
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    # without the executable store, rung 0 is compiled quick (CPU: -O0), then in full
    config = EngineConfig(**{**SMALL_ENGINE, **LADDERS, "compile_in_background": True,
                             "strict_compile": True, "executable_cache": False})
    engine = Engine(load_weights(folder, load_config(folder), progress=False), config,
                    Tokenizer(folder), [1], progress=False)
    runner, scheduler = engine.runner, engine.replicas[0].scheduler
    assert engine.warming and engine.programs_ready() == (2, 6)
    assert set(runner._compiled) == SMALLEST
    quick_keys = {bucket: runner._program_keys[bucket] for bucket in SMALLEST}
    assert (scheduler.max_num_batched_tokens, scheduler.max_num_seqs) == (16, 2)
    with pytest.raises(CompileAfterWarmupError, match="background"):
        runner.program("step", 64, 8)

    # two rows a step of 16 tokens: step 1 is the first prompt's first chunk, step 2 its
    # last and all of the second (rows 0 and 1 sample), the third prompt waits for a row
    prompts = [[0] + list(range(5, 25)), [0] + list(range(40, 47)), [0] + list(range(9, 31))]
    sequences = [engine.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    engine.step()
    engine.step()  # in flight: the tokens rows 0 and 1 sampled are still on device only
    gated_compiles.set()
    runner.background.join(timeout=600)
    assert engine.warming  # landed, not yet taken in: the next step takes them in
    while engine.has_unfinished():
        engine.step()
    assert not engine.warming and engine.programs_ready() == (6, 6)
    assert (scheduler.max_num_batched_tokens, scheduler.max_num_seqs) == (64, 8)
    assert all(runner._program_keys[bucket] != quick_keys[bucket] for bucket in SMALLEST)
    assert engine.startup_seconds["background_compile"] > 0
    for seq, prompt in zip(sequences, prompts):
        assert seq.output_token_ids == transformers_greedy(hf_model, prompt, 6)

    # every bucket now runs, and none compiles
    used = []
    program = runner.program
    runner.program = lambda *bucket: used.append(bucket) or program(*bucket)
    wide = [[0] + list(range(3 + i, 40 + i)) for i in range(8)]
    batch = [engine.add_request(f"w{i}", p, GREEDY) for i, p in enumerate(wide)]
    while engine.has_unfinished():
        engine.step()
    assert ("step", 64, 8) in used and runner.compiles_after_warmup == 0
    for seq, prompt in zip(batch[:2], wide):
        assert seq.output_token_ids == transformers_greedy(hf_model, prompt, 6)
