"""One model version the server runs: its `LLM` (weights, engine, KV pool) and the thread
that steps it (`AsyncEngine`), from load through serving to draining and release.

Life of a version: `load` (weights, then warm-up: every bucket program compiled or read
from the cache) → serving → `retire` (no new requests; a reload removed or replaced it) →
drained (its in-flight requests finished) → `close` (engine thread stopped, device memory
deleted). A version whose engine gave up stays `failed` until a reload replaces it; the
router sends its requests to its fallback meanwhile.

An `AdapterVersion` (a models-file entry with `base` and `lora_path`) is a base version's
engine plus a LoRA adapter: it loads only the adapter's folder, and releasing it forgets the
adapter, never the base's engine.
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
from jaxserve.lora.slots import Adapter
from jaxserve.engine.async_engine import AsyncEngine

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
        self.adapter: Adapter | None = None  # what every request it answers runs with
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
        if self.llm.pooler is not None:
            self.llm.pooler.close()


class AdapterVersion(ServedModel):
    """A version served by another version's engine with a LoRA adapter: requests routed
    here run on `base`'s engine and queue with `adapter`."""

    def __init__(self, entry: ModelEntry, base: ServedModel, adapter: Adapter,
                 load_seconds: float):
        self.entry, self.base, self.adapter = entry, base, adapter
        self.llm, self.engine, self.seat = base.llm, base.engine, base.seat
        self.device_ids = base.device_ids
        self.load_seconds, self.warm_up_seconds = load_seconds, 0.0
        self._closed = threading.Event()

    @classmethod
    def attach(cls, entry: ModelEntry, base: ServedModel) -> "AdapterVersion":
        """Read `entry`'s adapter folder for `base`'s engine (`ValueError` naming what is
        wrong: no `enable_lora` on the base, a folder that does not fit its model)."""
        started = time.perf_counter()
        engine = base.llm.engine
        if engine.loras is None:
            raise ValueError(f"base {base.pinned_id} runs without enable_lora; an adapter "
                             f"version needs it (and max_loras, max_lora_rank) on its base")
        adapter = engine.load_lora_folder(entry.pinned_id, entry.lora_path, replace=True)
        log.info("%s ready: %s on %s", entry.pinned_id, entry.lora_path, base.pinned_id)
        return cls(entry, base, adapter, time.perf_counter() - started)

    @property
    def failure(self) -> str | None:
        return self.base.failure  # the base's engine is this version's

    @property
    def model_dir(self) -> Path:
        return self.base.model_dir

    def update(self, entry: ModelEntry, max_waiting: int) -> None:
        self.entry = entry  # the queue limit is the base's

    def retire(self) -> None:
        """Nothing to refuse: the base's engine serves on; the new table no longer routes
        here, and a request that chose this version a moment ago still runs with its
        adapter."""

    def drain_and_close(self) -> None:
        self.close()  # its requests finish with the adapter after it is forgotten

    def close(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            self.llm.engine.forget_lora(self.adapter)
