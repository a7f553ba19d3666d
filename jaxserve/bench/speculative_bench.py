"""`jaxserve bench spec`: the same engine with and without speculative decoding, side by side
in one run, at several concurrencies, on a workload that repeats itself and one that does not.

Workloads (prompts of `--prompt-len` tokens, `--output-len` new tokens each, greedy unless
`--temperature`):
- `copy`: a passage followed by its first tokens again, so that a model which copies (code
  edits, summaries that quote) continues it; prompt lookup finds the passage;
- `random`: random tokens;
- `text` (with `--prompts-file`): prompts cut from a text file at evenly spaced offsets,
  in the model's tokens, for a draft trained on text like it (the shipped model's
  `heldout.txt` for its EAGLE-3 head).
For each concurrency c in `--concurrency`, `--rounds` groups of c prompts are generated, each
group all at once. Reported per (workload, c): output tokens/s with and without speculation,
the speed-up, TPOT p50/p99 (each request's mean time per output token after its first), and
the acceptance rate (accepted / proposed draft tokens). Greedy outputs are checked equal.

Speculation costs the verification of k + 1 positions per round; where a step is not bound by
reading the weights (many rows, or a CPU's matmuls beyond one row) that cost can exceed what
the accepted drafts save. The last lines name where the speculative engine was slower and,
when that is every concurrency from some c up, the `disable_by_batch_size` (vLLM's option)
that turns speculation off there.

Without `--model` it builds the random ~60M Llama of `jaxserve bench offline`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxserve.bench.offline_bench import model_folder, parse_engine_options

DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, ' \
               '"prompt_lookup_min": 2}'


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF model folder (default: random ~60M)")
    parser.add_argument("--speculative-config", default=DEFAULT_SPEC,
                        help=f"the speculative engine's config (JSON; default {DEFAULT_SPEC})")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=2,
                        help="groups of `concurrency` prompts per measurement")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--prompts-file", default=None,
                        help="a text file: adds the `text` workload, prompts cut from it")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-option", action="append", default=[], metavar="NAME=VALUE",
                        help="an engine option for both engines (repeatable)")


def workloads(args, tokenizer, vocab: int,
              rng: np.random.Generator) -> dict[str, list[list[int]]]:
    """name → prompts, enough for the largest concurrency's rounds."""
    count = max(args.concurrency) * args.rounds
    passage = args.prompt_len - args.prompt_len // 4
    copies = []
    for _ in range(count):
        text = rng.integers(3, vocab, passage).tolist()
        copies.append(text + text[:args.prompt_len - passage])
    plain = [rng.integers(3, vocab, args.prompt_len).tolist() for _ in range(count)]
    out = {"copy": copies, "random": plain}
    if args.prompts_file is not None:
        out["text"] = text_prompts(args.prompts_file, tokenizer.encode, args.prompt_len, count)
    return out


def text_prompts(path: str, encode, length: int, count: int) -> list[list[int]]:
    """`count` prompts of `length` tokens of the file at `path` (`encode`: text → token
    ids, the model's tokenizer), at evenly spaced offsets, overlapping where the file is
    short."""
    ids = list(encode(Path(path).read_text()))
    if len(ids) < length:
        raise ValueError(f"--prompts-file: {path} has {len(ids)} tokens, fewer than "
                         f"--prompt-len {length}")
    stride = (len(ids) - length) / max(count - 1, 1)
    return [ids[round(i * stride):round(i * stride) + length] for i in range(count)]


