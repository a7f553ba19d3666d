"""The flags of `jaxserve serve`, in named groups (model, engine, server, requests, chat,
LoRA, multi-host), spelled and meant as vLLM's where vLLM has the flag.

Every flag has help, and the default a help text shows is the one that runs: an engine
option the CPU preset sets shows the preset's value beside the built-in one, and
`--max-model-len` says it is the model's own. vLLM flags jaxserve cannot honour are
refused (exit 2) with one line naming what jaxserve has instead (`VLLM_FLAGS_REFUSED`).
"""

from __future__ import annotations

import argparse
import json

from jaxserve.server.limits import RequestLimits
from jaxserve.tool_calling import REASONING_PARSERS, TOOL_PARSERS

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # vLLM's
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")

# vLLM's flags that have no meaning here → what jaxserve offers instead
VLLM_FLAGS_REFUSED = {
    "--block-size": "use --page-size",
    "--swap-space": "preempted requests are recomputed, never swapped to host memory",
    "--cpu-offload-gb": "weights stay on the device: quantize them (--quantization) or "
                        "split them (--tensor-parallel-size)",
    "--enforce-eager": "every program is compiled at start-up (--token-buckets, "
                       "--seq-buckets); --strict-compile makes a later compile an error",
    "--max-seq-len-to-capture": "every bucket is compiled at start-up (--token-buckets, "
                                "--seq-buckets)",
    "--pipeline-parallel-size": "use --tensor-parallel-size and --data-parallel-size",
    "-pp": "use --tensor-parallel-size and --data-parallel-size",
    "--distributed-executor-backend": "several hosts run through jax.distributed: "
                                      "--coordinator-address, --num-processes, --process-id",
    "--trust-remote-code": "jaxserve runs its own code for the architectures it supports; "
                           "no model code is downloaded",
    "--tokenizer-mode": "tokenizer.json is read by the tokenizers library; there is no "
                        "other mode",
    "--load-format": "weights load from safetensors, or from an orbax checkpoint "
                     "(`jaxserve convert`)",
    "--enable-chunked-prefill": "prefill is always chunked; --max-num-batched-tokens bounds "
                                "a step",
    "--enable-log-requests": "jaxserve never logs a request's prompt or parameters; the "
                             "access log lists each request",
    "--uds": "listen on --host and --port",
}


