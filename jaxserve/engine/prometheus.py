"""`/metrics` in Prometheus text format, with vLLM's metric names so existing dashboards work.

Request latencies and token counts are observed when a request finishes (a listener on the
engine's metrics); queue lengths, KV-cache usage and the allocator's and scheduler's running
counts are read at scrape time. jaxserve's own series are prefixed `jaxserve:`.

One registry serves every engine of the server: each series carries `model_name` (vLLM's
label), the served id of the engine (with a models file, its pinned id `name@version`).
An engine removed by a reload leaves its counters and histograms (they stay monotonic for
`rate()`), and its scrape-time gauges go with it.
"""

from __future__ import annotations

import functools
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxserve.engine.engine import Engine
from jaxserve.engine.expert_load import imbalance
from jaxserve.engine.metrics import RequestStats
from jaxserve.engine.program_cache import memory_mappings

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class _EngineState:
    """Scrape-time gauges and counters from each attached engine's `Engine.stats()`."""

    def __init__(self, engines: dict[str, Engine]):
        self.engines = engines  # model_name → engine, changed by attach/detach

    def collect(self):
        stats = {name: engine.stats() for name, engine in list(self.engines.items())}

        def family(kind, name, doc, field):
            metric = kind(name, doc, labels=["model_name"])
            for model_name, values in stats.items():
                metric.add_metric([model_name], getattr(values, field))
            return metric

        gauge = functools.partial(family, GaugeMetricFamily)
        counter = functools.partial(family, CounterMetricFamily)
        yield gauge("vllm:num_requests_running", "Requests in the running batch.",
                    "num_running")
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.",
                    "num_waiting")
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache pages in use (0-1).",
                    "kv_cache_usage")
        yield counter("vllm:num_preemptions", "Sequences preempted for lack of pages.",
                      "num_preemptions")
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      "prefix_cache_queries")
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      "prefix_cache_hits")
        yield counter("jaxserve:compilations_after_warmup",
                      "Programs compiled after warm-up (each is a latency spike).",
                      "compiles_after_warmup")
        yield gauge("jaxserve:compiled_programs",
                    "Bucket programs this model's engine holds (compiled once per process "
                    "and shared by engines with the same programs).", "compiled_programs")
        yield gauge("jaxserve:bucket_programs",
                    "Bucket programs the ladders ask for: compiled_programs is below it while "
                    "the larger buckets still compile in the background.", "bucket_programs")
        yield gauge("jaxserve:programs_from_executable_cache",
                    "Of those, programs read whole from the executable cache at start-up "
                    "(neither traced nor compiled).", "programs_from_store")
        startup = GaugeMetricFamily("jaxserve:startup_seconds",
                                    "Seconds of each start-up phase: load (weights), compile "
                                    "(every bucket program), warmup (a first run of each).",
                                    labels=["model_name", "phase"])
        for model_name, engine in list(self.engines.items()):
            for phase, seconds in engine.startup_seconds.items():
                startup.add_metric([model_name, phase], seconds)
        yield startup
        yield from _config_info(self.engines)
        yield from _lora_info(self.engines)
        yield from _spec_decode(self.engines)
        yield from _expert_load(self.engines)
        mappings = memory_mappings()
        if mappings is not None:  # Linux: XLA:CPU's JIT maps memory per linked object
            yield GaugeMetricFamily("jaxserve:memory_mappings",
                                    "Memory mappings the process holds.", mappings[0])
            yield GaugeMetricFamily(
                "jaxserve:memory_mappings_limit",
                "The kernel's limit on a process's memory mappings (vm.max_map_count).",
                mappings[1])


def _config_info(engines: dict[str, Engine]):
    """Info gauges (value 1, the settings in labels): vLLM's `vllm:cache_config_info` (page
    size, count and dtype of the KV cache, whether fp8 scales are calibrated) and how the
    weights are stored."""
    cache = GaugeMetricFamily("vllm:cache_config_info", "KV-cache configuration.",
                              labels=["model_name", "block_size", "num_gpu_blocks",
                                      "cache_dtype", "calculate_kv_scales"])
    weights = GaugeMetricFamily("jaxserve:quantization_info",
                                "How the weights are stored: quantization method (none, int8, "
                                "fp8) and whether activations are quantized too.",
                                labels=["model_name", "quantization", "activations"])
    for model_name, engine in list(engines.items()):
        cache.add_metric([model_name, str(engine.config.page_size), str(engine.num_pages),
                          engine.config.kv_cache_dtype,
                          str(engine.config.calculate_kv_scales).lower()], 1)
        quant = engine.model_config.quantization
        weights.add_metric([model_name, quant.method if quant else "none",
                            str(bool(quant and quant.activations)).lower()], 1)
    yield cache
    yield weights


