"""`jaxserve serve`: one model (or a models file's several) behind the OpenAI-compatible
server, its socket bound before the models load so orchestrators see the process alive."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys

from jaxserve.cli.serve_values import (check_generation_config, check_ssl_files, cors_settings,
                                       read_chat_template, server_url, use_download_dir,
                                       with_revision)
from jaxserve.cli.settings import flag_options, resolve_model_settings
from jaxserve.server.limits import RequestLimits
from jaxserve.tool_calling import ChatParsing


def run_server(args: argparse.Namespace) -> int:
    """Run the server until it is stopped; the exit status."""
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
        # healthy once the smallest buckets' programs exist (--no-compile-in-background: all)
        engine_options.setdefault("compile_in_background", True)
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
    return ServerOptions(models_file=args.models, compile_in_background=True)


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
    from jaxserve.engine.engine_setup import engine_mesh
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
