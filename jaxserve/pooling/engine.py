"""`PoolingEngine`: the thread that batches pooling requests from many callers (HTTP
requests running at once) into the runner's buckets, so concurrent requests share steps
the way generation requests do.

A caller submits its sequences and waits on a future; the thread takes everything queued
at that moment as one list, runs it (`PoolingRunner.run` packs it into as few batches as
the buckets allow) and answers each caller with its rows. A failed batch fails only the
requests in it; the thread carries on.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading

import numpy as np

from jaxserve.pooling.runner import PoolingRunner

log = logging.getLogger("jaxserve.pooling")


class PoolingEngine:
    """Batches `encode` calls from any thread through one `PoolingRunner`."""

    def __init__(self, runner: PoolingRunner):
        self.runner = runner
        self._inbox: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="jaxserve-pooling",
                                        daemon=True)
        self._thread.start()

    def submit(self, sequences: list[list[int]]) -> concurrent.futures.Future:
        """A future of the sequences' outputs (`PoolingRunner.run`'s rows); bad sequences
        raise here (`InvalidRequestError` naming the input), before anything is queued."""
        for ids in sequences:
            self.runner.check(ids)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put((sequences, future))
        return future

    def encode(self, sequences: list[list[int]]) -> np.ndarray:
        """The outputs of `sequences`, waiting for them."""
        return self.submit(sequences).result()

    @property
    def running(self) -> bool:
        """Whether the thread still takes work."""
        return self._thread.is_alive()

    def shutdown(self) -> None:
        """Stop the thread once the queued work is done."""
        self._inbox.put(None)
        self._thread.join(timeout=60)

    def _loop(self) -> None:
        while True:
            first = self._inbox.get()
            if first is None:
                return
            jobs = [first]
            while not self._inbox.empty():
                job = self._inbox.get_nowait()
                if job is None:
                    self._inbox.put(None)  # stop after this batch
                    break
                jobs.append(job)
            self._run(jobs)

    def _run(self, jobs) -> None:
        sequences = [ids for ids_list, _ in jobs for ids in ids_list]
        try:
            outputs = self.runner.run(sequences)
        except Exception as err:  # noqa: BLE001 - handed to the callers, the thread lives on
            log.exception("pooling batch of %d requests failed", len(jobs))
            for _, future in jobs:
                future.set_exception(err)
            return
        start = 0
        for ids_list, future in jobs:
            future.set_result(outputs[start:start + len(ids_list)])
            start += len(ids_list)
