"""The `jaxserve` command line: `serve`, `generate`, `bench serve`, `convert`.

    jaxserve serve [--model PATH] [--config PRESET] [--host 127.0.0.1] [--port 8000]
    jaxserve serve --models models.toml   (several models and versions; see jaxserve.fleet)
    jaxserve generate "Once upon a time" [--max-tokens 64] [--chat]
    jaxserve bench serve --url http://127.0.0.1:8000 --num-prompts 200 --request-rate 8
    jaxserve bench serve --url URL --max-concurrency 1 4 16 --slo-ttft 2000 --slo-tpot 200 \
        --cost-per-hour 2 --plot sweep.png
    jaxserve bench startup [--model PATH] [--starts 2] [--no-baseline]
    jaxserve bench device [--quick] [--out device.json] [--only device,kernels,serving,startup]
    jaxserve bench offline [--model PATH] [--baseline vllm --vllm-python PYTHON]
    jaxserve bench pool [--model PATH] [--num-pages 256 2048 default]
    jaxserve bench structured [--model PATH]
    jaxserve bench models [--model PATH]
    jaxserve bench quality [--model PATH] [--text FILE]
    jaxserve bench load [--model PATH] [--source-dtype float32] [--variants none int8 fp8]
    jaxserve bench lora [--model PATH] [--batch 32] [--max-loras 8] [--max-lora-rank 16]
    jaxserve convert --model HF_DIR --out CKPT_DIR [--quantization int8|fp8]
    jaxserve plan --list                  (the presets that ship with jaxserve)
    jaxserve plan --config v6e-8 [--model DIR] [--json]
                  [--buckets ends|largest|all] [--quantization int8|fp8] [--kv-cache-dtype ...]
    jaxserve plan --models models.toml

Options are named as vLLM users know them. Settings come from, in rising priority: the
built-in defaults, the preset (`--config NAME|FILE`; the `cpu` preset on CPU), then flags given
explicitly (see `jaxserve.presets.engine_settings`).
"""

from __future__ import annotations

import argparse
import faulthandler
import io
import json
import logging
import os
import sys

from jaxserve import __version__
from jaxserve.cli.serve_command import run_server
from jaxserve.cli.serve_flags import add_model_options, add_serve_arguments
from jaxserve.cli.settings import flag_options, resolve_model_settings


def _generate(args: argparse.Namespace) -> int:
    from jaxserve import LLM, SamplingParams

    model, dtype, options = resolve_model_settings(args)
    llm = LLM(model, dtype=dtype, config=args.config, **options)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                            max_tokens=args.max_tokens)
    if args.chat:
        ids = llm.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        ids = llm.tokenizer.encode(args.prompt)
        print(args.prompt, end="", flush=True)
    engine = llm.engine
    seq = engine.add_request("cli", ids, params, args.prompt)
    while engine.has_unfinished():
        for delta in engine.step():
            print(delta.new_text, end="", flush=True)
    print()
    print(f"[{len(seq.output_token_ids)} tokens, finish_reason={seq.finish_reason}]",
          file=sys.stderr)
    return 0


def _convert(args: argparse.Namespace) -> int:
    from jaxserve.loading.checkpoint import convert

    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs each store it closes
    out = convert(args.model, args.out, dtype=args.dtype, quantization=args.quantization)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _plan(args: argparse.Namespace) -> int:
    from jaxserve.aot.plan import build_plan, plan_target
    from jaxserve.aot.report import format_plan
    from jaxserve.presets import load_preset, reference_model_dir

    if args.models is not None:
        from jaxserve.aot.models_plan import run_models_plan

        return run_models_plan(args)
    if args.list:
        print(_presets_table())
        return 0
    if not args.config:
        raise ValueError("plan needs --config PRESET (a shipped preset's name, see "
                         "`jaxserve plan --list`, or a TOML file)")
    preset = load_preset(args.config)
    plan_target(preset)  # a preset that cannot be planned fails before any work
    import jax

    if not jax.config.jax_platforms:  # the host compiles; never probe for attached chips
        jax.config.update("jax_platforms", "cpu")
    model_dir = reference_model_dir(args.model) if args.model else preset.plan_model_dir()
    plan = build_plan(preset, model_dir, args.dtype, flag_options(args),
                      buckets=args.buckets,
                      verbose=args.verbose, progress=not args.json,
                      model_name=args.model or preset.plan_model)
    print(json.dumps(plan, indent=2) if args.json else format_plan(plan, args.verbose))
    return 0 if plan["fits"] else 1


