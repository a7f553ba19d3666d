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
import dataclasses
import faulthandler
import io
import json
import logging
import os
import sys

from jaxserve import __version__
from jaxserve.cli.serve_flags import add_model_options, add_serve_arguments
from jaxserve.cli.serve_values import (check_generation_config, check_ssl_files, cors_settings,
                                       read_chat_template, server_url, use_download_dir,
                                       with_revision)
from jaxserve.server.limits import RequestLimits
from jaxserve.tool_calling import ChatParsing


def resolve_model_settings(args: argparse.Namespace) -> tuple[str, str | None, dict]:
    """(model path, dtype, engine options from flags) for `LLM(model, dtype, config=
    args.config, **options)`, which puts the flags on top of the preset."""
    return args.model or default_model_dir(), args.dtype, flag_options(args)


def flag_options(args: argparse.Namespace) -> dict:
    """The engine options the user gave as flags (they override the preset's)."""
    from jaxserve.config.engine import option_specs

    options = {spec.name: getattr(args, spec.name) for spec in option_specs()
               if getattr(args, spec.name) is not None}
    return {name: tuple(v) if isinstance(v, list) else v for name, v in options.items()}


def default_model_dir() -> str:
    from jaxserve.default_model import DEFAULT_MODEL_DIR

    return str(DEFAULT_MODEL_DIR)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from jaxserve.engine import multihost
    from jaxserve.server.app import create_app
    from jaxserve.server.auth import ADMIN_API_KEY_ENV, API_KEY_ENV, key_from, warn_if_open
    from jaxserve.server.state import ServerOptions, ServerState

    logging.getLogger().setLevel(args.log_level.upper())
    api_key = key_from(args.api_key, API_KEY_ENV, os.environ)
    admin_api_key = key_from(args.admin_api_key, ADMIN_API_KEY_ENV, os.environ)
    if args.metrics_need_api_key and not api_key:
        raise ValueError("--metrics-need-api-key needs an API key (--api-key or "
                         "JAXSERVE_API_KEY: the key /metrics would ask)")
    warn_if_open(args.host, api_key)
    limits = RequestLimits(args.max_stop_strings, args.max_stop_string_chars, args.max_tools,
                           args.max_schema_bytes, args.max_logprobs)
    chat_parsing = ChatParsing(args.tool_call_parser, args.enable_auto_tool_choice,
                               args.reasoning_parser)
    runtime_lora = runtime_lora_updating(args)
    ssl = check_ssl_files(args.ssl_keyfile, args.ssl_certfile)
    chat_template = read_chat_template(args.chat_template)
    check_generation_config(args.generation_config)
    if args.download_dir is not None:
        use_download_dir(args.download_dir)
    multihost.initialize(args.coordinator_address, args.num_processes, args.process_id)
    listener = _listen_socket(args.host, args.port) if multihost.is_leader() else None
    if args.models is not None:
        if args.lora_modules:
            raise ValueError("--lora-modules serves adapters of --model's model; a models "
                             "file cannot name adapters")
        options = _models_file_options(args)
    else:
        model, dtype, engine_options = resolve_model_settings(args)
        model = with_revision(model, args.revision)
        adapters = lora_modules(args.lora_modules)
        _check_before_serving(model, dtype, args.config, engine_options, adapters)
        if args.tokenizer is not None:
            from jaxserve.loading.hub import resolve_model
            from jaxserve.loading.tokenizer import Tokenizer

            Tokenizer(resolve_model(args.tokenizer))  # exit 2 now, not after the weights
        if not multihost.is_leader():
            from jaxserve.llm import LLM

            LLM(model, dtype=dtype, config=args.config, **engine_options).engine.run_follower()
            return 0
        served_names = args.served_model_name
        if served_names is None and args.model is None:
            from jaxserve.default_model import DEFAULT_MODEL_NAME

            served_names = [DEFAULT_MODEL_NAME]
        options = ServerOptions(model=model, served_model_name=served_names, dtype=dtype,
                                config=args.config, engine_options=engine_options,
                                lora_modules=adapters, chat_template=chat_template,
                                tokenizer=args.tokenizer)
    state = ServerState(dataclasses.replace(
        options, api_key=api_key, admin_api_key=admin_api_key,
        metrics_need_api_key=args.metrics_need_api_key,
        max_body_bytes=args.max_body_bytes, max_waiting_requests=args.max_waiting_requests,
        request_limits=limits, chat_parsing=chat_parsing, runtime_lora=runtime_lora,
        generation_config=args.generation_config, seed=args.seed,
        url=server_url(args.host, args.port, args.root_path, ssl),
        cors=cors_settings(args)))
    server = uvicorn.Server(uvicorn.Config(
        create_app(state), host=args.host, port=args.port,
        log_level=args.uvicorn_log_level or args.log_level,
        access_log=not args.disable_uvicorn_access_log, root_path=args.root_path or "",
        ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
        timeout_graceful_shutdown=args.drain_timeout))
    state.on_fatal = lambda: setattr(server, "should_exit", True)  # exit once it is closed
    if args.models is not None:
        _reload_on_sighup(state)
    server.run(sockets=[listener])
    if state.fatal_error:
        print(f"jaxserve: error: {state.fatal_error}", file=sys.stderr)
        return 1
    return 0


