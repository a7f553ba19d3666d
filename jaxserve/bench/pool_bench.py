"""`jaxserve bench pool`: a single request's decode step time at several KV pool sizes.

A step reads the weights and the pages its rows own, so its time must not depend on how many
pages the pool holds; a program that copies or scans a whole pool (`jaxserve.engine.
cache_audit` is the structural guard) shows here as a step time growing with the pool. For
each `--num-pages` (`default`: as the engine sizes the cache) it builds the engine with
otherwise default options, decodes one prompt of `--prompt-len` tokens for `--output-len`
tokens, and prints the mean step time between the first token and the last, and the ratio of
the slowest to the fastest. Without `--model`, the random ~60M Llama of `bench offline`.
"""

from __future__ import annotations

import argparse
import tempfile

import numpy as np


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF model folder (default: random ~60M)")
    parser.add_argument("--num-pages", nargs="+", default=["256", "2048", "default"],
                        help="pool sizes to measure (`default`: the engine's own)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3, help="requests per size (best kept)")


def step_time(folder: str, num_pages: int | None, args) -> tuple[int, float]:
    """(pages in the pool, best mean decode step of `--repeats` single requests, seconds)."""
    from jaxserve import LLM, SamplingParams
    from jaxserve.bench.offline_bench import decode_step_seconds

    options = {} if num_pages is None else {"num_pages": num_pages}
    llm = LLM(folder, dtype=args.dtype, progress=False, **options)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    prompt = np.random.default_rng(0).integers(3, 1000, args.prompt_len).tolist()
    best = min(decode_step_seconds(engine, f"pool-{i}", prompt, params)
               for i in range(args.repeats))
    pages = engine.runner.num_pages
    engine.release()  # the next size's cache takes its memory
    return pages, best


def run_from_args(args: argparse.Namespace) -> int:
    from jaxserve.bench.offline_bench import model_folder

    sizes = [None if n == "default" else int(n) for n in args.num_pages]
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        folder = model_folder(args.model, scratch)
        for size in sizes:
            print(f"num_pages {size or 'default'}: building the engine (compiles every "
                  "bucket) and decoding ...", flush=True)
            pages, seconds = step_time(folder, size, args)
            results.append((size, pages, seconds))
            print(f"  {pages} pages: {seconds * 1e3:.2f} ms a decode step", flush=True)
    print(f"\nbatch-1 decode step ({args.prompt_len}-token prompt, {args.output_len} new "
          f"tokens, {args.dtype}, default options but num_pages)")
    print(f"{'num_pages':>12}{'pages':>8}{'ms/step':>10}")
    for size, pages, seconds in results:
        print(f"{size or 'default':>12}{pages:>8}{seconds * 1e3:>10.2f}")
    times = [seconds for _, _, seconds in results]
    print(f"slowest / fastest: {max(times) / min(times):.2f}x (flat: about 1)")
    return 0
