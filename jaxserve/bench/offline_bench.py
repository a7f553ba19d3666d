"""`jaxserve bench offline`: generation throughput of jaxserve beside vLLM and Hugging Face
`transformers` on the same weights and prompts, in one run, the way users run them: default
options, one request at a time and many at once, uniform and ragged prompts.

Without `--model` it builds a random Llama of about 60M parameters (`random_model`: hidden
512, 8 layers, 8 heads, 4 kv heads, vocab 32000) and saves it as a model folder. Four
workloads, each generating `--output-len` tokens per prompt (eos ignored):
- `batch 1 uniform` / `batch 1 ragged`: `--sequential-prompts` prompts one after another,
  of `--prompt-len` tokens or of random lengths in [`--min-prompt-len`, `--max-prompt-len`];
- `batch N uniform` / `batch N ragged`: `--num-prompts` such prompts submitted at once
  (transformers: in batches of `--num-prompts`, left-padded).
Engines: jaxserve (engine options as `LLM` takes them, none by default); transformers
`generate` (`--no-hf` skips it); vLLM with `--baseline vllm`, run by `--vllm-python` (an
interpreter with vLLM, e.g. its own virtual environment) on its default options plus
`--vllm-option`s (on CPU vLLM reserves `gpu_memory_utilization` of the host's memory and
refuses to start when that is not free: 0.5 unless given), configured as its CPU users run
it fast (`vllm_cpu_env`): its OpenMP threads bound to every core this process may use, as
jaxserve's XLA uses them (`VLLM_CPU_OMP_THREADS_BIND`), and its KV space sized explicitly
(`VLLM_CPU_KVCACHE_SPACE`, `--vllm-kv-space-gib`); a value already in the environment is
kept. The configuration it ran with is printed. All decode greedily, or all sample at
`--temperature` over the whole vocabulary.
The roofline: bytes of weights read per decode step divided by a read bandwidth measured in
the same run (a jitted reduction over a large array), beside jaxserve's batch-1 decode step.
The transformers runs need the `bench` extra (torch, transformers); `--no-hf` skips them.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxserve.bench.random_model import build_random_model
from jaxserve.errors import require_extra


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF model folder (default: random ~60M)")
    parser.add_argument("--num-prompts", type=int, default=32,
                        help="prompts submitted at once in the batch-N workloads")
    parser.add_argument("--sequential-prompts", type=int, default=8,
                        help="prompts run one after another in the batch-1 workloads")
    parser.add_argument("--prompt-len", type=int, default=128, help="uniform prompts' length")
    parser.add_argument("--min-prompt-len", type=int, default=64)
    parser.add_argument("--max-prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy everywhere (default); above 0: every engine samples at "
                             "this temperature over the whole vocabulary")
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers runs")
    parser.add_argument("--baseline", choices=["vllm"], action="append", default=[],
                        help="also run this engine on the same prompts")
    parser.add_argument("--vllm-python", default=sys.executable,
                        help="the Python that runs the vLLM baseline (default: this one)")
    parser.add_argument("--vllm-option", action="append", default=[], metavar="NAME=VALUE",
                        help="a vLLM engine argument (repeatable; default: "
                             "gpu_memory_utilization=0.5)")
    parser.add_argument("--vllm-kv-space-gib", type=float, default=4.0,
                        help="vLLM-CPU's KV cache space in GiB (VLLM_CPU_KVCACHE_SPACE; "
                             "default 4)")
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
            raise ValueError(f"options must be NAME=VALUE, got {pair!r}")
        try:
            options[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[name] = value
    return options


def model_folder(model: str | None, scratch: str) -> str:
    """`model`, or (None) the random ~60M Llama built in `scratch`."""
    if model is not None:
        return model
    folder = Path(scratch) / "random-llama-60m"
    print("building a random ~60M-parameter Llama ...", flush=True)
    build_random_model(folder)
    return str(folder)


def decode_step_seconds(engine, request_id: str, prompt: list[int], params) -> float:
    """One request alone through `engine`: the mean time of a decode step, between its first
    token and its last (`params` must ask for at least 2 tokens)."""
    seq = engine.add_request(request_id, prompt, params)
    while engine.has_unfinished():
        engine.step()
    return (seq.times.last_token - seq.times.first_token) / (params.max_tokens - 1)


def measure_read_bandwidth(megabytes: int = 512) -> float:
    """Bytes/s of a jitted reduction that reads `megabytes` once (best of 5)."""
    import jax
    import jax.numpy as jnp

    data = jnp.ones((megabytes << 20) // 4, jnp.float32)
    total = jax.jit(jnp.sum)
    total(data).block_until_ready()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        total(data).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return data.nbytes / best


def workloads(args, rng: np.random.Generator) -> dict[str, dict]:
    """The four workloads: name → {"prompts": token id lists, "batch": 1 or N}."""
    def prompts(count: int, ragged: bool) -> list[list[int]]:
        lengths = (rng.integers(args.min_prompt_len, args.max_prompt_len + 1, count) if ragged
                   else [args.prompt_len] * count)
        return [rng.integers(3, 1000, int(n)).tolist() for n in lengths]

    n = args.num_prompts
    return {"batch 1 uniform": {"prompts": prompts(args.sequential_prompts, False), "batch": 1},
            "batch 1 ragged": {"prompts": prompts(args.sequential_prompts, True), "batch": 1},
            f"batch {n} uniform": {"prompts": prompts(n, False), "batch": n},
            f"batch {n} ragged": {"prompts": prompts(n, True), "batch": n}}


def _timed(name: str, work: dict, output_len: int, run_one, run_all,
           results: dict) -> None:
    """Times one workload, its prompts one by one (batch 1) or all at once, into
    `results["rates"][name]` (output tokens/s) and `results["tokens"][name]` (each prompt's
    generated ids, for the agreement check)."""
    start = time.perf_counter()
    if work["batch"] == 1:
        tokens = [run_one(prompt) for prompt in work["prompts"]]
    else:
        tokens = run_all(work["prompts"])
    rate = len(work["prompts"]) * output_len / (time.perf_counter() - start)
    print(f"  {name}: {rate:.1f} output tokens/s", flush=True)
    results.setdefault("rates", {})[name] = rate
    results.setdefault("tokens", {})[name] = [list(map(int, t)) for t in tokens]


def _jaxserve_runs(folder: str, work: dict[str, dict], args) -> dict:
    import jax

    from jaxserve import LLM, SamplingParams
    from jaxserve.engine.expert_load import imbalance

    options = parse_engine_options(args.engine_option)
    print(f"jaxserve (engine options: {options or 'defaults'}; warm-up compiles every "
          "bucket first) ...", flush=True)
    llm = LLM(folder, dtype=args.dtype, **options)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len,
                            ignore_eos=True, seed=args.seed)

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [out.outputs[0].token_ids for out in outputs]

    results = {}
    for name, w in work.items():
        _timed(name, w, args.output_len, lambda p: generate([p])[0], generate, results)
    engine = llm.engine
    counters = engine.metrics.snapshot()["counters"]
    if counters.get("spec_decode_num_draft_tokens"):
        accepted = counters["spec_decode_num_accepted_tokens"]
        drafted = counters["spec_decode_num_draft_tokens"]
        print(f"  speculative decoding: {accepted} of {drafted} draft tokens accepted "
              f"({accepted / drafted:.0%})", flush=True)
    load = engine.expert_load()
    if load is not None:  # mixture of experts: how evenly the router spread the tokens
        per_layer = imbalance(load[load.any(axis=-1)])
        print(f"  expert load (busiest expert's tokens over the mean, per layer): mean "
              f"{per_layer.mean():.2f}, worst {per_layer.max():.2f}", flush=True)
    decode_step = decode_step_seconds(engine, "roofline",
                                      next(iter(work.values()))["prompts"][0], params)
    weights = sum(np.prod(x.shape) * x.dtype.itemsize
                  for x in jax.tree.leaves(engine.runner.state))
    return {**results, "decode_step_s": decode_step, "weight_bytes": int(weights)}


def _hf_runs(folder: str, work: dict[str, dict], args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    print("transformers generate ...", flush=True)
    dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    kwargs = dict(max_new_tokens=args.output_len, min_new_tokens=args.output_len,
                  pad_token_id=0, do_sample=args.temperature > 0)
    if args.temperature > 0:  # the whole vocabulary, as jaxserve's rows (HF's default is 50)
        kwargs.update(temperature=args.temperature, top_k=0, top_p=1.0)

    def run(batch: list[list[int]]) -> list[list[int]]:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, **kwargs)[:, width:].tolist()

    run(next(iter(work.values()))["prompts"][:1])  # warm-up
    results = {}
    for name, w in work.items():
        _timed(name, w, args.output_len, lambda p: run([p])[0], run, results)
    return results


def core_ranges(cores: set[int]) -> str:
    """CPU ids as OpenMP's bind lists spell them: {0, 1, 2, 5} → "0-2,5"."""
    ranges: list[list[int]] = []
    for core in sorted(cores):
        if ranges and core == ranges[-1][1] + 1:
            ranges[-1][1] = core
        else:
            ranges.append([core, core])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in ranges)


