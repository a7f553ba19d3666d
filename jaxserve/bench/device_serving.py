"""The serving part of `jaxserve bench device`: an engine built as `serve` builds it (the
platform's preset), on a Llama-shaped model whose random weights are generated on the devices
(no download, no weight files), timed offline at several batch sizes.

For each batch size, that many requests of `prompt_len` random tokens, each generating
`new_tokens` (eos ignored, greedy), are submitted at once and run to completion:
- `output_tok_s`: output tokens of the batch / its wall time;
- `ttft_ms`, `tpot_ms`: medians over the batch's requests (first token after submission;
  time per output token after the first);
- `mbu` (model bandwidth utilisation): the bytes one decode step reads — the weights on a
  device plus the K/V of every row at its average length during decode — divided by the
  median time per output token and by the copy bandwidth measured in the same run;
- `acceptance` (the speculative variant): accepted / proposed draft tokens;
- `adapters` (the LoRA variant): distinct LoRA adapters spread over the batch (random, rank
  `LORA_RANK` on every projection; 0: LoRA on, every request on the base model), at the
  second largest batch only (at least one request per slot).

The mixture-of-experts variant serves a Qwen3-30B-A3B-shaped model in int8 (it fits an
80 GB GPU that way) at the first two batch sizes; its `mbu` counts only the experts a step
is expected to read with its random router (uniform choices: a layer's experts each read
with probability 1 - (1 - K/X)^batch).

The sliding-window variant serves a Gemma-3-27B-shaped model in int8 (five layers in six
slide over 1024 tokens, their pages in hybrid KV memory's window pool) on prompts of
`WINDOW_PROMPT_LEN` tokens, at the first two batch sizes; its `mbu` counts each sliding
layer's K/V as its window, not the whole row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


# The model shapes: Llama-3.1-8B (the shipped reference shape), Qwen3-30B-A3B for the
# mixture-of-experts variant, and for --quick, tiny ones.
MODEL_SHAPE, MOE_SHAPE, WINDOW_SHAPE = "llama-3.1-8b", "qwen3-30b-a3b", "gemma-3-27b"
QUICK_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 16, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 1,
                "eos_token_id": 2, "torch_dtype": "bfloat16"}
QUICK_MOE_CONFIG = {**QUICK_CONFIG, "architectures": ["Qwen3MoeForCausalLM"],
                    "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 64}
QUICK_WINDOW_CONFIG = {**QUICK_CONFIG, "architectures": ["Gemma3ForCausalLM"],
                       "model_type": "gemma3_text", "num_hidden_layers": 4,
                       "sliding_window": 8, "sliding_window_pattern": 2,
                       "query_pre_attn_scalar": 16}
QUICK_CONFIGS = {MOE_SHAPE: QUICK_MOE_CONFIG, WINDOW_SHAPE: QUICK_WINDOW_CONFIG}
# The preset `serve` would take on each chip, by a substring of jax's device_kind.
PRESET_BY_DEVICE = {"H200": "h200-1", "H100": "h100-1", "A100": "a100-80g-1",
                    "TPU v6": "v6e-1", "TPU v5 lite": "v5e-1", "TPU v5e": "v5e-1",
                    "TPU v5": "v5p-8", "cpu": "cpu"}
# The variants measured: the preset as it is, then int8 weights with an fp8 KV cache, then
# n-gram speculation at the smallest and a middle batch (random weights: its cost side; the
# acceptance a model's real text gets needs real weights).
FIRST_VARIANT = "bf16_short"
VARIANTS = {FIRST_VARIANT: {}, "bf16": {},
            "int8_fp8kv": {"quantization": "int8", "kv_cache_dtype": "fp8"},
            "ngram_spec": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                                  "prompt_lookup_max": 4,
                                                  "prompt_lookup_min": 2}}}
# Of the device memory the stage's process holds (on GPU, `XLA_PYTHON_CLIENT_MEM_FRACTION`
# of the card): the share its engine sizes its KV pool from after compiling
# (`jaxserve.engine.memory_budget`; no effect on CPU, which reports no limit).
GPU_MEMORY_UTILIZATION = 0.95
SPEC_BATCHES = 2  # the speculative and MoE variants run the first two batch sizes only
VARIANTS["moe_int8"] = {"model": MOE_SHAPE, "quantization": "int8"}
LORA_SLOTS, LORA_RANK = 4, 16
VARIANTS["lora"] = {"enable_lora": True, "max_loras": LORA_SLOTS, "max_lora_rank": LORA_RANK}
WINDOW_PROMPT_LEN = 8192  # eight windows: most of a row's K/V is past its sliding layers'
# 16 rows at most: the window pool holds every running row's window of its 52 sliding layers
# (1024 tokens of 16 kv heads of 128 each: 9 GiB in bfloat16 for 16 rows)
VARIANTS["window_int8"] = {"model": WINDOW_SHAPE, "quantization": "int8",
                           "max_model_len": 16384, "max_num_seqs": 16,
                           "seq_buckets": (1, 2, 4, 8, 16)}
FULL_ONLY = ("max_model_len", "max_num_seqs", "seq_buckets")  # --quick keeps its own


@dataclasses.dataclass(frozen=True)
class Workload:
    batches: tuple[int, ...]
    prompt_len: int
    new_tokens: int


FULL = Workload(batches=(1, 16, 64, 256), prompt_len=1024, new_tokens=128)
# The first serving figure of a run, before the kernels: the plain variant at batch 1 and 64
# on short prompts, so a rental cut short still says whether and how fast jaxserve serves.
SHORT = Workload(batches=(1, 64), prompt_len=128, new_tokens=64)
QUICK = Workload(batches=(1, 4), prompt_len=24, new_tokens=8)
# --quick rehearses on CPU, where each program compiles for seconds: one rung of tokens per
# step (4 prompts of 24 run as chunks) keeps each engine to a step and a decode program per
# rung of rows, and exercises chunked prompts as well.
QUICK_LADDER = {"max_num_batched_tokens": 32, "token_buckets": (32,)}


def preset_for(device: jax.Device) -> str | None:
    """The shipped preset for this chip (None: EngineConfig's defaults)."""
    kind = device.device_kind if device.platform != "cpu" else "cpu"
    return next((name for key, name in PRESET_BY_DEVICE.items() if key in kind), None)


def model_config(quick: bool, shape: str = MODEL_SHAPE):
    """The ModelConfig of the measured shape (read as `serve` reads a folder's config)."""
    from jaxserve.loading.checkpoint import model_config as read_config
    from jaxserve.model.hf_config import config_from_hf
    from jaxserve.presets import reference_model_dir

    if quick:
        return config_from_hf(QUICK_CONFIGS.get(shape, QUICK_CONFIG))
    return read_config(reference_model_dir(shape))


def _random_leaf(name: str, abstract: jax.ShapeDtypeStruct, key) -> jax.Array:
    """One parameter, generated on its devices with its sharding: projections ~ N(0, 0.02)
    as transformers initialises them, norms 1, int8 codes uniform with scales that give the
    same spread."""
    dtype = abstract.dtype

    def make():
        if jnp.issubdtype(dtype, jnp.integer):
            return jax.random.randint(key, abstract.shape, -127, 128, jnp.int32).astype(dtype)
        if "norm" in name:
            return jnp.ones(abstract.shape, dtype)
        if name.endswith("scale"):
            return jnp.full(abstract.shape, 0.02 * 1.7 / 127, dtype)
        return (0.02 * jax.random.normal(key, abstract.shape, jnp.float32)).astype(dtype)

    return jax.jit(make, out_shardings=abstract.sharding)()


def random_model(config, dtype, mesh, seed: int = 0):
    """A LlamaModel (layer-list layout, as loading gives it) of `config` on `mesh`, every
    parameter random and placed where `serve` would place it."""
    from jaxserve.loading.weights import abstract_sharded_model

    graphdef, state = nnx.split(abstract_sharded_model(config, dtype, mesh))
    variables = dict(nnx.to_flat_state(state))
    for index, (path, var) in enumerate(variables.items()):
        name = ".".join(str(part) for part in path)
        var.set_value(_random_leaf(name, var.get_value(), jax.random.key(seed + index)))
    return nnx.merge(graphdef, nnx.from_flat_state(variables))


def build_engine(config, options: dict[str, Any], progress: bool):
    """The engine `serve` builds from the platform's preset plus `options`, on a random
    model of `config`; (engine, engine options used, weight bytes per device)."""
    from jaxserve.engine.engine import Engine
    from jaxserve.engine.engine_setup import engine_mesh
    from jaxserve.llm import engine_config_for
    from jaxserve.model.config import resolve_dtype, with_quantization
    from jaxserve.presets import engine_settings

    device = jax.devices()[0]
    platform = {"cuda": "gpu", "rocm": "gpu"}.get(device.platform, device.platform)
    preset_dtype, engine_options = engine_settings(preset_for(device), platform, options)
    engine_config = engine_config_for(config, engine_options)
    dtype = resolve_dtype(preset_dtype or "bfloat16", config.checkpoint_dtype)
    config = with_quantization(config, engine_config.quantization,
                               engine_config.quantize_activations, platform, device.device_kind)
    model = random_model(config, dtype, engine_mesh(engine_config))
    weight_bytes = sum(leaf.addressable_shards[0].data.nbytes
                       for leaf in jax.tree.leaves(nnx.state(model)))
    engine = Engine(model, engine_config, None, [], progress=progress)
    return engine, engine_options, weight_bytes


def unread_expert_bytes(engine, batch: int) -> float:
    """The expert weight bytes (per device) a decode step of `batch` rows is not expected to
    read: each layer's experts each go unchosen by all rows with probability
    (1 - K/X)^batch under uniform routing. 0 for a dense model."""
    from jaxserve.model.moe import SparseMoE

    moe = engine.model_config.moe
    if moe is None:
        return 0.0
    stored = sum(kernel.addressable_shards[0].data.nbytes
                 for _, module in nnx.iter_graph(engine.model) if isinstance(module, SparseMoE)
                 for kernel in jax.tree.leaves(module.kernels()))
    return stored * (1 - moe.top_k / moe.num_experts) ** batch


def kv_bytes_read(engine, length: float) -> float:
    """K and V bytes (per device) one decode step reads for a row of `length` tokens: every
    layer's, a sliding layer's no more than its window's."""
    from pallas_kernels.kv_quant import page_dtype

    cfg, config = engine.model_config, engine.config  # kv heads as stored: a multiple of tp
    dtype = page_dtype(config.kv_cache_dtype, engine.model.compute_dtype)
    heads = cfg.num_kv_heads // config.tensor_parallel_size
    per_layer_token = 2 * heads * cfg.head_dim * jnp.dtype(dtype).itemsize
    return per_layer_token * sum(length if window is None else min(length, window)
                                 for window in cfg.layer_windows)


def random_adapters(engine, count: int, rng) -> list:
    """`count` LoRA adapters of random weights (N(0, 0.02)) for `engine`'s model, every
    projection at rank `LORA_RANK`, made in host memory (no PEFT folder)."""
    from jaxserve.lora.adapter import LoRAAdapter
    from jaxserve.lora.slots import Adapter
    from jaxserve.model.lora import module_sizes

    layers = engine.model_config.num_layers
    adapters = []
    for i in range(count):
        stacks = {m: tuple((0.02 * rng.standard_normal(shape)).astype(np.float32)
                           for shape in ((layers, size_in, LORA_RANK),
                                         (layers, LORA_RANK, size_out)))
                  for m, (size_in, size_out) in module_sizes(engine.model_config).items()}
        adapters.append(Adapter.loaded(f"random-{i}", i + 1,
                                       LoRAAdapter("random", LORA_RANK, stacks)))
    return adapters


def run_batch(engine, batch: int, work: Workload, rng, loras: list | None = None
              ) -> dict[str, float]:
    """`batch` requests at once, to completion: throughput and median latencies. `loras`:
    adapters given to the requests in turn."""
    from jaxserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=work.new_tokens, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    before = engine.metrics.snapshot()["counters"]
    started = time.monotonic()
    seqs = []
    for i in range(batch):
        seqs.append(engine.make_sequence(
            f"b{batch}-{i}", rng.integers(3, vocab, work.prompt_len).tolist(), params,
            lora=loras[i % len(loras)] if loras else None))
        engine.enqueue(seqs[-1])
    while engine.has_unfinished():
        engine.step()
    wall = time.monotonic() - started
    ttft = [s.times.first_token - s.times.arrival for s in seqs]
    tpot = [(s.times.last_token - s.times.first_token) / max(1, len(s.output_token_ids) - 1)
            for s in seqs]
    after = engine.metrics.snapshot()["counters"]
    drafted, accepted = (after.get(name, 0) - before.get(name, 0) for name in (
        "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"))
    return {"output_tok_s": batch * work.new_tokens / wall,
            "ttft_ms": 1e3 * statistics.median(ttft), "tpot_ms": 1e3 * statistics.median(tpot),
            "wall_s": wall,
            **({"acceptance": accepted / max(drafted, 1)}
               if engine.config.speculative_config is not None else {})}


@contextlib.contextmanager
def memory_rows(variant: str, add: Callable[[dict], None]):
    """While building an engine, each memory figure its runner logs
    (`jaxserve.engine.memory_figures`: before and after the first runs) becomes a row, the
    largest program's temporaries named."""

    class Rows(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            figures = getattr(record, "memory_figures", None)
            if figures is None:
                return
            row = {"variant": variant, "memory_at": figures["moment"],
                   **{k: v for k, v in figures.items() if k != "moment"}}
            temps = figures.get("program_temp_bytes")
            if temps:
                row["largest_temp_program"], row["largest_temp_bytes"] = max(
                    temps.items(), key=lambda item: item[1])
            add(row)

    logger, handler = logging.getLogger("jaxserve.engine.memory_figures"), Rows()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def measure_variant(variant: str, add: Callable[[dict], None], copy_gbps: float | None,
                    quick: bool, deadline: float, progress: bool) -> None:
    """One variant at each of its batch sizes; each row handed to `add` as it is measured.
    Rows past `deadline` (time.perf_counter) are recorded as skipped. A failure is recorded
    in a row with its whole traceback, and the variant ends there."""
    from jaxserve.bench.device_stages import failure_row

    if variant not in VARIANTS:
        raise ValueError(f"unknown serving variant {variant!r}; variants: {list(VARIANTS)}")
    overrides = VARIANTS[variant]
    work = QUICK if quick else SHORT if variant == FIRST_VARIANT else FULL
    rng = np.random.default_rng(0)
    config = model_config(quick, overrides.get("model", MODEL_SHAPE))
    overrides = {k: v for k, v in overrides.items() if k != "model"}
    windowed = any(window is not None for window in config.layer_windows)
    if windowed and not quick:  # the sliding variant's prompts span several windows
        work = dataclasses.replace(work, prompt_len=WINDOW_PROMPT_LEN)
    elif quick:
        overrides = {k: v for k, v in overrides.items() if k not in FULL_ONLY}
    # every variant of a run the same ladder of rows (bf16 reads bf16_short's programs back);
    # the pool sized after compiling, from the share of the card the stage's process holds
    options = {"max_num_seqs": max((QUICK if quick else FULL).batches),
               "gpu_memory_utilization": GPU_MEMORY_UTILIZATION,
               **(QUICK_LADDER if quick else {}), **overrides}
    try:
        started = time.perf_counter()
        with memory_rows(variant, add):  # written before the first runs: they may fail
            engine, used, weight_bytes = build_engine(config, options, progress)
        build_s = time.perf_counter() - started
        run_batch(engine, 1, dataclasses.replace(work, new_tokens=2), rng)  # first runs
    except Exception as err:  # noqa: BLE001 - recorded, the run goes on
        add({"variant": variant, **failure_row(err)})
        return
    runs = [(batch, None) for batch in work.batches]
    if "speculative_config" in overrides or config.moe is not None or windowed:
        runs = runs[:SPEC_BATCHES]
    if overrides.get("enable_lora"):
        adapters = random_adapters(engine, LORA_SLOTS, rng)
        batch = max(work.batches[-2], LORA_SLOTS)  # room for every adapter
        runs = [(batch, adapters[:count]) for count in (0, 1, LORA_SLOTS)]
    for batch, loras in runs:
        row = {"variant": variant, "model": config.model_type, "batch": batch,
               "prompt_len": work.prompt_len, "new_tokens": work.new_tokens,
               "weight_bytes": weight_bytes, "build_s": round(build_s, 1),
               "options": {k: used[k] for k in sorted(used) if k in options},
               **({} if loras is None else {"adapters": len(loras)})}
        if time.perf_counter() > deadline:
            add({**row, "skipped": "time budget spent"})
            continue
        try:
            numbers = run_batch(engine, batch, work, rng, loras)
        except Exception as err:  # noqa: BLE001 - recorded, the run goes on
            add({**row, **failure_row(err)})
            continue
        step_bytes = (weight_bytes - unread_expert_bytes(engine, batch)
                      + batch * kv_bytes_read(engine, work.prompt_len + work.new_tokens / 2))
        numbers["mbu"] = (step_bytes / (numbers["tpot_ms"] / 1e3) / (copy_gbps * 1e9)
                          if copy_gbps else None)
        add({**row, **{k: v if v is None else round(v, 4 if k in ("mbu", "acceptance") else 2)
                       for k, v in numbers.items()}})
