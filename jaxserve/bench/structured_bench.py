"""`jaxserve bench structured`: the cost of structured output, free and constrained requests
side by side in one run, with default engine options.

Three batches of `--num-prompts` requests, each submitted at once through `LLM.generate`
(every request "final_only", as a non-streaming client sends them), each generating up to
`--output-len` tokens at temperature 0.8:
- free: no constraint (eos ignored), so the decode loop runs `num_decode_steps` steps per
  host round trip;
- constrained: every request under a JSON schema (an array of short strings, long enough
  that most requests run to `--output-len`): the engine computes each row's bitmask on the
  host after every token and decodes one step at a time;
- mixed: half of each, in one batch (the free half also decodes one step at a time, since
  the batch holds constrained rows).
Printed per batch: output tokens, seconds, output tokens/s, and the ratio to free; plus the
host time per mask row (llguidance) and the grammar compile time, cold and cached.
"""

from __future__ import annotations

import argparse
import time

SCHEMA = {"type": "object",
          "properties": {"words": {"type": "array", "maxItems": 200,
                                   "items": {"type": "string", "maxLength": 12}}},
          "required": ["words"]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF model folder (default: the shipped one)")
    parser.add_argument("--config", default=None, help="deployment preset (default: platform's)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)


def run_from_args(args: argparse.Namespace) -> int:
    import numpy as np

    from jaxserve import LLM, SamplingParams
    from jaxserve.default_model import DEFAULT_MODEL_DIR
    from jaxserve.structured_output import StructuredOutputsParams

    print("loading and compiling (default engine options)...", flush=True)
    llm = LLM(args.model or str(DEFAULT_MODEL_DIR), config=args.config)
    prompts = [f"Chapter {i}. It was a fine morning when" for i in range(args.num_prompts)]
    free = [SamplingParams(temperature=0.8, seed=i, max_tokens=args.output_len,
                           ignore_eos=True, output_kind="final_only")
            for i in range(args.num_prompts)]
    structured = StructuredOutputsParams(json=SCHEMA)
    constrained = [SamplingParams(temperature=0.8, seed=i, max_tokens=args.output_len,
                                  structured_outputs=structured, output_kind="final_only")
                   for i in range(args.num_prompts)]
    half = args.num_prompts // 2
    batches = {"free": free, "constrained": constrained,
               "mixed": free[:half] + constrained[half:]}
    llm.generate(prompts[:2], free[:2])  # first calls outside the timing
    llm.generate(prompts[:2], constrained[:2])
    rates = {}
    print(f"{'batch':<12} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'vs free':>8}")
    for name, params in batches.items():
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        rates[name] = tokens / seconds
        print(f"{name:<12} {tokens:>7} {seconds:>8.2f} {rates[name]:>8.1f} "
              f"{rates[name] / rates['free']:>8.2f}", flush=True)

    compiler = llm.engine.grammar_compiler()
    fresh = StructuredOutputsParams(json={**SCHEMA, "title": f"bench {time.time()}"})
    start = time.perf_counter()
    matcher = compiler.compile(fresh)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    compiler.compile(fresh)
    cached = time.perf_counter() - start
    row = np.zeros(compiler.mask_words, np.int32)
    start = time.perf_counter()
    for _ in range(200):
        matcher.fill_bitmask(row)
    per_row = (time.perf_counter() - start) / 200
    print(f"grammar compile: {cold * 1e3:.2f} ms cold, {cached * 1e3:.3f} ms cached; "
          f"bitmask: {per_row * 1e6:.1f} us per row ({compiler.mask_words} words)")
    return 0