def vllm_cpu_env(environ: dict[str, str], cores: set[int], kv_space_gib: float
                 ) -> dict[str, str]:
    """vLLM-CPU's settings as a user who wants it fast sets them: its OpenMP threads bound to
    every core in `cores` (those this process may run on, which jaxserve's XLA uses) and
    its KV space explicit. Settings already in `environ` win."""
    return {"VLLM_CPU_OMP_THREADS_BIND": core_ranges(cores),
            "VLLM_CPU_KVCACHE_SPACE": f"{kv_space_gib:g}",
            **{k: v for k, v in environ.items()
               if k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")}}


def _vllm_runs(folder: str, work: dict[str, dict], args, scratch: Path) -> dict:
    """vLLM's rates from `vllm_baseline.py` run by `--vllm-python` (its progress on stderr)."""
    options = parse_engine_options(args.vllm_option) or {"gpu_memory_utilization": 0.5}
    settings = vllm_cpu_env(dict(os.environ), os.sched_getaffinity(0), args.vllm_kv_space_gib)
    print(f"vLLM (run by {args.vllm_python}) with "
          + " ".join(f"{k}={v}" for k, v in settings.items())
          + f", engine options {options} ...", flush=True)
    spec = scratch / "vllm_spec.json"
    spec.write_text(json.dumps({
        "model": folder, "dtype": args.dtype, "output_len": args.output_len,
        "temperature": args.temperature, "seed": args.seed, "options": options,
        "workloads": work}))
    script = Path(__file__).with_name("vllm_baseline.py")
    done = subprocess.run([args.vllm_python, str(script), str(spec)], stdout=subprocess.PIPE,
                          text=True, env={**os.environ, **settings})
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not results:
        raise RuntimeError(f"the vLLM baseline failed (exit {done.returncode}); its stderr "
                           "above says why")
    return json.loads(results[-1][len("RESULT "):])


def run_from_args(args: argparse.Namespace) -> int:
    import jax

    if not args.no_hf:  # before anything runs: a missing baseline is one line, not a traceback
        require_extra(["torch", "transformers"], "bench",
                      "the transformers baseline (or leave it out: --no-hf)")
    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory() as scratch:
        folder = model_folder(args.model, scratch)
        work = workloads(args, rng)
        bandwidth = measure_read_bandwidth()
        print(f"measured read bandwidth: {bandwidth / 1e9:.1f} GB/s", flush=True)
        ours = _jaxserve_runs(folder, work, args)
        engines = {"jaxserve": ours}
        if "vllm" in args.baseline:
            engines["vLLM"] = _vllm_runs(folder, work, args, Path(scratch))
        if not args.no_hf:
            engines["transformers"] = _hf_runs(folder, work, args)
    print(f"\n{args.output_len} new tokens per prompt, {args.dtype}, "
          f"{f'temperature {args.temperature}' if args.temperature else 'greedy'}, on "
          f"{jax.devices()[0].platform}; uniform prompts of {args.prompt_len} tokens, ragged "
          f"of {args.min_prompt_len}-{args.max_prompt_len}; output tokens/s")
    print(f"{'':<22}" + "".join(f"{name:>18}" for name in work))
    for engine, result in engines.items():
        print(f"{engine:<22}" + "".join(f"{result['rates'][name]:>18.1f}" for name in work))
    for engine, result in engines.items():
        if engine != "jaxserve":
            print(f"{'jaxserve/' + engine:<22}" + "".join(
                f"{ours['rates'][name] / result['rates'][name]:>17.2f}x" for name in work))
    if not args.temperature:
        for engine, result in engines.items():
            if engine != "jaxserve":
                same = sum(a == b for name in work
                           for a, b in zip(ours["tokens"][name], result["tokens"][name]))
                total = sum(len(w["prompts"]) for w in work.values())
                print(f"greedy outputs equal to jaxserve's, token for token: {engine} "
                      f"{same}/{total}")
    roofline = ours["weight_bytes"] / bandwidth
    print(f"jaxserve batch-1 decode step: {ours['decode_step_s'] * 1e3:.2f} ms; roofline "
          f"{ours['weight_bytes'] / 1e6:.0f} MB of weights / {bandwidth / 1e9:.1f} GB/s = "
          f"{roofline * 1e3:.2f} ms -> {roofline / ours['decode_step_s']:.0%} of roofline")
    return 0
