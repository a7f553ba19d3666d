"""Expert load of a mixture-of-experts model: how many (token, expert) pairs each expert of
each layer has run, what `/metrics` and `jaxserve bench` report (imbalance: max / mean).

Every program of such a model returns its `[L, X]` counts beside its tokens (padding not
counted; `jaxserve.model.llama.LlamaModel`'s `count_experts`). They stay device arrays here
until someone asks, so counting adds no device-to-host copy to a step.
"""

from __future__ import annotations

import threading

import jax
import numpy as np


class ExpertLoad:
    """The expert load of every program run, summed on the host when asked: each program's
    `[L, X]` stays a device array until then, so counting adds no device-to-host copy to a
    step. Past `FOLD` waiting arrays the older ones are summed, all but the newest `RECENT`
    (whose programs may still run: the engine must not wait for them)."""

    FOLD, RECENT = 64, 4

    def __init__(self):
        self._total: np.ndarray | None = None
        self._pending: list[jax.Array] = []
        self._lock = threading.Lock()  # the engine adds; a /metrics scrape reads

    def add(self, load: jax.Array) -> None:
        with self._lock:
            self._pending.append(load)
            if len(self._pending) >= self.FOLD:
                self._fold(len(self._pending) - self.RECENT)

    def total(self) -> np.ndarray | None:
        """`[L, X]` int64 so far (None before any program ran)."""
        with self._lock:
            self._fold(len(self._pending))
            return self._total

    def _fold(self, count: int) -> None:
        """Add the oldest `count` waiting arrays to the total."""
        for load in self._pending[:count]:
            counts = np.asarray(jax.device_get(load), np.int64)
            self._total = counts if self._total is None else self._total + counts
        del self._pending[:count]


def imbalance(load: np.ndarray) -> np.ndarray:
    """Per layer `[L]`: the busiest expert's pairs over the mean (1.0: even; 0 for a layer
    that ran nothing, such as a dense layer)."""
    mean = load.mean(axis=-1)
    return np.where(mean > 0, load.max(axis=-1) / np.maximum(mean, 1e-12), 0.0)