def measure(llm, prompts: list[list[int]], concurrency: int, params) -> dict:
    """Generate `prompts` in groups of `concurrency`; tokens/s, TPOT percentiles, acceptance,
    and the outputs."""
    metrics = llm.engine.metrics
    before = metrics.snapshot()
    outputs = []
    started = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        group = [{"prompt_token_ids": p} for p in prompts[i:i + concurrency]]
        outputs += [o.outputs[0].token_ids for o in llm.generate(group, params)]
    seconds = time.perf_counter() - started
    after = metrics.snapshot()
    tpot = after["observations"].get("time_per_output_token", [])[
        len(before["observations"].get("time_per_output_token", [])):]
    counted = {name: after["counters"].get(name, 0) - before["counters"].get(name, 0)
               for name in ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")}
    proposed = counted["spec_decode_num_draft_tokens"]
    return {"tokens_per_s": sum(map(len, outputs)) / seconds,
            "tpot_p50_ms": float(np.percentile(tpot, 50) * 1e3) if tpot else None,
            "tpot_p99_ms": float(np.percentile(tpot, 99) * 1e3) if tpot else None,
            "acceptance": (counted["spec_decode_num_accepted_tokens"] / proposed
                           if proposed else None),
            "outputs": outputs}


def run_from_args(args: argparse.Namespace) -> int:
    from jaxserve import LLM, SamplingParams

    spec = json.loads(args.speculative_config)
    if args.prompts_file is not None and not Path(args.prompts_file).is_file():
        raise ValueError(f"--prompts-file: no file at {args.prompts_file}")
    options = parse_engine_options(args.engine_option)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len,
                            ignore_eos=True, seed=args.seed if args.temperature else None)
    results: dict[tuple[str, str, int], dict] = {}
    with tempfile.TemporaryDirectory() as scratch:
        folder = model_folder(args.model, scratch)
        for label, extra in (("plain", {}), ("speculative", {"speculative_config": spec})):
            print(f"{label} engine ({extra or 'no speculation'}) ...", flush=True)
            llm = LLM(folder, dtype=args.dtype, **options, **extra)
            work = workloads(args, llm.tokenizer, llm.config.vocab_size,
                             np.random.default_rng(args.seed))
            llm.generate([{"prompt_token_ids": work["random"][0]}], params)  # first runs
            for name, prompts in work.items():
                for c in args.concurrency:
                    result = measure(llm, prompts[:c * args.rounds], c, params)
                    results[label, name, c] = result
                    print(f"  {name} at concurrency {c}: {result['tokens_per_s']:.1f} "
                          "tokens/s", flush=True)
            llm.engine.release()
            del llm
    _report(args, spec, results)
    return 0


def _report(args, spec: dict, results: dict) -> None:
    print(f"\nspeculative_config {json.dumps(spec)}; {args.prompt_len}-token prompts, "
          f"{args.output_len} new tokens, "
          f"{'greedy' if not args.temperature else f'temperature {args.temperature}'}")
    print(f"{'workload':<8}{'conc':>6}{'plain tok/s':>13}{'spec tok/s':>12}{'speed-up':>10}"
          f"{'TPOT p50/p99 plain (ms)':>26}{'spec (ms)':>18}{'accepted':>10}")
    slower = []
    for name in sorted({name for _, name, _ in results}, key=("copy", "random", "text").index):
        for c in args.concurrency:
            plain, spec_run = results["plain", name, c], results["speculative", name, c]
            gain = spec_run["tokens_per_s"] / plain["tokens_per_s"]
            if gain < 1:
                slower.append((c, name))
            acceptance = spec_run["acceptance"]
            print(f"{name:<8}{c:>6}{plain['tokens_per_s']:>13.1f}"
                  f"{spec_run['tokens_per_s']:>12.1f}{gain:>9.2f}x"
                  f"{_tpot(plain):>26}{_tpot(spec_run):>18}"
                  f"{'-' if acceptance is None else f'{acceptance:.0%}':>10}")
            if not args.temperature and plain["outputs"] != spec_run["outputs"]:
                print(f"  !! greedy outputs differ ({name}, concurrency {c})")
    if not slower:
        print("speculation was not slower at any concurrency measured")
        return
    print("speculation was slower at: " + ", ".join(f"{name} concurrency {c}"
                                                   for c, name in sorted(slower)))
    lost = {c for c, _ in slower}
    top = [c for c in sorted(args.concurrency) if all(d in lost for d in args.concurrency
                                                      if d >= c)]
    if top and top[0] > 1:
        print(f"slower from concurrency {top[0]} up: disable_by_batch_size={top[0] - 1} "
              "turns it off there")


def _tpot(result: dict) -> str:
    if result["tpot_p50_ms"] is None:
        return "-"
    return f"{result['tpot_p50_ms']:.1f}/{result['tpot_p99_ms']:.1f}"