def _lora_info(engines: dict[str, Engine]):
    """vLLM's `vllm:lora_requests_info` for the engines serving LoRA adapters: the slot
    count and the adapters running and waiting (comma-separated names) in labels, the time
    of the reading as the value."""
    info = GaugeMetricFamily("vllm:lora_requests_info", "Running and waiting LoRA adapters.",
                             labels=["model_name", "max_lora", "running_lora_adapters",
                                     "waiting_lora_adapters"])
    for model_name, engine in list(engines.items()):
        if engine.loras is not None:
            running, waiting = engine.lora_requests()
            info.add_metric([model_name, str(engine.config.max_loras), ",".join(running),
                             ",".join(waiting)], time.time())
    yield info


SPEC_DECODE_COUNTERS = {  # vLLM's spec_decode counters → the engine's counter of each
    "vllm:spec_decode_num_drafts": ("Rounds in which a request proposed draft tokens.",
                                    "spec_decode_num_drafts"),
    "vllm:spec_decode_num_draft_tokens": ("Draft tokens proposed.",
                                          "spec_decode_num_draft_tokens"),
    "vllm:spec_decode_num_accepted_tokens": ("Draft tokens accepted.",
                                             "spec_decode_num_accepted_tokens"),
}


def _spec_decode(engines: dict[str, Engine]):
    """vLLM's speculative-decoding counters, for the engines that speculate; accepted tokens
    also per draft position (`position` label), as vLLM reports them."""
    speculating = {name: engine.metrics.snapshot()["counters"]
                   for name, engine in list(engines.items())
                   if engine.config.speculative_config is not None}
    if not speculating:
        return
    for name, (doc, field) in SPEC_DECODE_COUNTERS.items():
        family = CounterMetricFamily(name, doc, labels=["model_name"])
        for model_name, counters in speculating.items():
            family.add_metric([model_name], counters.get(field, 0))
        yield family
    per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted at each draft position.",
                                  labels=["model_name", "position"])
    for model_name, counters in speculating.items():
        k = engines[model_name].config.speculative_config.num_speculative_tokens
        for position in range(k):
            per_pos.add_metric(
                [model_name, str(position)],
                counters.get(f"spec_decode_num_accepted_tokens_per_pos:{position}", 0))
    yield per_pos


def _expert_load(engines: dict[str, Engine]):
    """Mixture-of-experts engines' expert load since start: the (token, expert) pairs each
    expert of each layer ran (a counter per layer and expert), and per layer the busiest
    expert's pairs over the mean (a gauge, 1.0 when the router spreads tokens evenly)."""
    loads = {name: engine.expert_load() for name, engine in list(engines.items())}
    loads = {name: load for name, load in loads.items() if load is not None}  # MoE engines
    if not loads:
        return
    tokens = CounterMetricFamily("jaxserve:moe_expert_tokens",
                                 "(Token, expert) pairs each expert of each layer ran.",
                                 labels=["model_name", "layer", "expert"])
    ratio = GaugeMetricFamily("jaxserve:moe_expert_load_imbalance",
                              "Per layer: the busiest expert's pairs over the mean (1: even).",
                              labels=["model_name", "layer"])
    for model_name, load in loads.items():
        ran = [layer for layer in range(load.shape[0]) if load[layer].any()]  # MoE layers
        for layer, value in zip(ran, imbalance(load[ran])):
            ratio.add_metric([model_name, str(layer)], float(value))
            for expert, count in enumerate(load[layer]):
                tokens.add_metric([model_name, str(layer), str(expert)], int(count))
    yield tokens
    yield ratio


class PrometheusMetrics:
    """The registry behind `/metrics` for the engines the server runs."""

    def __init__(self):
        self.registry = CollectorRegistry()
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
        self.routed = Counter("jaxserve:requests_routed", "Requests routed to a model version, "
                              "by why: weight (a name's split), pinned (a pinned id), fallback.",
                              ["model_name", "version", "reason"], **reg)
        self._engines: dict[str, Engine] = {}
        self.registry.register(_EngineState(self._engines))

    def attach(self, engine: Engine, model_name: str) -> None:
        """Report `engine`'s requests and state under `model_name`."""
        self._engines[model_name] = engine
        engine.metrics.add_listener(functools.partial(self.observe, model_name))

    def detach(self, engine: Engine, model_name: str) -> None:
        """Stop reading the scrape-time state of a removed engine (unless a new engine took
        its name since: a replaced version keeps its pinned id)."""
        if self._engines.get(model_name) is engine:
            del self._engines[model_name]

    def count_route(self, model_name: str, version: str, reason: str) -> None:
        self.routed.labels(model_name, version, reason).inc()

    def observe(self, name: str, stats: RequestStats) -> None:
        """Fold one finished request of model `name` in (runs on its engine thread)."""
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
