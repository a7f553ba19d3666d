"""One model version the server runs: its `LLM` (weights, engine, KV pool) and the thread
that steps it (`AsyncEngine`), from load through serving to draining and release.

Life of a version: `load` (weights, then warm-up: every bucket program compiled or read
from the cache) → serving → `retire` (no new requests; a reload removed or replaced it) →
drained (its in-flight requests finished) → `close` (engine thread stopped, device memory
deleted). A version whose engine gave up stays `failed` until a reload replaces it; the
router sends its requests to its fallback meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable

from jaxserve.fleet.device_turns import DeviceTurns
from jaxserve.fleet.models_file import ModelEntry
from jaxserve.llm import LLM
from jaxserve.server.async_engine import AsyncEngine

log = logging.getLogger("jaxserve.fleet")


class ServedModel:
    """A loaded model version and its engine thread; what a request handler talks to."""

    def __init__(self, entry: ModelEntry, llm: LLM, max_waiting: int, turns: DeviceTurns,
                 on_failure: Callable[["ServedModel", str], None], load_seconds: float = 0.0):
        self.entry = entry
        self.llm = llm
        self.device_ids = tuple(d.id for d in llm.engine.mesh.devices.flat)
        self.seat = turns.seat(self.device_ids)
        self.engine = AsyncEngine(llm.engine, max_waiting,
                                  on_failure=lambda reason: on_failure(self, reason),
                                  seat=self.seat)
        self.warm_up_seconds = sum(r.runner.warm_up_seconds for r in llm.engine.replicas)
        self.load_seconds = load_seconds - self.warm_up_seconds  # weights, before warm-up
        self.failure: str | None = None  # why its engine gave up
        self._closed = threading.Event()

    @classmethod
    def load(cls, entry: ModelEntry, build: Callable[[ModelEntry], LLM], max_waiting: int,
             turns: DeviceTurns, on_failure: Callable[["ServedModel", str], None]
             ) -> "ServedModel":
        """Build `entry`'s LLM (weights and warm-up) and start its engine thread."""
        started = time.perf_counter()
        llm = build(entry)
        served = cls(entry, llm, entry.max_waiting_requests or max_waiting, turns, on_failure,
                     time.perf_counter() - started)
        served.engine.start()
        log.info("%s ready: weights %.1f s, warm-up %.1f s, devices %s", entry.pinned_id,
                 served.load_seconds, served.warm_up_seconds, list(served.device_ids))
        return served

    # ---- what request handlers read -----------------------------------------------------
    @property
    def pinned_id(self) -> str:
        return self.entry.pinned_id

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.llm.engine_config.max_model_len

    @property
    def model_dir(self) -> Path:
        return Path(self.entry.path)

    # ---- lifecycle ----------------------------------------------------------------------
    def update(self, entry: ModelEntry, max_waiting: int) -> None:
        """Take a reloaded entry that keeps this engine (same path, preset and options):
        new weight, fallback or queue limit."""
        self.entry = entry
        self.engine.max_waiting = entry.max_waiting_requests or max_waiting

    def retire(self) -> None:
        """Take no new requests; the ones in flight finish."""
        self.engine.retire()

    def drain_and_close(self) -> None:
        """Wait until no request is in flight (not at all once the engine failed: its
        requests were answered with errors), then stop the engine thread and free the
        device memory."""
        while self.engine.num_in_flight and self.failure is None:
            time.sleep(0.02)
        self.close()

    def close(self) -> None:
        """Stop the engine thread and delete the device buffers (idempotent)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self.engine.stop()
        self.seat.leave()
        self.llm.engine.shutdown()
        self.llm.engine.release()