def _listen_socket(host: str, port: int):
    """The server's socket, bound before anything loads: a port in use is exit 2 in a second,
    not a failure after minutes of loading and compiling."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {err.strerror or err} (another "
                         "server there? choose another --port)") from None
    return sock


def _models_file_options(args: argparse.Namespace):
    """Server options for `--models FILE`, after checking every entry as `--model` is
    checked (folder, config.json, preset, options, devices) before the socket opens."""
    import jax

    from jaxserve.engine import multihost
    from jaxserve.fleet.models_file import read_models_file
    from jaxserve.server.state import ServerOptions

    given = [f"--{name.replace('_', '-')}" for name in ("model", "config", "dtype",
                                                        "served_model_name", "revision",
                                                        "chat_template", "tokenizer")
             if getattr(args, name) is not None] + [f"--{k.replace('_', '-')}"
                                                     for k in flag_options(args)]
    if given:
        raise ValueError(f"--models takes each model's settings from the file; drop {given}")
    if multihost.is_multiprocess():
        raise ValueError("--models runs on one host; a multi-host slice serves one --model")
    entries = read_models_file(args.models, jax.local_device_count())
    for entry in entries:
        if entry.is_adapter:
            continue  # checked with its base
        adapters = tuple((a.pinned_id, a.lora_path) for a in entries
                         if a.base == entry.pinned_id)
        try:
            _check_before_serving(entry.path, entry.dtype, entry.config, entry.options(),
                                  adapters)
        except ValueError as err:
            raise ValueError(f"{args.models}: {entry.pinned_id}: {err}") from None
    return ServerOptions(models_file=args.models)


def _reload_on_sighup(state) -> None:
    """`kill -HUP` re-reads the models file (on a thread: loading takes a while); a bad file
    or a failed load is logged, and the previous models keep serving."""
    import signal
    import threading

    def reload():
        try:
            state.reload()
        except Exception as err:  # noqa: BLE001 - the old configuration keeps serving
            logging.getLogger("jaxserve.fleet").error("reload failed, the previous models "
                                                      "keep serving: %s", err)

    signal.signal(signal.SIGHUP, lambda *_: threading.Thread(
        target=reload, name="jaxserve-reload", daemon=True).start())


def _check_before_serving(model: str, dtype: str | None, config: str | None,
                          options: dict, lora_modules: tuple[tuple[str, str], ...] = ()
                          ) -> None:
    """Everything about the model and the options that can be known without reading weights
    (folder, config.json, preset, option conflicts, the mesh, the LoRA folders' configs): a
    `ValueError` here exits 2 before the socket opens, instead of a server that never
    becomes healthy."""
    from jaxserve.engine.engine import engine_mesh
    from jaxserve.llm import resolve_settings
    from jaxserve.lora.adapter import adapter_folder, read_adapter_config

    engine_config = resolve_settings(model, dtype, config, options).engine_config
    engine_mesh(engine_config)
    if lora_modules and not engine_config.enable_lora:
        raise ValueError(f"LoRA adapters ({', '.join(n for n, _ in lora_modules)}) need "
                         f"enable_lora (--enable-lora)")
    for name, path in lora_modules:
        try:
            read_adapter_config(adapter_folder(path))
        except ValueError as err:
            raise ValueError(f"LoRA adapter {name}: {err}") from None


def runtime_lora_updating(args: argparse.Namespace):
    """The operator's leave for runtime LoRA loads (`RuntimeLoRAUpdating`), or None when
    neither `--allow-runtime-lora-updating` nor `VLLM_ALLOW_RUNTIME_LORA_UPDATING` turns it
    on (`ValueError` for the roots or the Hub flag given without it)."""
    from jaxserve.lora.runtime import RuntimeLoRAUpdating, env_allows_runtime_updating

    if not (args.allow_runtime_lora_updating or env_allows_runtime_updating()):
        if args.lora_allowed_roots or args.lora_allow_hub:
            raise ValueError("--lora-allowed-roots and --lora-allow-hub apply to runtime "
                             "LoRA loads: add --allow-runtime-lora-updating")
        return None
    return RuntimeLoRAUpdating(tuple(args.lora_allowed_roots or ()), args.lora_allow_hub)


def lora_modules(values: list[str] | None) -> tuple[tuple[str, str], ...]:
    """`--lora-modules` entries, `name=path` or vLLM's JSON `{"name": ..., "path": ...}`, as
    (name, path) pairs (`ValueError` naming a malformed one)."""
    pairs = []
    for value in values or ():
        if value.lstrip().startswith("{"):
            try:
                entry = json.loads(value)
                pairs.append((str(entry["name"]), str(entry["path"])))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"--lora-modules {value!r}: a JSON entry needs \"name\" and "
                                 "\"path\"") from None
            continue
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {value!r}: expected name=path")
        pairs.append((name, path))
    if len({name for name, _ in pairs}) != len(pairs):
        raise ValueError("--lora-modules names an adapter twice")
    return tuple(pairs)


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
    serve.set_defaults(handler=_serve)


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
    from jaxserve.bench import (device_bench, load_bench, lora_bench, lora_products,
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

