"""Serving before every bucket program exists: the smallest compile first, the rest behind.

A CPU program of even a small model takes seconds to compile, and a server has a dozen, so
waiting for all of them before answering `/health` keeps a first start unready for minutes.
Chunked prefill makes any request runnable on the smallest buckets: a step holds at most the
scheduler's token budget and row count, so capping those to the buckets that exist keeps
every step on compiled programs — slower (more, smaller steps), never wrong.

The ladders are climbed in `rungs`: rung k caps a step at the k-th token bucket and the
k-th sequence bucket (each ladder held at its top once it runs out) and needs every program
whose bucket fits both caps. The engine compiles rung 0 before it serves (`Runner.warm_up`;
on CPU with the platform's `quick_compile_options`, LLVM at -O0 and the elemental emitters,
unless the executable store already holds the full programs), a `BackgroundCompiler` thread
compiles the programs of the rungs above, in order, two at a time, and hands each over
through a queue. Only the engine's own thread takes them in (`adopt`, between steps): it
runs each program once on an all-padding batch (as warm-up does) and, once a whole rung is
in, raises the scheduler's caps. Last, the thread compiles rung 0's quick programs in full,
and each replaces its quick one the same way. So a request never waits on a compile, and a
step never asks for a program that is not there: the runner refuses that outright while
programs are still landing (`CompileAfterWarmupError`), and once all have landed the usual
zero-compiles-after-warm-up guarantee holds.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import queue
import threading
import time
from typing import TYPE_CHECKING

from jaxserve.config.engine import EngineConfig

if TYPE_CHECKING:
    from jaxserve.engine.runner import Runner

log = logging.getLogger("jaxserve.engine")

Bucket = tuple[str, int, int]  # (kind, tokens, rows)


@dataclasses.dataclass(frozen=True)
class Rung:
    """A step of at most `max_tokens` tokens and `max_rows` sequences runs on the programs of
    this rung and those below; `buckets`: the programs this rung adds."""

    max_tokens: int
    max_rows: int
    buckets: tuple[Bucket, ...]


def fits(bucket: Bucket, max_tokens: int, max_rows: int) -> bool:
    """Whether a step capped at `max_tokens` tokens and `max_rows` rows may need `bucket`."""
    kind, tokens, rows = bucket
    if kind == "step":
        return tokens <= max_tokens and rows <= max_rows
    return rows <= max_rows  # decode loops: one token per row


def rungs(config: EngineConfig, buckets: list[Bucket]) -> list[Rung]:
    """The ladders' rungs, smallest first; together their `buckets` are all of `buckets`
    (every program the ladders can ask for, `Runner.bucket_programs`). A rung's row cap is
    the largest sequence bucket up to it that its token cap holds (a step pads its tokens to
    at least its rows)."""
    tokens, seqs = config.token_buckets, config.seq_buckets
    placed: set[Bucket] = set()
    ladder = []
    for k in range(max(len(tokens), len(seqs))):
        max_tokens = tokens[min(k, len(tokens) - 1)]
        held = [rows for rows in seqs[:k + 1] if rows <= max_tokens]
        max_rows = max(held) if held else seqs[0]
        added = tuple(b for b in buckets if b not in placed and fits(b, max_tokens, max_rows))
        placed.update(added)
        ladder.append(Rung(max_tokens, max_rows, added))
    missing = [b for b in buckets if b not in placed]
    if missing:  # a ladder of the caller's own that no rung reaches; the top takes them
        top = ladder[-1]
        ladder[-1] = Rung(top.max_tokens, top.max_rows, top.buckets + tuple(missing))
    return [rung for rung in ladder if rung.buckets]


class BackgroundCompiler:
    """Compiles the programs of `ladder[1:]` on a thread of its own; the engine's thread
    takes each in with `adopt`. `limits` says how large a step may be now."""

    def __init__(self, runner: Runner, ladder: list[Rung], shared_args: list,
                 quick: list[Bucket] = ()):
        """`shared_args`: the runner's `abstract_shared_args()` (what the thread lowers
        against: never the arrays the serving thread donates). `quick`: rung 0's programs
        warm-up compiled with the platform's quick options; after the ladder, the thread
        compiles them in full, and each replaces its quick one as it is taken in."""
        self._runner = runner
        self._shared_args = shared_args
        self._ladder = ladder
        self._reached = 0  # index of the highest rung whose programs are all taken in
        self._landed: queue.SimpleQueue = queue.SimpleQueue()  # (bucket, built) or error
        self._waiting = {b for rung in ladder[1:] for b in rung.buckets}  # not taken in yet
        self._quick = list(quick)
        self._replacing = set(quick)  # quick programs not yet replaced by full ones
        self.total = sum(len(rung.buckets) for rung in ladder)
        self.failure: BaseException | None = None
        self._started = time.perf_counter()
        self.seconds = 0.0  # from start to the last program taken in
        self._thread = threading.Thread(target=self._compile_all, name="jaxserve-compile",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _compile_all(self) -> None:
        """Thread: build each waiting program, smallest rung first (two at a time), and
        queue each as it is done."""
        order = [b for rung in self._ladder[1:] for b in rung.buckets] + self._quick
        try:
            # as warm-up does: compiling releases the GIL, two at once use both of 2 cores
            with concurrent.futures.ThreadPoolExecutor(min(2, os.cpu_count() or 1)) as pool:
                builds = {pool.submit(self._runner.build_program, *bucket,
                                      shared_args=self._shared_args): bucket
                          for bucket in order}
                for build in concurrent.futures.as_completed(builds):
                    self._landed.put((builds[build], build.result()))
        except BaseException as err:  # noqa: BLE001 - reported on the engine's thread
            self._landed.put((None, err))

    @property
    def done(self) -> bool:
        """Whether every program is compiled in full and taken in."""
        return not self._waiting and not self._replacing

    @property
    def ready(self) -> int:
        """Programs taken in so far (of `total`)."""
        return self.total - len(self._waiting)

    @property
    def limits(self) -> tuple[int, int]:
        """(most tokens, most sequences) a step may hold on the programs taken in."""
        rung = self._ladder[self._reached]
        return rung.max_tokens, rung.max_rows

    def adopt(self) -> bool:
        """Engine thread, between steps: take in every program landed since the last call
        (each run once on padding); returns whether `limits` grew or the last program came
        in. A failed compile is raised here, once."""
        grew = False
        while True:
            try:
                bucket, built = self._landed.get_nowait()
            except queue.Empty:
                break
            if bucket is None:
                raise RuntimeError(f"compiling in the background failed: {built}") from built
            self._runner.adopt_program(bucket, built)
            if bucket in self._waiting:
                self._waiting.discard(bucket)
            else:
                self._replacing.discard(bucket)
                grew = grew or self.done
            while (self._reached + 1 < len(self._ladder) and not self._waiting.intersection(
                    self._ladder[self._reached + 1].buckets)):
                self._reached += 1
                grew = True
        if grew:
            tokens, rows = self.limits
            log.info("programs up to %d tokens and %d sequences a step are ready (%d of %d)",
                     tokens, rows, self.ready, self.total)
        if grew and self.done:
            self.seconds = time.perf_counter() - self._started
            log.info("all %d programs ready, %.1f s after serving began; nothing compiles "
                     "from now on", self.total, self.seconds)
        return grew

    def join(self, timeout: float | None = None) -> None:
        """Wait for the thread to finish compiling (not for `adopt`)."""
        self._thread.join(timeout)