def _presets_table() -> str:
    """The shipped presets, one line each: what hardware, which mesh, which limits."""
    from jaxserve.presets import load_preset, shipped_presets

    rows = [("name", "platform", "chip", "devices", "tp x dp", "dtype", "max_model_len",
             "max_num_seqs", "planned with")]
    for name, path in shipped_presets().items():
        preset = load_preset(path)
        options = preset.engine_options
        rows.append((name, preset.platform, preset.accelerator or "-", str(preset.devices),
                     f"{options.get('tensor_parallel_size', 1)} x "
                     f"{options.get('data_parallel_size', 1)}", preset.dtype or "auto",
                     str(options.get("max_model_len", "model's")),
                     str(options.get("max_num_seqs", "-")), preset.plan_model or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                     for row in rows)


def build_parser() -> argparse.ArgumentParser:
    """The `jaxserve` parser: one sub-command each, its handler in `handler`."""
    parser = argparse.ArgumentParser(
        prog="jaxserve", description="LLM inference runtime in JAX/XLA for TPUs and GPUs.")
    parser.add_argument("--version", action="version", version=f"jaxserve {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for add_command in (_add_serve, _add_generate, _add_convert, _add_plan, _add_bench):
        add_command(commands)
    return parser


def _add_serve(commands) -> None:
    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_serve_arguments(serve)
    serve.set_defaults(handler=run_server)


def _add_generate(commands) -> None:
    generate = commands.add_parser("generate", help="stream a completion of one prompt")
    generate.add_argument("prompt", help="the prompt text")
    add_model_options(generate)
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--chat", action="store_true",
                          help="wrap the prompt as a user message in the chat template")
    generate.set_defaults(handler=_generate)


def _add_convert(commands) -> None:
    convert = commands.add_parser("convert", help="write an orbax checkpoint of an HF folder")
    convert.add_argument("--model", required=True, help="Hugging Face model folder")
    convert.add_argument("--out", required=True, help="checkpoint folder to create")
    convert.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                         help="dtype of the saved float weights (default: the checkpoint's)")
    convert.add_argument("--quantization", default=None, choices=["int8", "fp8"],
                         help="save the weights quantized (int8/fp8 codes, per-channel "
                              "scales): restores skip quantizing on every start")
    convert.set_defaults(handler=_convert)


def _add_plan(commands) -> None:
    plan = commands.add_parser(
        "plan", help="compile a preset's programs for its TPU/GPU without the hardware; "
                     "report memory per device and whether it fits (exit 0 fits, 1 not)")
    add_model_options(plan, preset_required=True)
    plan.add_argument("--models", default=None, metavar="MODELS.toml",
                      help="plan every engine of a models file together (engines sharing a "
                           "device must fit together)")
    plan.set_defaults(model=None)
    plan.add_argument("--list", action="store_true",
                      help="list the presets that ship with jaxserve, then exit")
    plan.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    plan.add_argument("--buckets", choices=("ends", "largest", "all"), default="ends",
                      help="which bucket programs to compile: each kind's smallest and largest "
                           "(ends, the default), its largest only (largest: the peaks that "
                           "decide the fit, in half the time) or every bucket (all)")
    plan.add_argument("--all-buckets", dest="buckets", action="store_const", const="all",
                      help="the same as --buckets all")
    plan.add_argument("--verbose", action="store_true",
                      help="also the Triton kernels' registers, spills and shared memory (GPU)")
    plan.set_defaults(handler=_plan)


def _add_bench(commands) -> None:
    """`bench KIND`: each kind's module adds its arguments and runs it."""
    bench = commands.add_parser("bench", help="benchmarks")
    bench_kinds = bench.add_subparsers(dest="bench_kind", required=True)
    from jaxserve.bench import (device_bench, embed_bench, load_bench, lora_bench, lora_products,
                                models_bench, offline_bench, pool_bench, quality_bench,
                                serve_bench, speculative_bench, startup_bench,
                                structured_bench)

    benches = {  # kind → (module with add_arguments and run_from_args, help)
        "serve": (serve_bench, "load-test a running server"),
        "device": (device_bench, "the accelerator JAX sees: bandwidth and matmul probes, "
                                 "kernels, serving an 8B model, start-up; JSON, table, plot"),
        "offline": (offline_bench, "generation throughput at batch 1 and N beside "
                                   "transformers (and vLLM), decode roofline"),
        "lora": (lora_bench, "LoRA adapters: a batch with 0, 1, 2 and N distinct adapters "
                 "beside the base engine, more adapters than slots, a slot write"),
        "lora-products": (lora_products, "the LoRA delta three ways (masked, gathered, "
                          "grouped): CPU time and compile-only TPU/GPU flops and bytes"),
        "spec": (speculative_bench, "the engine with and without speculative decoding at "
                                    "several concurrencies: tokens/s, TPOT, acceptance"),
        "embed": (embed_bench, "the pooling runner's embeddings: tokens/s at short and long "
                               "inputs"),
        "pool": (pool_bench, "a single request's decode step at several KV pool sizes "
                             "(must be flat)"),
        "structured": (structured_bench,
                       "structured output's cost: free vs constrained requests"),
        "models": (models_bench, "several models in one server: a quiet model's TTFT while "
                                 "another is flooded, and the timeline of reloads under load"),
        "startup": (startup_bench, "server start-up, cold then warm: time to healthy and to a "
                                   "first answer, and its phases"),
        "quality": (quality_bench, "quantization's accuracy: perplexity, agreement with the "
                                   "unquantized model, and weight bytes per variant"),
        "load": (load_bench, "peak host memory of loading weights, unquantized and quantized "
                             "on load (int8, fp8), against the largest tensor"),
    }
    for kind, (module, help_text) in benches.items():
        bench_kind = bench_kinds.add_parser(kind, help=help_text)
        module.add_arguments(bench_kind)
        bench_kind.set_defaults(handler=module.run_from_args)


def _print_stacks_on_native_crash() -> None:
    """A crash in native code (XLA, a compiled program) prints the Python stacks to stderr.

    Skipped when stderr is not a file (``main`` called inside a test's captured output or a
    notebook): faulthandler writes to a file descriptor, not to a Python stream.
    """
    try:
        faulthandler.enable()
    except (AttributeError, ValueError, io.UnsupportedOperation):
        pass


def main(argv: list[str] | None = None) -> int:
    _print_stacks_on_native_crash()
    args = build_parser().parse_args(argv)
    from jaxserve.platforms import choose_jax_platforms

    if args.command != "plan":  # plan compiles on the host's CPU for any target
        choose_jax_platforms()  # before jax starts: no probing for chips that are not there
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        return args.handler(args)
    except ValueError as err:
        print(f"jaxserve: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`jaxserve plan --list | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0

