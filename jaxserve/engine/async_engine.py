"""Runs the engine on a background thread and streams its outputs to asyncio handlers.

The engine is single-threaded: one thread steps it in a loop while requests exist, inside
turns of its devices when it has a seat on them (`jaxserve.fleet.device_turns`: devices that
other engines may share). HTTP handlers submit requests and aborts through the engine's
thread-safe inbox and read their `StreamDelta`s from an `asyncio.Queue` fed with
`call_soon_threadsafe`. A handler that stops listening (client disconnected) aborts its
request, which frees its pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import AsyncIterator, Callable, ContextManager, Protocol

from jaxserve.engine.engine import Engine
from jaxserve.engine.output_processor import StreamDelta, merge_deltas
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.engine.sequence import Sequence, Status
from jaxserve.lora.slots import Adapter

log = logging.getLogger("jaxserve.server")


class Seat(Protocol):
    """What the engine asks of its seat on devices other engines may share
    (`jaxserve.fleet.device_turns.Seat`)."""

    def turn(self) -> ContextManager[None]: ...

    def shared(self) -> bool: ...


class QueueFullError(RuntimeError):
    """More requests are waiting than the server accepts; the client should retry later."""


class EngineDeadError(RuntimeError):
    """The engine failed this request (its step raised, or the engine gave up); HTTP 500."""


class RetiredError(RuntimeError):
    """The engine takes no new requests (its model version is being removed); route the
    request again."""


class AsyncEngine:
    """Bridges the engine thread and asyncio request handlers."""

    def __init__(self, engine: Engine, max_waiting: int,
                 on_step: Callable[[list[StreamDelta]], None] | None = None,
                 on_failure: Callable[[str], None] | None = None,
                 seat: Seat | None = None):
        self.engine = engine
        self.max_waiting = max_waiting
        self.on_step = on_step  # called on the engine thread after every step
        self.on_failure = on_failure  # called once if the engine gives up, with the reason
        self.seat = seat  # turns on the devices other engines may share (None: not shared)
        self._retired = False  # submits refused from now on (the version is being removed)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._sequences: dict[str, Sequence] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._dead: str | None = None  # why the engine thread gave up
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the engine thread (after the server drained its requests)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._sequences)

    def retire(self) -> None:
        """Refuse new requests (`RetiredError`); those already submitted carry on. Once this
        returns, `num_in_flight` only falls."""
        with self._lock:
            self._retired = True

    # ---- engine thread ------------------------------------------------------------------
    def _run(self) -> None:
        """Step while requests exist and hand out the deltas. A failed step fails only its
        own requests (inside `step`); anything raised here (the engine gave up, or handing
        out its deltas failed) ends the thread, so every request fails and `on_failure`
        marks the engine dead: no request would be answered again."""
        try:
            while not self._stop.is_set():
                if not self.engine.has_unfinished():
                    self.engine.adopt_programs()  # while warming: programs landed meanwhile
                    self._wake.wait(timeout=0.1)
                    self._wake.clear()
                    continue
                deltas = self._step_once()
                if self.on_step is not None:
                    self.on_step(deltas)
                self._deliver(deltas)
        except Exception as err:  # noqa: BLE001 - the engine thread cannot go on
            log.exception("the engine cannot serve any more; failing every request")
            try:
                if self.on_failure is not None:
                    self.on_failure(f"the engine failed: {err}")
            finally:
                self._fail_all(str(err))

    def _step_once(self) -> list[StreamDelta]:
        """One step of the engine, in a turn of its devices if it has a seat on them.

        Alone on its devices, `step()` dispatches the next step before it reads the last
        (host and device overlap; the device holds up to two of its steps). On devices
        shared with another engine, the step left in flight is read first, outside the
        turn, so the engine has at most one step on the device and a turn is one dispatch:
        an engine that asks for a turn waits for at most one of ours, and reading its own
        step never waits for another engine's turn. A step there is one decode step, never
        a loop of `num_decode_steps` (requests that do not stream lose that speed-up while
        the devices are shared)."""
        if self.seat is None or not self.seat.shared():
            with self.seat.turn() if self.seat else contextlib.nullcontext():
                return self.engine.step()
        deltas = self.engine.read_in_flight() if self.engine.has_in_flight else []
        if not self.engine.has_unfinished():
            return deltas
        with self.seat.turn():
            return deltas + self.engine.step(max_decode_steps=1)

    def _deliver(self, deltas: list[StreamDelta]) -> None:
        """Hand a step's deltas to their readers: one wake-up per event loop, not per delta."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        orphans = []
        with self._lock:
            for delta in deltas:
                target = self._streams.get(delta.request_id)
                if target is not None:
                    loop, queue = target
                    by_loop.setdefault(loop, []).append((delta.request_id, queue, delta))
                elif delta.finished:  # its reader left: nobody will collect it
                    orphans.append(delta.request_id)
        for request_id in orphans:
            self._collect_orphan(request_id)
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(self._hand_over, items)

    def _hand_over(self, items: list[tuple[str, asyncio.Queue, StreamDelta]]) -> None:
        """On the event loop: queue each delta, unless its reader left since it was sent."""
        for request_id, queue, delta in items:
            with self._lock:
                alive = request_id in self._streams and self._streams[request_id][1] is queue
            if alive:
                queue.put_nowait(delta)
            elif delta.finished:
                self._collect_orphan(request_id)

    def _collect_orphan(self, request_id: str) -> None:
        """Forget a finished request whose reader is gone."""
        with self._lock:
            seq = self._sequences.pop(request_id, None)
        if seq is not None:
            self.engine.pop_output(seq)

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            self._dead = reason  # later submits fail at once
            targets = list(self._streams.items())
        for request_id, (loop, queue) in targets:
            loop.call_soon_threadsafe(queue.put_nowait, EngineDeadError(reason))

    # ---- handler side -------------------------------------------------------------------
    def prepare(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                prompt: str | None = None, cache_salt: str | None = None,
                lora: Adapter | None = None) -> Sequence:
        """Validate a request and build its sequence (raises ValueError naming the field).
        Thread-safe, and best called off the event loop: it may compile a grammar."""
        return self.engine.make_sequence(request_id, prompt_token_ids, params, prompt,
                                         cache_salt, lora)

    def submit(self, sequences: list[Sequence]) -> None:
        """Queue prepared sequences, all or none (raises QueueFullError, RetiredError or
        EngineDeadError); call from the event loop, then iterate `stream(request_id)` of
        each."""
        loop = asyncio.get_running_loop()
        with self._lock:  # counted here: queued requests the scheduler has not seen yet too
            if self._dead is not None:
                raise EngineDeadError(self._dead)
            if self._retired:
                raise RetiredError("this model version is being removed")
            waiting = sum(seq.status is Status.WAITING for seq in self._sequences.values())
            if waiting + len(sequences) > self.max_waiting:
                raise QueueFullError(f"{waiting} requests are waiting; retry later")
            for seq in sequences:
                self._streams[seq.request_id] = (loop, asyncio.Queue())
                self._sequences[seq.request_id] = seq
        for seq in sequences:
            self.engine.enqueue(seq)
        self._wake.set()

    async def stream(self, request_id: str) -> AsyncIterator[StreamDelta]:
        """Deltas of a submitted request until it finishes; deltas that queued up while the
        reader was busy come as one. Leaving early (the client went away, the handler was
        cancelled) aborts the request."""
        with self._lock:
            _, queue = self._streams[request_id]
        finished = False
        try:
            while not finished:
                items = [await queue.get()]
                while not queue.empty() and not isinstance(items[-1], Exception):
                    items.append(queue.get_nowait())
                failures = [item for item in items if isinstance(item, Exception)]
                if failures:
                    raise failures[0]
                delta = merge_deltas(items)
                finished = delta.finished
                if delta.finish_reason == "error":
                    self._collect_orphan(request_id)
                    raise EngineDeadError("the engine step serving this request failed; "
                                          "its other requests carry on")
                yield delta
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                while not queue.empty():  # handed over but not read before we left
                    item = queue.get_nowait()
                    finished |= isinstance(item, StreamDelta) and item.finished
                if finished:
                    self._collect_orphan(request_id)
                else:
                    self.engine.abort(request_id)  # its final delta becomes an orphan
                    self._wake.set()

    def cancel(self, request_id: str) -> None:
        """Abort a submitted request that will not be streamed."""
        with self._lock:
            self._streams.pop(request_id, None)
        self.engine.abort(request_id)
        self._wake.set()

    def result(self, request_id: str) -> RequestOutput:
        """Final output of a finished request (forgets it)."""
        with self._lock:
            seq = self._sequences.pop(request_id)
        return self.engine.pop_output(seq)
