"""Counters and observations the engine records, ready for the server's `/metrics`.

Plain Python: the engine appends, a reader takes a `snapshot()`. Latencies are in seconds.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Callable

from jaxserve.engine.sequence import Sequence

MAX_OBSERVATIONS = 10_000  # per series; older observations are dropped


@dataclasses.dataclass
class EngineStats:
    """The engine's state right now, summed over its replicas (`Engine.stats()`)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of pages in use, averaged over replicas
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found
    compiles_after_warmup: int = 0
    compiled_programs: int = 0  # bucket programs the replicas hold (shared ones per replica)
    programs_from_store: int = 0  # of those, read whole from the executable store
    bucket_programs: int = 0  # every program the ladders ask for (all compiled once landed)


@dataclasses.dataclass
class StepRecord:
    """One engine step: its real and padded sizes and the cache usage after it."""

    num_seqs: int
    num_tokens: int
    padded_tokens: int
    num_decode_steps: int
    kv_cache_usage: float
    duration: float


@dataclasses.dataclass
class RequestStats:
    """Latencies and token counts of one finished request (seconds; None if not reached)."""

    finish_reason: str
    prompt_tokens: int
    generation_tokens: int
    cached_tokens: int
    queue_time: float | None
    time_to_first_token: float | None
    e2e_request_latency: float | None
    time_per_output_token: float | None
    inter_token_latencies: list[float]

    @classmethod
    def of(cls, seq: Sequence) -> "RequestStats":
        t = seq.times
        since_arrival = lambda mark: None if mark is None else mark - t.arrival  # noqa: E731
        return cls(
            finish_reason=seq.finish_reason or "abort",
            prompt_tokens=len(seq.prompt_token_ids),
            generation_tokens=len(seq.output_token_ids),
            cached_tokens=seq.num_cached_tokens,
            queue_time=since_arrival(t.first_scheduled),
            time_to_first_token=since_arrival(t.first_token),
            e2e_request_latency=since_arrival(t.finished),
            time_per_output_token=(sum(t.inter_token) / len(t.inter_token)
                                   if t.inter_token else None),
            inter_token_latencies=list(t.inter_token))


class EngineMetrics:
    """Thread-safe record of requests and steps."""

    def __init__(self):
        self._lock = threading.Lock()
        self.counters: collections.Counter[str] = collections.Counter()
        self.finished_by_reason: collections.Counter[str] = collections.Counter()
        self.observations: dict[str, collections.deque[float]] = collections.defaultdict(
            lambda: collections.deque(maxlen=MAX_OBSERVATIONS))
        self.last_step: StepRecord | None = None
        self._listeners: list[Callable[[RequestStats], None]] = []

    def record_step(self, record: StepRecord) -> None:
        with self._lock:
            self.last_step = record
            self.counters["steps"] += 1
            self.observations["step_num_seqs"].append(record.num_seqs)
            self.observations["step_num_tokens"].append(record.num_tokens)

    def record_drafts(self, num_drafts: int, num_draft_tokens: int,
                      accepted_per_pos: list[int]) -> None:
        """Fold in one speculative step's proposals: vLLM's `spec_decode` counters (drafts,
        draft tokens, accepted tokens, accepted tokens at each draft position)."""
        with self._lock:
            self.counters["spec_decode_num_drafts"] += num_drafts
            self.counters["spec_decode_num_draft_tokens"] += num_draft_tokens
            self.counters["spec_decode_num_accepted_tokens"] += sum(accepted_per_pos)
            for position, accepted in enumerate(accepted_per_pos):
                self.counters[f"spec_decode_num_accepted_tokens_per_pos:{position}"] += accepted

    def add_listener(self, listener: Callable[[RequestStats], None]) -> None:
        """Call `listener` (on the engine thread) with the stats of every finished request."""
        self._listeners.append(listener)

    def record_finished(self, seq: Sequence) -> None:
        """Fold a finished request into the counters and latency series."""
        stats = RequestStats.of(seq)
        with self._lock:
            self.finished_by_reason[stats.finish_reason] += 1
            self.counters["prompt_tokens"] += stats.prompt_tokens
            self.counters["generation_tokens"] += stats.generation_tokens
            self.counters["prefix_cached_tokens"] += stats.cached_tokens
            obs = self.observations
            for name in ("queue_time", "time_to_first_token", "e2e_request_latency",
                         "time_per_output_token"):
                value = getattr(stats, name)
                if value is not None:
                    obs[name].append(value)
            obs["inter_token_latency"].extend(stats.inter_token_latencies)
            obs["request_prompt_tokens"].append(stats.prompt_tokens)
            obs["request_generation_tokens"].append(stats.generation_tokens)
        for listener in self._listeners:
            listener(stats)

    def snapshot(self) -> dict:
        """A consistent copy for readers on other threads."""
        with self._lock:
            return {
                "counters": dict(self.counters),
                "finished_by_reason": dict(self.finished_by_reason),
                "observations": {k: list(v) for k, v in self.observations.items()},
                "last_step": dataclasses.replace(self.last_step) if self.last_step else None,
            }
