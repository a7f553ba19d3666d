"""The server's model versions: loaded at start, routed to, reloaded while serving.

Start-up loads every entry in file order (weights, then warm-up), so on a shared device each
engine's KV cache is its `kv_cache_memory_fraction` of what the engines before it left free
(the same order `jaxserve plan --models` checks).

A reload (`SIGHUP` or `POST /admin/reload`) re-reads the file and never fails a request:
1. the file is read and checked; a bad file changes nothing (the old configuration serves);
2. versions that are new, or whose path, preset, dtype or engine options changed, load and
   warm up while the old ones keep serving; if any fails to load, the ones loaded for this
   reload are released and nothing else changes;
3. one new routing table is published (weights, fallbacks, versions: all at once);
4. versions no longer in the file (or replaced) take no new requests, finish those in
   flight, then stop and free their device memory, on a background thread each.
A version that only changed weight, fallback or queue limit keeps its engine. A version whose
engine failed is loaded anew by a reload of the same file. An adapter version (`base` and
`lora_path`) is loaded after the model versions, onto its base's engine; it is kept while its
base and folder are, and loaded anew onto a base that was.

A `Timeline` records each phase with its time since the reload began (load, loaded with the
weights' and warm-up's seconds, switch, drain, freed), which `POST /admin/reload` returns and
the log shows.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from jaxserve.fleet.device_turns import DeviceTurns
from jaxserve.fleet.models_file import ModelEntry
from jaxserve.fleet.routing import ModelRouter, RoutingTable
from jaxserve.fleet.served_model import AdapterVersion, ServedModel
from jaxserve.llm import LLM
from jaxserve.engine.prometheus import PrometheusMetrics

log = logging.getLogger("jaxserve.fleet")


class ReloadError(RuntimeError):
    """A reload could not load a new version; the previous configuration keeps serving."""


class ModelFleet:
    """Every model version of one server, with the router that picks among them."""

    def __init__(self, read_entries: Callable[[], list[ModelEntry]],
                 build: Callable[[ModelEntry], LLM], max_waiting: int,
                 metrics: PrometheusMetrics, pinned_ids: bool,
                 on_unservable: Callable[[str], None], seed: int = 0):
        """`read_entries`: (re-)reads the models file; `build`: loads one entry's LLM;
        `pinned_ids`: whether responses and metrics name versions by pinned id (a models
        file) or by name (one model); `on_unservable`: called when no version can serve."""
        self.read_entries, self.build = read_entries, build
        self.max_waiting, self.metrics, self.pinned_ids = max_waiting, metrics, pinned_ids
        self.on_unservable = on_unservable
        self.router = ModelRouter(seed)
        self.turns = DeviceTurns()
        self.timeline = Timeline()  # the latest reload's phases
        self._reload_lock = threading.Lock()
        self._drains: list[threading.Thread] = []
        self.draining: tuple[ServedModel, ...] = ()  # removed versions still finishing requests
        self._draining_lock = threading.Lock()  # reloads add to it, drain threads remove

    @property
    def table(self) -> RoutingTable | None:
        return self.router.table

    def public_id(self, served: ServedModel) -> str:
        """How responses and metrics name a version."""
        return served.pinned_id if self.pinned_ids else served.entry.name

    # ---- start ---------------------------------------------------------------------------
    def start(self) -> None:
        """Load every entry of the file and publish them (raises if any fails to load)."""
        entries = self.read_entries()
        loaded = self._load(entries, Timeline())
        self.router.publish(RoutingTable([(loaded[e.pinned_id], e) for e in entries]))

    def _load(self, entries: list[ModelEntry], timeline: Timeline,
              kept: dict[str, ServedModel] | None = None) -> dict[str, ServedModel]:
        """Load `entries`, model versions in order, then adapter versions onto their bases
        (loaded here or `kept`); on a failure release those loaded and raise."""
        loaded: dict[str, ServedModel] = {}
        for entry in sorted(entries, key=lambda e: e.is_adapter):
            timeline.mark("load", entry.pinned_id)
            try:
                if entry.is_adapter:
                    base = loaded.get(entry.base) or kept[entry.base]
                    served = AdapterVersion.attach(entry, base)
                else:
                    served = ServedModel.load(entry, self.build, self.max_waiting,
                                              self.turns, self._engine_failed)
            except Exception as err:
                for done in reversed(loaded.values()):  # adapters before their bases
                    if done.adapter is None:
                        self.metrics.detach(done.llm.engine, self.public_id(done))
                    done.close()
                raise ReloadError(f"{entry.pinned_id} failed to load: {err}") from err
            if not entry.is_adapter:  # an adapter version's engine is its base's
                self.metrics.attach(served.llm.engine, self.public_id(served))
            timeline.mark("loaded", entry.pinned_id, weights_s=round(served.load_seconds, 2),
                          warm_up_s=round(served.warm_up_seconds, 2))
            loaded[entry.pinned_id] = served
        return loaded

    # ---- reload --------------------------------------------------------------------------
    def reload(self) -> list[dict]:
        """Re-read the file and apply it (see the module docstring); returns the timeline.
        `ValueError`: the file is bad; `ReloadError`: a version did not load. Either way
        the previous configuration keeps serving."""
        with self._reload_lock:
            timeline = self.timeline = Timeline()
            entries = self.read_entries()
            current = dict(self.table.pinned)
            kept = {e.pinned_id: current[e.pinned_id] for e in entries
                    if e.pinned_id in current and current[e.pinned_id].failure is None
                    and current[e.pinned_id].entry.engine_definition()
                    == e.engine_definition()}
            kept = {pinned: served for pinned, served in kept.items()  # and their bases
                    if not served.entry.is_adapter or served.entry.base in kept}
            loaded = self._load([e for e in entries if e.pinned_id not in kept], timeline,
                                kept)
            serving = {**kept, **loaded}
            self.router.publish(RoutingTable([(serving[e.pinned_id], e) for e in entries]))
            for entry in entries:
                if entry.pinned_id in kept:
                    kept[entry.pinned_id].update(entry, self.max_waiting)
            timeline.mark("switch", ", ".join(e.pinned_id for e in entries))
            for old in current.values():
                if serving.get(old.pinned_id) is not old:
                    self._retire(old, timeline)
            return list(timeline.events)

    def _retire(self, served: ServedModel, timeline: Timeline) -> None:
        """Stop routing to `served`; drain and free it on a background thread (which adds
        "freed" to the timeline of the reload that removed it)."""
        served.retire()
        with self._draining_lock:  # readers see the old tuple or the new one
            self.draining += (served,)
        timeline.mark("drain", served.pinned_id, in_flight=served.engine.num_in_flight)

        def drain():
            served.drain_and_close()
            with self._draining_lock:
                self.draining = tuple(s for s in self.draining if s is not served)
            if served.adapter is None:
                self.metrics.detach(served.llm.engine, self.public_id(served))
            timeline.mark("freed", served.pinned_id)

        thread = threading.Thread(target=drain, name=f"jaxserve-drain-{served.pinned_id}",
                                  daemon=True)
        self._drains = [t for t in self._drains if t.is_alive()] + [thread]
        thread.start()

    def wait_drained(self, timeout: float | None = None) -> None:
        """Wait for the versions removed by reloads to be freed."""
        for thread in list(self._drains):
            thread.join(timeout)

    # ---- failures and shutdown -----------------------------------------------------------
    def _engine_failed(self, served: ServedModel, reason: str) -> None:
        """An engine gave up: its requests go to its fallback from now on; when no version
        of the server can serve any more, the server is unservable (it exits)."""
        served.failure = reason
        log.error("%s failed: %s", served.pinned_id, reason)
        table = self.table
        if table is None or all(s.failure is not None for s in table.served):
            self.on_unservable(reason)

    def close(self) -> None:
        """Stop every engine thread (the server is shutting down)."""
        for served in list(self.table.served) if self.table else []:
            if served.adapter is not None:
                continue  # its engine is its base's
            served.engine.stop()
            served.llm.engine.shutdown()



class Timeline:
    """The phases of one reload, each with its time since the reload began."""

    def __init__(self):
        self.started = time.monotonic()
        self.events: list[dict] = []

    def mark(self, phase: str, model: str, **details) -> None:
        event = {"t": round(time.monotonic() - self.started, 3), "phase": phase,
                 "model": model, **details}
        self.events.append(event)
        log.info("models: %s %s %s", phase, model,
                 " ".join(f"{k}={v}" for k, v in {"t": event["t"], **details}.items()))
