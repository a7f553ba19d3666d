"""`jaxserve bench offline`: generation throughput of jaxserve against Hugging Face
`transformers` on the same weights, in one run, plus the batch-1 decode roofline.

Without `--model` it builds a random Llama of about 60M parameters (hidden 512, 8 layers,
8 heads, 4 kv heads, vocab 32000) with `transformers` and saves it as a model folder. It
generates `--output-len` tokens (eos ignored) for `--num-prompts` prompts of random lengths
in [`--min-prompt-len`, `--max-prompt-len`]:
- concurrency 1: requests one after another (the first `--sequential-prompts` prompts);
- concurrency N: all prompts submitted at once, the engine batching up to `--max-num-seqs`;
- transformers `generate` at batch 1 and at batch `--max-num-seqs` (left padding).
Both sides decode greedily, or with `--temperature T` both sample at T over the whole
vocabulary (`SamplingParams()`'s default is T = 1).
The roofline: bytes of weights read per decode step divided by a read bandwidth measured in
the same run (a jitted reduction over a large array); the batch-1 decode step time is
compared with it. Needs the `bench` extra (torch, transformers).
"""

from __future__ import annotations

import argparse
import ast
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF model folder (default: random ~60M)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--sequential-prompts", type=int, default=8,
                        help="prompts timed at concurrency 1 (each side)")
    parser.add_argument("--min-prompt-len", type=int, default=64)
    parser.add_argument("--max-prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy on both sides (default); above 0: both sample at this "
                             "temperature over the whole vocabulary (1.0 is SamplingParams' "
                             "default, what a user gets without options)")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers runs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-option", action="append", default=[], metavar="NAME=VALUE",
                        help="an engine option for jaxserve, e.g. num_decode_steps=16 or "
                             "token_buckets=(32,512) (repeatable; default: none, as a new "
                             "user runs it)")


def parse_engine_options(pairs: list[str]) -> dict:
    """`NAME=VALUE` strings → engine options; values are Python literals (else strings)."""
    options = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"--engine-option must be NAME=VALUE, got {pair!r}")
        try:
            options[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[name] = value
    return options


def build_random_model(folder: Path) -> None:
    """A ~60M-parameter random Llama saved as a Hugging Face folder, with a word-level
    tokenizer (token i is the word "w<i>") so served text streams token by token."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = 32000
    config = LlamaConfig(vocab_size=vocab, hidden_size=512, intermediate_size=1408,
                         num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))


def measure_read_bandwidth(megabytes: int = 512) -> float:
    """Bytes/s of a jitted reduction that reads `megabytes` once (best of 5)."""
    data = jnp.ones((megabytes << 20) // 4, jnp.float32)
    total = jax.jit(jnp.sum)
    total(data).block_until_ready()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        total(data).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return data.nbytes / best


def _jaxserve_runs(folder: str, prompts: list[list[int]], args) -> dict:
    from jaxserve import LLM, SamplingParams

    options = parse_engine_options(args.engine_option)
    print(f"jaxserve engine options: {options or 'defaults'}", flush=True)
    llm = LLM(folder, dtype=args.dtype, **options)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len,
                            ignore_eos=True, seed=args.seed)
    as_ids = [{"prompt_token_ids": p} for p in prompts]
    start = time.perf_counter()
    step_times = []
    for prompt in as_ids[:args.sequential_prompts]:
        seq_start = time.perf_counter()
        llm.generate(prompt, params)
        step_times.append(time.perf_counter() - seq_start)
    sequential = time.perf_counter() - start
    engine = llm.engine
    seq = engine.add_request("roofline", prompts[0], params)
    while engine.has_unfinished():
        engine.step()
    decode_step = (seq.times.last_token - seq.times.first_token) / (args.output_len - 1)
    start = time.perf_counter()
    llm.generate(as_ids, params)
    batched = time.perf_counter() - start
    weights = sum(np.prod(x.shape) * x.dtype.itemsize
                  for x in jax.tree.leaves(engine.runner.state))
    return {"c1_tokens_per_s": args.sequential_prompts * args.output_len / sequential,
            "cN_tokens_per_s": len(prompts) * args.output_len / batched,
            "decode_step_s": decode_step, "weight_bytes": int(weights)}


def _hf_runs(folder: str, prompts: list[list[int]], args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    kwargs = dict(max_new_tokens=args.output_len, min_new_tokens=args.output_len,
                  pad_token_id=0, do_sample=args.temperature > 0)
    if args.temperature > 0:  # the whole vocabulary, as jaxserve's rows (HF's default is 50)
        kwargs.update(temperature=args.temperature, top_k=0, top_p=1.0)

    def run(batch: list[list[int]]) -> None:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, **kwargs)

    run(prompts[:1])  # warm-up
    start = time.perf_counter()
    for prompt in prompts[:args.sequential_prompts]:
        run([prompt])
    sequential = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(0, len(prompts), args.max_num_seqs):
        run(prompts[i:i + args.max_num_seqs])
    batched = time.perf_counter() - start
    return {"c1_tokens_per_s": args.sequential_prompts * args.output_len / sequential,
            "cN_tokens_per_s": len(prompts) * args.output_len / batched}


def run_from_args(args: argparse.Namespace) -> int:
    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.model
        if folder is None:
            folder = str(Path(scratch) / "random-llama-60m")
            print("building a random ~60M-parameter Llama with transformers ...", flush=True)
            build_random_model(Path(folder))
        lengths = rng.integers(args.min_prompt_len, args.max_prompt_len + 1, args.num_prompts)
        prompts = [rng.integers(3, 1000, n).tolist() for n in lengths]
        bandwidth = measure_read_bandwidth()
        print(f"measured read bandwidth: {bandwidth / 1e9:.1f} GB/s", flush=True)
        print("jaxserve (warm-up compiles every bucket first) ...", flush=True)
        ours = _jaxserve_runs(folder, prompts, args)
        hf = None if args.no_hf else _hf_runs(folder, prompts, args)
    n = args.max_num_seqs
    print(f"\n{args.num_prompts} prompts of {args.min_prompt_len}-{args.max_prompt_len} tokens, "
          f"{args.output_len} new tokens each, {args.dtype}, "
          f"{f'temperature {args.temperature}' if args.temperature else 'greedy'}, "
          f"on {jax.devices()[0].platform}")
    print(f"{'':<26}{'concurrency 1':>16}{f'concurrency {n}':>18}   (output tokens/s)")
    print(f"{'jaxserve':<26}{ours['c1_tokens_per_s']:>16.1f}{ours['cN_tokens_per_s']:>18.1f}")
    if hf:
        print(f"{'transformers generate':<26}{hf['c1_tokens_per_s']:>16.1f}"
              f"{hf['cN_tokens_per_s']:>18.1f}")
        print(f"{'ratio':<26}{ours['c1_tokens_per_s'] / hf['c1_tokens_per_s']:>15.2f}x"
              f"{ours['cN_tokens_per_s'] / hf['cN_tokens_per_s']:>17.2f}x")
    roofline = ours["weight_bytes"] / bandwidth
    print(f"batch-1 decode step: {ours['decode_step_s'] * 1e3:.2f} ms; roofline "
          f"{ours['weight_bytes'] / 1e6:.0f} MB of weights / {bandwidth / 1e9:.1f} GB/s = "
          f"{roofline * 1e3:.2f} ms -> {roofline / ours['decode_step_s']:.0%} of roofline")
    return 0
