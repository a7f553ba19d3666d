"""`/metrics` in Prometheus text format, with vLLM's metric names so existing dashboards work.

Request latencies and token counts are observed when a request finishes (a listener on the
engine's metrics); queue lengths, KV-cache usage and the allocator's and scheduler's running
counts are read at scrape time. jaxserve's own series are prefixed `jaxserve:`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxserve.engine.engine import Engine
from jaxserve.engine.metrics import RequestStats
from jaxserve.engine.program_cache import memory_mappings

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class _EngineState:
    """Scrape-time gauges and counters from `Engine.stats()`."""

    def __init__(self, engine: Engine, model_name: str):
        self.engine = engine
        self.labels = [model_name]

    def collect(self):
        stats = self.engine.stats()  # summed over data-parallel replicas

        def gauge(name, doc, value):
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(self.labels, value)
            return family

        def counter(name, doc, value):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(self.labels, value)
            return family

        yield gauge("vllm:num_requests_running", "Requests in the running batch.",
                    stats.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.",
                    stats.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache pages in use (0-1).",
                    stats.kv_cache_usage)
        yield counter("vllm:num_preemptions", "Sequences preempted for lack of pages.",
                      stats.num_preemptions)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      stats.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      stats.prefix_cache_hits)
        yield counter("jaxserve:compilations_after_warmup",
                      "Programs compiled after warm-up (each is a latency spike).",
                      stats.compiles_after_warmup)
        yield gauge("jaxserve:compiled_programs",
                    "Bucket programs this model's engine holds (compiled once per process "
                    "and shared by engines with the same programs).", stats.compiled_programs)
        mappings = memory_mappings()
        if mappings is not None:  # Linux: XLA:CPU's JIT maps memory per linked object
            yield gauge("jaxserve:memory_mappings", "Memory mappings the process holds.",
                        mappings[0])
            yield gauge("jaxserve:memory_mappings_limit",
                        "The kernel's limit on a process's memory mappings (vm.max_map_count).",
                        mappings[1])


class PrometheusMetrics:
    """The registry behind `/metrics` for one served model."""

    def __init__(self, engine: Engine, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        reg = dict(registry=self.registry)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.",
                                     labels, **reg)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.",
                                         labels, **reg)
        self.request_success = Counter("vllm:request_success", "Finished requests.",
                                       labels + ["finished_reason"], **reg)
        self.histograms = {
            "time_to_first_token": Histogram(
                "vllm:time_to_first_token_seconds", "Time to first token.", labels,
                buckets=LATENCY_BUCKETS, **reg),
            "time_per_output_token": Histogram(
                "vllm:time_per_output_token_seconds", "Mean time per output token of a request.",
                labels, buckets=LATENCY_BUCKETS, **reg),
            "e2e_request_latency": Histogram(
                "vllm:e2e_request_latency_seconds", "Arrival to finish.", labels,
                buckets=LATENCY_BUCKETS, **reg),
            "queue_time": Histogram(
                "vllm:request_queue_time_seconds", "Arrival to first scheduled.", labels,
                buckets=LATENCY_BUCKETS, **reg),
        }
        self.inter_token = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency.",
                                     labels, buckets=LATENCY_BUCKETS, **reg)
        self.registry.register(_EngineState(engine, model_name))
        engine.metrics.add_listener(self.observe)

    def observe(self, stats: RequestStats) -> None:
        """Fold one finished request in (runs on the engine thread)."""
        name = self.model_name
        self.prompt_tokens.labels(name).inc(stats.prompt_tokens)
        self.generation_tokens.labels(name).inc(stats.generation_tokens)
        self.request_success.labels(name, stats.finish_reason).inc()
        for field, histogram in self.histograms.items():
            value = getattr(stats, field)
            if value is not None:
                histogram.labels(name).observe(value)
        for gap in stats.inter_token_latencies:
            self.inter_token.labels(name).observe(gap)

    def render(self) -> bytes:
        return generate_latest(self.registry)
