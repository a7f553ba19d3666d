"""What the server holds: its models (`jaxserve.fleet`, loaded on a background thread), the
metrics, and the request limits (`jaxserve.server.limits`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import shlex
import threading
import time
from typing import Any, Callable

import jax

from jaxserve.fleet.fleet import ModelFleet
from jaxserve.fleet.models_file import ModelEntry, read_models_file
from jaxserve.fleet.served_model import ServedModel
from jaxserve.llm import LLM
from jaxserve.lora.runtime import RuntimeLoRAUpdating
from jaxserve.lora.slots import Adapter
from jaxserve.engine.async_engine import AsyncEngine
from jaxserve.server.generation_defaults import read_generation_defaults
from jaxserve.server.limits import RequestLimits
from jaxserve.engine.prometheus import PrometheusMetrics
from jaxserve.tool_calling import ChatParsing

log = logging.getLogger("jaxserve.server")


class ReloadBusyError(RuntimeError):
    """A reload was asked for while another one runs."""


@dataclasses.dataclass
class ServerOptions:
    """Server-level settings (the engine's are `engine_options`, or the models file's)."""

    model: str | None = None  # one model; or `models_file`
    served_model_name: list[str] | None = None
    dtype: str | None = None  # None: the preset's, else "auto"
    config: str | None = None  # deployment preset; None: cpu.toml on CPU
    api_key: str | None = None  # the inference key (`jaxserve.server.auth`)
    admin_api_key: str | None = None  # /admin/reload and the LoRA routes; None: refused
    metrics_need_api_key: bool = False  # /metrics behind the API key too
    max_body_bytes: int = 4 << 20
    max_waiting_requests: int = 1024
    request_limits: RequestLimits = RequestLimits()  # stop strings, tools, schema sizes
    engine_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    models_file: str | None = None  # several models and versions (jaxserve.fleet)
    routing_seed: int = 0  # of the weighted choice among a name's versions
    chat_parsing: ChatParsing = ChatParsing()  # tool-call and reasoning parsers, every model
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, PEFT folder) served at start
    runtime_lora: RuntimeLoRAUpdating | None = None  # None: no load/unload routes
    chat_template: str | None = None  # replaces the model's (the one model's)
    generation_config: str = "auto"  # request defaults: auto, vllm or a folder
    url: str | None = None  # where clients connect (the ready line says it)
    cors: dict | None = None  # CORSMiddleware's keywords; None: no cross-origin access
    tokenizer: str | None = None  # the one model's tokenizer from another folder or Hub id
    seed: int = 0  # of the random draws of requests without a seed (vLLM's --seed)
    # a models file's entries serve on their smallest buckets while the rest compile
    # (`jaxserve serve --models` turns it on; an entry's own option wins)
    compile_in_background: bool = False

    def __post_init__(self):
        if (self.model is None) == (self.models_file is None):
            raise ValueError("give a model or a models file (not both)")
        if self.models_file is not None and (self.chat_template or self.tokenizer):
            raise ValueError("a chat template or tokenizer replaces the one model's; a "
                             "models file serves each model with its own")
        if self.lora_modules and self.models_file is not None:
            raise ValueError("lora_modules serves adapters of the one model; a models file "
                             "cannot name adapters")
        if self.admin_api_key is not None and self.admin_api_key == self.api_key:
            raise ValueError("the admin API key must differ from the API key")
        if self.models_file is not None and (self.served_model_name or self.dtype
                                             or self.config or self.engine_options):
            raise ValueError("with a models file, give names, dtype, preset and engine "
                             "options per model in the file, not as flags")


def build_llm(entry: ModelEntry, tokenizer: str | None = None, seed: int = 0,
              compile_in_background: bool = False) -> LLM:
    """One entry's LLM: its folder, dtype and preset, its engine options on top (and the
    server's `tokenizer`, `seed` and `compile_in_background`, `ServerOptions`; an entry's
    own `compile_in_background` wins)."""
    options = {"compile_in_background": compile_in_background, **entry.options()}
    return LLM(entry.path, dtype=entry.dtype, config=entry.config, tokenizer=tokenizer,
               seed=seed, **options)


class ServerState:
    """Shared by every request handler."""

    def __init__(self, options: ServerOptions,
                 build: Callable[[ModelEntry], LLM] = build_llm):
        self.options = options
        if build is build_llm:
            build = functools.partial(build_llm, tokenizer=options.tokenizer, seed=options.seed,
                                      compile_in_background=options.compile_in_background)
        self.api_key = options.api_key
        self.admin_api_key = options.admin_api_key
        self.metrics_need_api_key = options.metrics_need_api_key
        self.max_body_bytes = options.max_body_bytes
        self.request_limits = options.request_limits
        self.chat_parsing = options.chat_parsing
        self.created = int(time.time())
        self.prometheus = PrometheusMetrics()
        self.fleet = ModelFleet(self.read_entries, build, options.max_waiting_requests,
                                self.prometheus, options.models_file is not None, self.fail,
                                options.routing_seed)
        self.fatal_error: str | None = None  # why this server cannot serve; it exits
        self.on_fatal: Callable[[], None] | None = None  # asks the server process to exit
        self.ready = False
        self._reloading = threading.Lock()  # held while a reload runs; never waited for
        self._generation_defaults: dict[str, dict] = {}  # model folder → request defaults

    def read_entries(self) -> list[ModelEntry]:
        """The models to serve: the models file's entries, or the one model of `--model`."""
        options = self.options
        if options.models_file is not None:
            return read_models_file(options.models_file, jax.local_device_count())
        names = options.served_model_name or [options.model]
        return [ModelEntry(name=names[0], path=options.model, dtype=options.dtype,
                           config=options.config, aliases=tuple(names[1:]),
                           engine_options=tuple(sorted(options.engine_options.items())))]

    # ---- the first model (the only one without a models file) ---------------------------
    @property
    def first(self) -> ServedModel | None:
        table = self.fleet.table
        return table.served[0] if table else None

    @property
    def llm(self) -> LLM | None:
        return self.first.llm if self.first else None

    @property
    def engine(self) -> AsyncEngine | None:
        return self.first.engine if self.first else None

    def lookup(self, model: str | None) -> ServedModel:
        """The version that would answer `model` now (`UnknownModelError` if none)."""
        return self.fleet.router.route(model).served

    def load_lora(self, name: str, path: str) -> Adapter:
        """Read a LoRA adapter for the model (`ValueError` naming what is wrong)."""
        return self.llm.engine.load_lora_folder(name, path)

    def find_adapter(self, name: str | None) -> tuple[ServedModel, Adapter] | None:
        """The served model with a LoRA adapter called `name` (one loaded by
        `--lora-modules` or the load route; an adapter version of the models file is routed
        as a version), and the adapter."""
        if name is None or not self.fleet.table or name in self.fleet.table.ids():
            return None
        for served in self.fleet.table.served:
            registry = served.llm.engine.loras
            adapter = None if registry is None else registry.get(name)
            if adapter is not None:
                return served, adapter
        return None

    def generation_defaults(self, served: ServedModel) -> dict:
        """The request defaults of `served`'s model (`--generation-config`; an adapter
        version: its base's), read once per model folder."""
        folder = str(served.llm.model_dir)
        if folder not in self._generation_defaults:
            self._generation_defaults[folder] = read_generation_defaults(
                self.options.generation_config, folder)
        return self._generation_defaults[folder]

    def not_ready_reason(self) -> str:
        """What a client is told while nothing serves. A fatal reason is written "what
        failed: the error"; clients get only what failed, as the error may hold paths (the
        log and the command's exit message have all of it)."""
        if self.fatal_error:
            return (f"{self.fatal_error.partition(': ')[0]}; the server is shutting down "
                    "(its log says why)")
        return "model is loading and compiling; retry shortly"

    def fail(self, reason: str) -> None:
        """Nothing more can be served (the model did not load, the engine broke): `/health`
        answers 500 from now on, and the process is asked to exit. `reason`: "what failed:
        the error" (`not_ready_reason`)."""
        self.fatal_error = reason
        self.ready = False
        log.error("cannot serve: %s; shutting down", reason)
        if self.on_fatal is not None:
            self.on_fatal()

    def load(self) -> None:
        """Load the models, warm up, start the engine threads (runs on a loader thread)."""
        try:
            self.fleet.start()
            for name, path in self.options.lora_modules:
                self.load_lora(name, path)
            if self.options.chat_template is not None and self.llm.tokenizer is not None:
                self.llm.tokenizer.chat_template = self.options.chat_template
            for served in self.fleet.table.served:
                defaults = self.generation_defaults(served)
                if defaults:
                    log.info("%s: request defaults from generation_config.json: %s",
                             served.pinned_id, defaults)
            self.ready = True
            ids = self.fleet.table.ids()
            log.info("%s", "ready: " + ", ".join(ids) if self.options.url is None else
                     ready_line(self.options.url, ids[0], self.api_key is not None,
                                pooling=self.llm.pooler is not None))
        except Exception as err:  # noqa: BLE001 - reported by /health, logged in full
            log.exception("model failed to load")
            self.fail(f"model failed to load: {err}")

    def reload(self) -> list[dict]:
        """Apply the models file again (`SIGHUP`, `POST /admin/reload`); see `ModelFleet`.
        `ReloadBusyError` while another reload runs: a second one would only queue a thread
        behind it and then re-apply the same file."""
        if self.options.models_file is None:
            raise ValueError("this server runs one model (--model); reloads need --models")
        if not self.ready:
            raise ValueError("the server is not ready yet; reload once it serves")
        if not self._reloading.acquire(blocking=False):
            raise ReloadBusyError("a reload is already running; retry once it has finished")
        try:
            return self.fleet.reload()
        finally:
            self._reloading.release()

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        loader = threading.Thread(target=self.load, name="jaxserve-loader", daemon=True)
        loader.start()
        yield
        self.ready = False
        self.fleet.close()  # multi-host: releases the follower processes


def ready_line(url: str, model_id: str, api_key: bool, pooling: bool = False) -> str:
    """The one line logged when the server is ready: where to connect, the model's id, and a
    request to paste (an embedding for a `--runner pooling` server)."""
    route = "/v1/embeddings" if pooling else "/v1/completions"
    body = json.dumps({"model": model_id, "input": "Once upon a time"} if pooling else
                      {"model": model_id, "prompt": "Once upon a time", "max_tokens": 24})
    auth = ' -H "Authorization: Bearer $JAXSERVE_API_KEY"' if api_key else ""
    return (f"ready: serving {model_id} at {url} — try: curl {url}{route} "
            f"-H 'Content-Type: application/json'{auth} -d {shlex.quote(body)}")
