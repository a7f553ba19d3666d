"""What the server holds: the model (loaded on a background thread), the engine bridge,
metrics, and the request limits."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from typing import Any, Callable

from jaxserve.llm import LLM
from jaxserve.server.async_engine import AsyncEngine
from jaxserve.server.prometheus import PrometheusMetrics

log = logging.getLogger("jaxserve.server")


@dataclasses.dataclass
class ServerOptions:
    """Server-level settings (the engine's are `engine_options`)."""

    model: str
    served_model_name: list[str] | None = None
    dtype: str | None = None  # None: the preset's, else "auto"
    config: str | None = None  # deployment preset; None: cpu.toml on CPU
    api_key: str | None = None
    metrics_need_api_key: bool = False  # /metrics behind the API key too
    max_body_bytes: int = 4 << 20
    max_waiting_requests: int = 1024
    engine_options: dict[str, Any] = dataclasses.field(default_factory=dict)


class ServerState:
    """Shared by every request handler."""

    def __init__(self, options: ServerOptions,
                 load: Callable[[ServerOptions], LLM] | None = None):
        self.options = options
        self.api_key = options.api_key
        self.metrics_need_api_key = options.metrics_need_api_key
        self.max_body_bytes = options.max_body_bytes
        self.model_names = options.served_model_name or [options.model]
        self.created = int(time.time())
        self._load = load or (lambda o: LLM(o.model, dtype=o.dtype, config=o.config,
                                                  **o.engine_options))
        self.llm: LLM | None = None
        self.engine: AsyncEngine | None = None
        self.prometheus: PrometheusMetrics | None = None
        self.fatal_error: str | None = None  # why this server cannot serve; it exits
        self.on_fatal: Callable[[], None] | None = None  # asks the server process to exit
        self.ready = False

    @property
    def max_model_len(self) -> int | None:
        return self.llm.engine_config.max_model_len if self.llm else None

    def not_ready_reason(self) -> str:
        return self.fatal_error or "model is loading and compiling; retry shortly"

    def fail(self, reason: str) -> None:
        """Nothing more can be served (the model did not load, the engine broke): `/health`
        answers 500 with `reason` from now on, and the process is asked to exit."""
        self.fatal_error = reason
        self.ready = False
        log.error("cannot serve: %s; shutting down", reason)
        if self.on_fatal is not None:
            self.on_fatal()

    def load(self) -> None:
        """Load the model, warm up, start the engine thread (runs on a loader thread)."""
        try:
            self.llm = self._load(self.options)
            self.prometheus = PrometheusMetrics(self.llm.engine, self.model_names[0])
            self.engine = AsyncEngine(self.llm.engine, self.options.max_waiting_requests,
                                      on_failure=self.fail)
            self.engine.start()
            self.ready = True
            log.info("model ready: %s", self.model_names[0])
        except Exception as err:  # noqa: BLE001 - reported by /health, logged in full
            log.exception("model failed to load")
            self.fail(f"model failed to load: {err}")

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        loader = threading.Thread(target=self.load, name="jaxserve-loader", daemon=True)
        loader.start()
        yield
        self.ready = False
        if self.engine is not None:
            self.engine.stop()
            self.llm.engine.shutdown()  # multi-host: release the follower processes
