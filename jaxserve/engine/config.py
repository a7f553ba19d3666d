"""Engine options, named as vLLM users know them, checked once at construction.

A value that cannot work (a page size the kernels do not take, a token budget smaller than
one page, a bucket ladder that does not reach the limits) is a `ValueError` here, never a
failure in the middle of serving.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from pallas_kernels.limits import SUPPORTED_PAGE_SIZES, check_kv_cache_dtype

ATTENTION_BACKENDS = ("auto", "pallas", "cpu", "reference")  # jaxserve.attention


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the serving engine sizes its KV cache, batches and compiled programs.

    `token_buckets` and `seq_buckets` are the ladders every step is padded to (tokens per
    step, sequences per step); each compiled program has one (tokens, seqs) pair from them.
    Empty ladders are derived as powers of two up to `max_num_batched_tokens` and
    `max_num_seqs`. `num_pages` wins over `kv_cache_memory_fraction` when both are given.
    `scan_layers`: run the decoder layers as one `lax.scan` over stacked weights (compile
    time independent of depth) rather than a Python loop; None picks it on TPU/GPU, and the
    loop on CPU, where XLA copies each layer's weights out of the stack and a step runs ~2x
    slower. `attention_backend`: "auto" (Pallas kernels on TPU/GPU, the jnp CPU backend on
    CPU), "pallas", "cpu", or "reference" (the slow oracle); see `jaxserve.attention`.
    `executable_cache`: keep every compiled bucket program on disk whole, beside the
    compilation cache, so a restart neither traces nor compiles
    (`jaxserve.engine.executable_store`). `quantization`: store the weights in "int8" or
    "fp8" with per-channel scales (None: as the checkpoint is), and `quantize_activations`:
    run those matmuls in int8/fp8 too (`jaxserve.model.quantization`; checked where the
    model's config takes them, `with_quantization`). `kv_cache_dtype`:
    "auto" (the compute dtype), "int8" (a scale per token and kv head) or "fp8" (e4m3, a
    scale per kv head) pages (`pallas_kernels.kv_quant`): about twice the pages in the same
    memory. `calculate_kv_scales` (vLLM's name): fp8 scales calibrated from the first step
    that writes real tokens, instead of 1.
    """

    max_model_len: int = 2048
    page_size: int = 16
    num_pages: int | None = None
    kv_cache_memory_fraction: float = 0.5
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    num_decode_steps: int = 8
    enable_prefix_caching: bool = True
    strict_compile: bool = False
    token_buckets: tuple[int, ...] = ()
    seq_buckets: tuple[int, ...] = ()
    attention_backend: str = "auto"
    compilation_cache_dir: str | None = None
    executable_cache: bool = True
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    scan_layers: bool | None = None
    devices: tuple[int, ...] | None = None
    quantization: str | None = None
    quantize_activations: bool = False
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False

    def __post_init__(self):
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.calculate_kv_scales and self.kv_cache_dtype != "fp8":
            raise ValueError("calculate_kv_scales calibrates an fp8 KV cache's scales; it "
                             f"needs kv_cache_dtype='fp8', got {self.kv_cache_dtype!r}")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens",
                     "num_decode_steps", "tensor_parallel_size", "data_parallel_size"):
            _positive_int(name, getattr(self, name))
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
