"""Engine options, named as vLLM users know them, checked once at construction.

A value that cannot work (a page size the kernels do not take, a token budget smaller than
one page, a bucket ladder that does not reach the limits) is a `ValueError` here, never a
failure in the middle of serving.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from pallas_kernels.limits import (KV_CACHE_DTYPE_NAMES, SUPPORTED_PAGE_SIZES,
                                   check_kv_cache_dtype)
from jaxserve.config.speculative import SpeculativeConfig

ATTENTION_BACKENDS = ("auto", "pallas", "cpu", "reference")  # jaxserve.attention
# a preset's sections for the engine options (`jaxserve.presets` adds [hardware] and [plan])
# vLLM's switch for batch-invariant inference, read when enable_deterministic_inference is unset
BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"
SECTIONS = ("mesh", "model", "kv_cache", "batching", "compile", "speculative", "lora",
            "pooling")


def _option(default, section: str, help: str, choices: tuple | None = None,
            aliases: tuple[str, ...] = ()):
    """An `EngineConfig` field with what the command line and the presets derive from it:
    its preset `section`, one-line `help`, allowed `choices`, and short flag `aliases`."""
    return dataclasses.field(default=default, metadata={
        "section": section, "help": help, "choices": choices, "aliases": aliases})


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the serving engine sizes its KV cache, batches and compiled programs.

    This class is the one place an engine option is written: its fields are `LLM`'s keyword
    arguments, the command line's flags (`jaxserve.cli`: `--max-num-seqs` for
    `max_num_seqs`, `--[no-]enable-prefix-caching` for a bool), the presets' fields
    (`jaxserve.presets`, in the field's section) and the README's option table
    (`options_table`, checked by `tests/engine/test_options.py`).

    `token_buckets` and `seq_buckets` are the ladders every step is padded to (tokens per
    step, sequences per step); each compiled program has one (tokens, seqs) pair from them.
    Empty ladders are derived as powers of two up to `max_num_batched_tokens` and
    `max_num_seqs`. `num_pages` wins over `gpu_memory_utilization`, which wins over
    `kv_cache_memory_fraction` (`jaxserve.engine.memory_budget`).
    `scan_layers` None picks the scan on TPU/GPU and the loop on CPU, where XLA copies each
    layer's weights out of the stack and a step runs ~2x slower. The executable cache is
    `jaxserve.engine.executable_store`; quantization, `jaxserve.model.quantization` (checked
    where the model's config takes it, `with_quantization`); quantized pages,
    `pallas_kernels.kv_quant`.
    """

    max_model_len: int = _option(2048, "model", "longest prompt + output, in tokens")
    page_size: int = _option(16, "kv_cache", "tokens per KV page",
                             choices=SUPPORTED_PAGE_SIZES)
    num_pages: int | None = _option(None, "kv_cache", "KV pages in the pool (default: from "
                                    "kv_cache_memory_fraction)")
    kv_cache_memory_fraction: float = _option(0.5, "kv_cache", "share of free device memory "
                                              "the KV cache takes")
    gpu_memory_utilization: float | None = _option(
        None, "kv_cache", "share of the device's memory this engine may use; the KV cache "
        "gets what the weights and the largest program's temporaries leave of it, sized "
        "after compiling (default: kv_cache_memory_fraction)")
    max_num_seqs: int = _option(64, "batching", "most sequences in one step")
    max_num_batched_tokens: int = _option(512, "batching", "most tokens in one step")
    num_decode_steps: int = _option(8, "batching", "decode steps per device loop for "
                                    "requests nobody streams")
    enable_prefix_caching: bool = _option(True, "kv_cache", "reuse the KV pages of a cached "
                                          "prompt prefix")
    disable_hybrid_kv_cache_manager: bool = _option(
        False, "kv_cache", "give sliding-window layers full-context pages too, instead of "
        "a pool of their own that frees the pages slid out of their window")
    strict_compile: bool = _option(False, "compile", "raise instead of compiling after "
                                   "warm-up")
    token_buckets: tuple[int, ...] = _option((), "batching", "tokens-per-step ladder "
                                             "(default: powers of two)")
    seq_buckets: tuple[int, ...] = _option((), "batching", "sequences-per-step ladder "
                                           "(default: powers of two)")
    attention_backend: str = _option("auto", "model", "auto: Pallas kernels on TPU/GPU, "
                                     "the jnp backend on CPU; reference: the slow oracle",
                                     choices=ATTENTION_BACKENDS)
    compilation_cache_dir: str | None = _option(None, "compile", "XLA compilation cache "
                                                "(default: $JAXSERVE_CACHE_DIR or "
                                                "~/.cache/jaxserve/xla)")
    executable_cache: bool = _option(True, "compile", "keep compiled programs on disk "
                                     "whole: a restart neither traces nor compiles")
    compile_in_background: bool = _option(
        False, "compile", "serve once the smallest buckets' programs exist and compile the "
        "rest in the background, capping steps to the programs there (`jaxserve serve` "
        "turns it on)")
    tensor_parallel_size: int = _option(1, "mesh", "devices each layer is split over",
                                        aliases=("-tp",))
    data_parallel_size: int = _option(1, "mesh", "engine replicas, each on its own "
                                      "devices", aliases=("-dp",))
    enable_expert_parallel: bool | None = _option(
        None, "mesh", "mixture-of-experts models: whole experts split among the "
        "tensor-parallel devices, not a slice of each on every one (default: on TPU when "
        "each device's slice of an expert would not be a multiple of 128 lanes)")
    scan_layers: bool | None = _option(None, "model", "run the layers as one lax.scan over "
                                       "stacked weights (default: on TPU/GPU)")
    devices: tuple[int, ...] | None = _option(None, "mesh", "indices of the devices to use "
                                              "(default: the first the mesh needs)")
    quantization: str | None = _option(None, "model", "store the weights in int8 or fp8 "
                                       "with per-channel scales (default: as the "
                                       "checkpoint is)", choices=("int8", "fp8"),
                                       aliases=("-q",))
    quantize_activations: bool = _option(False, "model", "with quantization: run those "
                                         "matmuls in int8/fp8 too")
    kv_cache_dtype: str = _option("auto", "kv_cache", "KV pages in the compute dtype "
                                  "(auto), int8 (a scale per token and head) or fp8 e4m3",
                                  choices=KV_CACHE_DTYPE_NAMES)
    calculate_kv_scales: bool = _option(False, "kv_cache", "with fp8 pages: calibrate "
                                        "scales from the first step's tokens, not 1")
    enable_deterministic_inference: bool | None = _option(
        None, "compile", "a request's tokens and log-probabilities bitwise the same alone or "
        "in any batch, chunked, after a prefix-cache hit or preemption (docs/determinism.md; "
        "slower; default: on when VLLM_BATCH_INVARIANT=1)")
    speculative_config: SpeculativeConfig | dict | None = _option(
        None, "speculative", "speculative decoding, vLLM's keys: method (ngram, "
        "draft_model, eagle3), num_speculative_tokens, prompt_lookup_min/max, model (the "
        "draft or EAGLE-3 head), disable_by_batch_size; a JSON object on the command line, "
        "a preset's [speculative] table")

    runner: str = _option("generate", "model", "generate: text generation; pooling: "
                          "embeddings and scores (/v1/embeddings, /pooling, /score, /rerank; "
                          "jaxserve.pooling)", choices=("generate", "pooling"))
    convert: str = _option("auto", "model", "with runner pooling: embed (pooled vectors) or "
                           "classify (a causal LM scored by its yes/no logits, as "
                           "Qwen3-Reranker); auto: from the model folder",
                           choices=("auto", "embed", "classify"))
    pooler_config: dict | None = _option(None, "pooling", "with runner pooling: vLLM's "
                                         "pooling_type (LAST, MEAN, CLS) and normalize, over "
                                         "the model folder's sentence-transformers config")

    enable_lora: bool = _option(False, "lora", "serve LoRA adapters beside the base model "
                                "(jaxserve.lora)")
    max_loras: int = _option(1, "lora", "adapters resident on the device at once (slots); "
                             "more wait in host memory and are swapped in")
    max_lora_rank: int = _option(16, "lora", "largest adapter rank; smaller ranks are "
                                 "zero-padded to it")
    max_cpu_loras: int | None = _option(None, "lora", "most adapters held in host memory "
                                        "(loading one more is refused); at least max_loras "
                                        "(default: max_loras)")

    def __post_init__(self):
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.enable_deterministic_inference is None:
            object.__setattr__(self, "enable_deterministic_inference",
                               os.environ.get(BATCH_INVARIANT_ENV, "0") == "1")
        if self.speculative_config is not None and not isinstance(self.speculative_config,
                                                                  SpeculativeConfig):
            object.__setattr__(self, "speculative_config",
                               SpeculativeConfig.from_dict(self.speculative_config))
        if self.calculate_kv_scales and self.kv_cache_dtype != "fp8":
            raise ValueError("calculate_kv_scales calibrates an fp8 KV cache's scales; it "
                             f"needs kv_cache_dtype='fp8', got {self.kv_cache_dtype!r}")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens",
                     "num_decode_steps", "tensor_parallel_size", "data_parallel_size",
                     "max_loras", "max_lora_rank"):
            _positive_int(name, getattr(self, name))
        if self.max_cpu_loras is not None:
            _positive_int("max_cpu_loras", self.max_cpu_loras)
            if self.max_cpu_loras < self.max_loras:
                raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                                 f"({self.max_loras})")
        if self.enable_lora and self.speculative_config is not None:
            raise ValueError("enable_lora with speculative_config is not supported: the "
                             "proposals and their verification would need the adapter too")
        if self.page_size not in SUPPORTED_PAGE_SIZES:
            raise ValueError(f"page_size must be one of {SUPPORTED_PAGE_SIZES} (the kernels' "
                             f"supported sizes), got {self.page_size!r}")
        if self.num_pages is not None:
            _positive_int("num_pages", self.num_pages)
            if self.num_pages < 1 + self.pages_per_seq:
                raise ValueError(f"num_pages ({self.num_pages}) must hold at least one padding "
                                 f"page and one full-length sequence "
                                 f"({self.pages_per_seq} pages of {self.page_size})")
        if not 0.0 < self.kv_cache_memory_fraction <= 0.95:
            raise ValueError("kv_cache_memory_fraction must be in (0, 0.95], got "
                             f"{self.kv_cache_memory_fraction!r}")
        if self.gpu_memory_utilization is not None and not (
                0.0 < self.gpu_memory_utilization <= 1.0):
            raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization!r}")
        if self.max_num_batched_tokens < self.page_size:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                             f"at least one page ({self.page_size} tokens)")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                             f">= max_num_seqs ({self.max_num_seqs}): every running sequence "
                             "needs a decode token each step")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got "
                             f"{self.attention_backend!r}")
        if self.devices is not None:
            devices = self.devices
            if not isinstance(devices, (list, tuple)) or not devices or not all(
                    isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices):
                raise ValueError(f"devices must be a non-empty list of device indices (0, 1, "
                                 f"...), got {devices!r}")
            if len(set(devices)) != len(devices):
                raise ValueError(f"devices lists a device twice: {list(devices)}")
            if len(devices) != self.tensor_parallel_size * self.data_parallel_size:
                raise ValueError(f"devices lists {len(devices)} device(s); the mesh "
                                 f"tensor_parallel_size x data_parallel_size needs "
                                 f"{self.tensor_parallel_size * self.data_parallel_size}")
            object.__setattr__(self, "devices", tuple(devices))
        object.__setattr__(self, "token_buckets", self._ladder(
            "token_buckets", self.token_buckets, self.max_num_batched_tokens, 16))
        object.__setattr__(self, "seq_buckets", self._ladder(
            "seq_buckets", self.seq_buckets, self.max_num_seqs, 1))

    @property
    def pages_per_seq(self) -> int:
        """Width of every page table: enough pages for `max_model_len` tokens."""
        return -(-self.max_model_len // self.page_size)

    @staticmethod
    def _ladder(name: str, values, top: int, start: int) -> tuple[int, ...]:
        if not values:
            values, size = [], min(start, top)
            while size < top:
                values.append(size)
                size *= 2
            values.append(top)
        values = tuple(sorted(set(int(v) for v in values)))
        if values[0] < 1:
            raise ValueError(f"{name} must hold positive sizes, got {values}")
        if values[-1] != top:
            raise ValueError(f"{name} must end at its limit {top}, got {values}")
        return values

    def speculates(self, rows: int) -> bool:
        """Whether a decode step of `rows` running requests runs the speculative program."""
        spec = self.speculative_config
        return spec is not None and spec.applies_to(rows)

    def decode_programs(self) -> list[tuple[str, int]]:
        """(kind, rows) of every decode-only program: per rung of `seq_buckets`, "spec" if
        some row count it holds speculates, "decode" if some does not."""
        programs = []
        least = 1  # the fewest rows a rung holds: one more than the rung below
        for rows in self.seq_buckets:
            if self.speculates(least):
                programs.append(("spec", rows))
            if not self.speculates(rows):
                programs.append(("decode", rows))
            least = rows + 1
        return programs

    def resolved_cache_dir(self) -> Path:
        """The persistent compilation cache folder: the option, $JAXSERVE_CACHE_DIR, or
        a per-user cache folder."""
        if self.compilation_cache_dir:
            return Path(self.compilation_cache_dir)
        if os.environ.get("JAXSERVE_CACHE_DIR"):
            return Path(os.environ["JAXSERVE_CACHE_DIR"])
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        return Path(base) / "jaxserve" / "xla"


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclasses.dataclass(frozen=True)
class OptionSpec:
    """One engine option as the command line, the presets and the README see it; `kind` is
    "int", "float", "bool", "str", "ints" (a tuple of ints) or "table" (a dict of keys: a
    JSON object as a flag, a table of its own in a preset)."""

    name: str
    kind: str
    default: Any
    section: str
    help: str
    choices: tuple | None
    aliases: tuple[str, ...]

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def option_specs() -> tuple[OptionSpec, ...]:
    """Every `EngineConfig` field, in declaration order."""
    specs = []
    for field in dataclasses.fields(EngineConfig):
        kinds = [k.strip() for k in str(field.type).split("|")]
        kind = next(k for k in kinds if k != "None")
        kind = "ints" if kind.startswith("tuple[int") else kind
        kind = "table" if "dict" in kinds else kind
        if kind not in ("int", "float", "bool", "str", "ints", "table"):
            raise TypeError(f"EngineConfig.{field.name}: no flag or preset type for {kind}")
        meta = field.metadata
        specs.append(OptionSpec(field.name, kind, field.default, meta["section"], meta["help"],
                                meta["choices"], meta["aliases"]))
    return tuple(specs)


def options_table() -> str:
    """The README's table of engine options (Markdown), derived from `EngineConfig`."""
    def shown(value) -> str:
        if value is None or value == ():
            return "—"
        return f"`{str(value).lower()}`" if isinstance(value, bool) else f"`{value}`"

    rows = ["| option (`LLM` / preset field) | flag | preset section | default | what |",
            "|---|---|---|---|---|"]
    for spec in option_specs():
        flag = (f"`--[no-]{spec.flag[2:]}`" if spec.kind == "bool" else f"`{spec.flag}`")
        what = spec.help + (f"; one of {', '.join(map(str, spec.choices))}"
                            if spec.choices else "")
        rows.append(f"| `{spec.name}` | {flag} | `[{spec.section}]` | {shown(spec.default)} | "
                    f"{what} |")
    return "\n".join(rows)
