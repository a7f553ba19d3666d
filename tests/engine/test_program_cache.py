"""Engines in one process share their compiled programs, so native resources stay bounded:
a second engine of the same architecture and options compiles nothing and maps (almost) no
memory, and each engine still answers with its own weights (checked against transformers)."""

import torch

from jaxserve import LLM, SamplingParams
from jaxserve.engine.program_cache import memory_mappings, process_programs
from tiny_models import LADDERS, SMALL_ENGINE, build_model

PROMPT = [0, 5, 9, 22, 7]
NEW_TOKENS = 8
# Unshared, each of these engines maps ~5,300 more on XLA:CPU (~880 per program); shared,
# the later ones map a handful (threads, allocator arenas), well under this.
MAPPINGS_FOR_TWO_MORE_ENGINES = 1000


def transformers_greedy(hf_model) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def test_engines_with_the_same_programs_share_them(tmp_path):
    hf_models, engines = [], []
    mappings = [memory_mappings()[0]]
    for seed in range(3):  # one architecture, three sets of weights
        folder = tmp_path / f"model{seed}"
        hf_models.append(build_model("llama", folder, seed=seed))
        engines.append(LLM(str(folder), dtype="float32", progress=False, **SMALL_ENGINE))
        mappings.append(memory_mappings()[0])
    held = [dict(engine.engine.runner._compiled) for engine in engines]  # bucket → program
    assert len(held[0]) == 2  # one step program, one decode loop
    # the later engines compiled nothing: they run the first one's executables
    assert all(other[bucket] is program for other in held[1:]
               for bucket, program in held[0].items())
    assert process_programs() >= len(held[0])
    print(f"\nmemory mappings: before {mappings[0]}, after each engine {mappings[1:]}")
    assert mappings[3] - mappings[1] < MAPPINGS_FOR_TWO_MORE_ENGINES
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for hf_model, engine in zip(hf_models, engines):
        out = engine.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0]
        assert out.token_ids == transformers_greedy(hf_model)


def test_other_options_compile_their_own_programs(tmp_path):
    build_model("llama", tmp_path)
    small = LLM(str(tmp_path), dtype="float32", progress=False, **SMALL_ENGINE)
    other = LLM(str(tmp_path), dtype="float32", progress=False,
                **{**SMALL_ENGINE, **LADDERS, "num_pages": 20})  # as test_engine's workload
    held = [llm.engine.stats().compiled_programs for llm in (small, other)]
    assert held == [2, 6]  # (step + decode), (2 x 2 steps + 2 decode loops)
    assert process_programs() >= sum(held)
