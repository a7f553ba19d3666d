"""`jaxserve bench embed`: the pooling runner's throughput, in prompt tokens per second,
at short and long inputs.

Builds `LLM(runner="pooling")` over `--model` (default: the random ~60M Llama of `bench
offline`, pooled by its last token), compiles the bucket each length needs, then embeds
`--requests` random token sequences of each `--lengths` in one `embed` call, `--repeats`
times, and prints the best run's tokens/s and sequences/s. `--baseline transformers` also
times transformers' `AutoModel` (torch) on the same inputs in batches of `--max-num-seqs`
(the inputs of a length are equally long, so it pads nothing), last hidden state of the
last token, normalized. `--shared-prefix N` makes every input start with the same N tokens
(a reranker's instruction and query before each document); the runner then holds the prefix
once per batch unless `--no-enable-prefix-caching`.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF model folder (default: random ~60M)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 512],
                        help="tokens per input, one measurement each")
    parser.add_argument("--requests", type=int, default=64, help="inputs per measurement")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512,
                        help="the token bucket (every batch is padded to it)")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3, help="runs per length (best kept)")
    parser.add_argument("--shared-prefix", type=int, default=0,
                        help="tokens every input starts with (same for all)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=True, help="share a batch's common prefix")
    parser.add_argument("--baseline", choices=["none", "transformers"], default="none",
                        help="also time transformers on the same inputs")


def transformers_seconds(folder: str, prompts: list[list[int]], batch: int, dtype: str,
                         repeats: int) -> float:
    """The best time of transformers embedding `prompts` (equally long) in batches."""
    import torch
    import transformers

    model = transformers.AutoModel.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor(prompts)
    best = float("inf")
    for _ in range(repeats + 1):  # the first run warms up
        started = time.perf_counter()
        with torch.no_grad():
            for start in range(0, len(prompts), batch):
                hidden = model(ids[start:start + batch]).last_hidden_state[:, -1]
                torch.nn.functional.normalize(hidden, dim=-1)
        best = min(best, time.perf_counter() - started)
    return best


def run_from_args(args: argparse.Namespace) -> int:
    from jaxserve.bench.offline_bench import model_folder
    from jaxserve.llm import LLM

    budget = args.max_num_batched_tokens
    if max(args.lengths) > budget:
        raise SystemExit(f"--lengths may not exceed --max-num-batched-tokens ({budget})")
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as scratch:
        folder = model_folder(args.model, scratch)
        llm = LLM(folder, dtype=args.dtype, runner="pooling", max_model_len=budget,
                  enable_prefix_caching=args.enable_prefix_caching,
                  max_num_batched_tokens=budget, max_num_seqs=args.max_num_seqs,
                  token_buckets=(budget,), seq_buckets=(args.max_num_seqs,),
                  pooler_config={"pooling_type": "LAST", "normalize": True})
        vocab = llm.config.vocab_size if llm.config is not None else 1000
        rows = []
        for length in args.lengths:
            prefix = rng.integers(3, vocab, min(args.shared_prefix, length - 1)).tolist()
            prompts = [prefix + rng.integers(3, vocab, length - len(prefix)).tolist()
                       for _ in range(args.requests)]
            llm.embed(prompts[:1])  # compiles this length's bucket
            best = float("inf")
            for _ in range(args.repeats):
                started = time.perf_counter()
                llm.embed(prompts)
                best = min(best, time.perf_counter() - started)
            baseline = (transformers_seconds(folder, prompts, args.max_num_seqs, args.dtype,
                                             args.repeats)
                        if args.baseline == "transformers" else None)
            rows.append((length, best, baseline))
            print(f"  {length} tokens x {args.requests}: {best:.3f} s"
                  + (f" (transformers {baseline:.3f} s)" if baseline else ""), flush=True)
    print(f"\nembeddings ({args.dtype}, token bucket {budget}, up to {args.max_num_seqs} "
          f"sequences a batch, shared prefix {args.shared_prefix}, prefix sharing "
          f"{'on' if args.enable_prefix_caching else 'off'})")
    print(f"{'tokens/input':>13}{'inputs':>8}{'tokens/s':>12}{'inputs/s':>10}"
          + (f"{'transformers tok/s':>20}{'ratio':>8}" if args.baseline != "none" else ""))
    for length, seconds, baseline in rows:
        line = (f"{length:>13}{args.requests:>8}{length * args.requests / seconds:>12.0f}"
                f"{args.requests / seconds:>10.1f}")
        if baseline:
            line += f"{length * args.requests / baseline:>20.0f}{baseline / seconds:>7.2f}x"
        print(line)
    return 0
