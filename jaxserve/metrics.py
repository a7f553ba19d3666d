"""Counters and observations the engine records, ready for the server's `/metrics`.

Plain Python: the engine appends, a reader takes a `snapshot()`. Latencies are in seconds.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time

from jaxserve.sequence import Sequence

MAX_OBSERVATIONS = 10_000  # per series; older observations are dropped


@dataclasses.dataclass
class StepRecord:
    """One engine step: its real and padded sizes and the cache usage after it."""

    num_seqs: int
    num_tokens: int
    padded_tokens: int
    num_decode_steps: int
    kv_cache_usage: float
    duration: float


class EngineMetrics:
    """Thread-safe record of requests and steps."""

    def __init__(self):
        self._lock = threading.Lock()
        self.counters: collections.Counter[str] = collections.Counter()
        self.finished_by_reason: collections.Counter[str] = collections.Counter()
        self.observations: dict[str, collections.deque[float]] = collections.defaultdict(
            lambda: collections.deque(maxlen=MAX_OBSERVATIONS))
        self.last_step: StepRecord | None = None
        self.started = time.monotonic()

    def record_step(self, record: StepRecord) -> None:
        with self._lock:
            self.last_step = record
            self.counters["steps"] += 1
            self.observations["step_num_seqs"].append(record.num_seqs)
            self.observations["step_num_tokens"].append(record.num_tokens)

    def record_finished(self, seq: Sequence) -> None:
        """Fold a finished request into the counters and latency series."""
        times = seq.times
        with self._lock:
            self.finished_by_reason[seq.finish_reason or "abort"] += 1
            self.counters["prompt_tokens"] += len(seq.prompt_token_ids)
            self.counters["generation_tokens"] += len(seq.output_token_ids)
            self.counters["prefix_cached_tokens"] += seq.num_cached_tokens
            obs = self.observations
            if times.first_scheduled is not None:
                obs["queue_time"].append(times.first_scheduled - times.arrival)
            if times.first_token is not None:
                obs["time_to_first_token"].append(times.first_token - times.arrival)
            obs["inter_token_latency"].extend(times.inter_token)
            if times.finished is not None:
                obs["e2e_request_latency"].append(times.finished - times.arrival)
            if times.inter_token:
                obs["time_per_output_token"].append(sum(times.inter_token) / len(times.inter_token))
            obs["request_prompt_tokens"].append(len(seq.prompt_token_ids))
            obs["request_generation_tokens"].append(len(seq.output_token_ids))

    def snapshot(self) -> dict:
        """A consistent copy for readers on other threads."""
        with self._lock:
            return {
                "counters": dict(self.counters),
                "finished_by_reason": dict(self.finished_by_reason),
                "observations": {k: list(v) for k, v in self.observations.items()},
                "last_step": dataclasses.replace(self.last_step) if self.last_step else None,
            }