class _Refused(argparse.Action):
    """A vLLM flag jaxserve cannot honour: exit 2 with one line naming the equivalent."""

    def __init__(self, option_strings, dest, instead: str = "", **kwargs):
        super().__init__(option_strings, argparse.SUPPRESS, nargs="?",
                         default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        self.instead = instead

    def __call__(self, parser, namespace, values, option_string=None):
        parser.exit(2, f"jaxserve: error: {option_string} is a vLLM flag jaxserve does not "
                       f"support: {self.instead}\n")


def _json_object(text: str) -> dict:
    """A flag's JSON object (`--speculative-config '{"method": "ngram", ...}'`)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text}")
    return value


# an engine option's kind → how its flag parses a value
FLAG_TYPES = {"int": int, "float": float, "str": str, "ints": int, "table": _json_object}


def _shown_default(spec, cpu_options: dict) -> str | None:
    """What an engine option's help says its default is: the value that runs when the flag
    is left out (the model's own for max_model_len; the CPU preset's on CPU)."""
    if spec.name == "max_model_len":
        return "the model's max_position_embeddings"
    builtin = None if spec.default in (None, ()) else spec.default
    if spec.name in cpu_options:
        preset = cpu_options[spec.name]
        preset = " ".join(map(str, preset)) if isinstance(preset, (list, tuple)) else preset
        elsewhere = "" if builtin is None else f", {builtin} elsewhere"
        return f"{preset} on CPU (the cpu preset){elsewhere}"
    return None if builtin is None else str(builtin)


def add_model_options(parser, engine=None, preset_required: bool = False) -> None:
    """--model, --config, --dtype, and (in group `engine`, default: `parser`) a flag per
    engine option, derived from `EngineConfig` (`--max-num-seqs N`,
    `--[no-]enable-prefix-caching`, `--token-buckets 16 32 ...`). A flag left out is None,
    so only the flags the user gives override the preset. `preset_required` (`plan`): every
    default is the preset's, not the CPU one's."""
    from jaxserve.config.engine import option_specs
    from jaxserve.presets import CPU_PRESET, load_preset

    cpu_options = load_preset(CPU_PRESET).engine_options
    parser.add_argument("--model", default=None,
                        help="Hugging Face model folder, Hub id (ORG/NAME[@REVISION], "
                             "through the local HF cache; HF_HUB_OFFLINE=1 reads only it) or "
                             "jaxserve orbax checkpoint (default: austen-3.4m, the small model "
                             "shipped with jaxserve)")
    parser.add_argument("--config", default=None,
                        help="deployment preset: a shipped one's name (v6e-8, h200-1; "
                             "`jaxserve plan --list`) or a TOML file (default: cpu on CPU, "
                             "none elsewhere)")
    parser.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16"],
                        help="the dtype the model runs in (default: the preset's, float32 on "
                             "CPU; else auto: the checkpoint's, float16 as bfloat16)")
    engine = parser if engine is None else engine
    for spec in option_specs():
        names = (spec.flag, *spec.aliases)
        shown = "the preset's" if preset_required else _shown_default(spec, cpu_options)
        if shown is None:
            help_text = spec.help
        elif spec.help.endswith(")") and "(default: " in spec.help:  # one default, not two
            help_text = f"{spec.help[:-1]}; {shown})"
        else:
            help_text = f"{spec.help} (default: {shown})"
        if spec.kind == "bool":
            engine.add_argument(*names, action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
        else:
            engine.add_argument(*names, dest=spec.name, type=FLAG_TYPES[spec.kind],
                                default=None, choices=spec.choices,
                                nargs="+" if spec.kind == "ints" else None, help=help_text)


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    """Every flag of `jaxserve serve`, in its group."""
    model = serve.add_argument_group("model")
    engine = serve.add_argument_group("engine", "the engine's options (over the preset's)")
    add_model_options(model, engine)
    model.add_argument("--models", default=None, metavar="MODELS.toml",
                       help="several models and versions from a models file (names, "
                            "versions, weights, presets, devices, fallbacks; see README); "
                            "SIGHUP or POST /admin/reload re-reads it")
    model.add_argument("--served-model-name", nargs="+", default=None,
                       help="model name(s) clients send as `model` (default: austen-3.4m for "
                            "the shipped model, else the --model value as given)")
    model.add_argument("--tokenizer", default=None,
                       help="take the tokenizer from this folder or Hub id (default: the "
                            "model's)")
    model.add_argument("--revision", default=None,
                       help="the Hub branch, tag or commit of --model (the same as "
                            "--model ORG/NAME@REVISION; default: main)")
    model.add_argument("--download-dir", default=None,
                       help="where Hub models are downloaded and read from (default: the "
                            "Hugging Face cache, HF_HUB_CACHE)")
    model.add_argument("--chat-template", default=None,
                       help="the chat template: a file, or the template itself (default: "
                            "the model's tokenizer_config.json or chat_template.jinja)")
    model.add_argument("--generation-config", default="auto",
                       help="request defaults for the fields a request leaves out "
                            "(temperature, top_p, top_k, min_p, repetition_penalty, and "
                            "max_new_tokens as max_tokens): auto reads the model's "
                            "generation_config.json, a folder reads its own, vllm uses "
                            "none (default: auto)")

    engine.add_argument("--seed", type=int, default=0,
                        help="seed of the random draws of requests that give no seed of "
                             "their own (default: 0)")

    server = serve.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default: 127.0.0.1; 0.0.0.0 exposes it)")
    server.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    server.add_argument("--root-path", default=None,
                        help="the path prefix a proxy serves this server under (ASGI "
                             "root_path; default: none)")
    server.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this key file")
    server.add_argument("--ssl-certfile", default=None,
                        help="serve HTTPS with this certificate file")
    server.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                        help="web origins allowed to call the API from a browser (CORS; '*' "
                             "for any; default: none, unlike vLLM's '*': a page on any site "
                             "could otherwise use a server on 127.0.0.1)")
    server.add_argument("--allow-credentials", action="store_true",
                        help="with --allowed-origins: allow cookies and authorization "
                             "headers across origins (default: off)")
    server.add_argument("--allowed-methods", nargs="+", default=["*"], metavar="METHOD",
                        help="with --allowed-origins: the HTTP methods allowed (default: *)")
    server.add_argument("--allowed-headers", nargs="+", default=["*"], metavar="HEADER",
                        help="with --allowed-origins: the request headers allowed "
                             "(default: *)")
    server.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1, the tokenizer and "
                             "the info routes; prefer the environment (JAXSERVE_API_KEY or "
                             "VLLM_API_KEY), as a flag shows in ps")
    server.add_argument("--admin-api-key", default=None,
                        help="the key of /admin/reload and the LoRA load/unload routes, "
                             "which are refused without one; prefer JAXSERVE_ADMIN_API_KEY")
    server.add_argument("--metrics-need-api-key", action="store_true",
                        help="require the API key on /metrics too (default: open, for "
                             "scrapers)")
    server.add_argument("--drain-timeout", type=int, default=300,
                        help="seconds to let in-flight requests finish after SIGTERM "
                             "(default: 300)")
    server.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                        help="the level of jaxserve's log, and of the HTTP server's unless "
                             "--uvicorn-log-level says (default: info)")
    server.add_argument("--uvicorn-log-level", default=None, choices=UVICORN_LOG_LEVELS,
                        help="the level of the HTTP server's log, its access log included "
                             "(default: --log-level's)")
    server.add_argument("--disable-uvicorn-access-log", action="store_true",
                        help="no log line per HTTP request")
    server.add_argument("--disable-log-requests", action="store_true",
                        help="accepted as vLLM takes it: jaxserve never logs a request's "
                             "prompt or parameters")

    requests = serve.add_argument_group("requests")
    requests.add_argument("--max-body-bytes", type=int, default=4 << 20,
                          help="largest request body; larger ones get 413 (default: 4194304)")
    requests.add_argument("--max-waiting-requests", type=int, default=1024,
                          help="beyond this many queued requests answer 429 (default: 1024)")
    requests.add_argument("--max-logprobs", type=int, default=RequestLimits.max_logprobs,
                          help="most log-probabilities a request may ask per token "
                               "(logprobs, top_logprobs, prompt_logprobs; 400 beyond; "
                               f"default: {RequestLimits.max_logprobs}, the most the engine "
                               "computes)")
    requests.add_argument("--max-stop-strings", type=int,
                          default=RequestLimits.max_stop_strings,
                          help="most stop strings a request may give (400 beyond; "
                               f"default: {RequestLimits.max_stop_strings})")
    requests.add_argument("--max-stop-string-chars", type=int,
                          default=RequestLimits.max_stop_string_chars,
                          help="longest stop string, in characters (default: "
                               f"{RequestLimits.max_stop_string_chars})")
    requests.add_argument("--max-tools", type=int, default=RequestLimits.max_tools,
                          help="most tools a chat request may give (default: "
                               f"{RequestLimits.max_tools})")
    requests.add_argument("--max-schema-bytes", type=int,
                          default=RequestLimits.max_schema_bytes,
                          help="largest tool entry and output constraint (JSON schema, "
                               "regex, choices, grammar), in bytes (default: "
                               f"{RequestLimits.max_schema_bytes})")

    chat = serve.add_argument_group("chat")
    chat.add_argument("--enable-auto-tool-choice", action="store_true",
                      help='answer tool_choice "auto" (the default with tools) by parsing '
                           "the model's calls with --tool-call-parser")
    chat.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                      help="the format the model writes tool calls in (vLLM's names)")
    chat.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                      help="split <think> reasoning into reasoning_content")

    lora = serve.add_argument_group("LoRA")
    lora.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                      help="LoRA adapters (PEFT folders) to serve at start, as vLLM takes "
                           "them: name=path or '{\"name\": ..., \"path\": ...}'; requests "
                           "name them as their model (needs --enable-lora)")
    lora.add_argument("--allow-runtime-lora-updating", action="store_true",
                      help="register POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                           "(or VLLM_ALLOW_RUNTIME_LORA_UPDATING=1/true); needs "
                           "--lora-allowed-roots and/or --lora-allow-hub")
    lora.add_argument("--lora-allowed-roots", nargs="+", default=None, metavar="DIR",
                      help="runtime loads: lora_path must be a folder under one of these")
    lora.add_argument("--lora-allow-hub", action="store_true",
                      help="runtime loads: lora_path may be a Hugging Face Hub id (fetched "
                           "with the server's token)")

    hosts = serve.add_argument_group("multi-host")
    hosts.add_argument("--coordinator-address", default=None,
                       help="multi-host: host:port of process 0 (or JAX_COORDINATOR_ADDRESS)")
    hosts.add_argument("--num-processes", type=int, default=None,
                       help="multi-host: how many processes (hosts) serve together")
    hosts.add_argument("--process-id", type=int, default=None,
                       help="multi-host: this process's index, 0 to --num-processes - 1")

    for flag, instead in VLLM_FLAGS_REFUSED.items():
        serve.add_argument(flag, action=_Refused, instead=instead)
