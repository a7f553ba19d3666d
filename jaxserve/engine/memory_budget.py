"""The KV cache sized after compiling, as vLLM sizes it after its profiling run.

With `gpu_memory_utilization` (vLLM's name and meaning: the share of the device's memory
this engine may use), the pool gets what is left of that share once the engine's resident
weights, the largest program's temporaries and a margin are taken out:

    pool = min(bytes_limit * gpu_memory_utilization, bytes_limit - others)
           - weights - temporaries - margin

- `bytes_limit`: what the device's allocator allows (`memory_stats()["bytes_limit"]`; on
  GPU it already reflects XLA's preallocated share of the card);
- `others`: what is in use on the device besides this engine's weights (engines loaded
  before it in the same process);
- `weights`: this engine's weights (and LoRA slots) on one device;
- `temporaries`: the largest, over the largest bucket program of each kind, of its
  temporaries plus the outputs not aliased to its inputs (`memory_analysis()`), read from
  those programs compiled for a small provisional pool (`compiled_temporaries`) before the
  real one is allocated and its programs compiled. A program that updates the cache in
  place (donated) needs temporaries that do not grow with the pool: on XLA:CPU they are the
  same bytes; XLA:GPU may schedule a loop differently beside a large pool, a few MiB more
  (docs/plans.md), which the margin absorbs, and `Runner.check_device_memory` checks the
  real programs against the device before their first run;
- `margin`: `MARGIN_FRACTION` of `bytes_limit`, for the step's inputs and the allocator's
  fragmentation.

An engine that cannot fit fails before its first step, naming the term that is too big
(`MemoryBudget.problem`). CPUs report no limit: their cache is sized as before
(`kv_cache.pages_for_memory`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

import sharding
from jaxserve.config.engine import EngineConfig
from jaxserve.engine.executable_store import ExecutableStore
from jaxserve.engine.memory_figures import program_temporaries
from jaxserve.engine.kv_cache import full_page_bytes, pages_for_memory, window_pool_bytes
from jaxserve.engine.runner import Runner
from jaxserve.config.window import WindowLayout

MARGIN_FRACTION = 0.02  # of the device's limit
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    """One device's memory, term by term, and the KV cache's bytes it leaves."""

    bytes_limit: int
    gpu_memory_utilization: float
    weights_bytes: int
    others_bytes: int
    temp_bytes: int
    temp_program: str  # which program needs `temp_bytes`
    margin_bytes: int

    @classmethod
    def of(cls, bytes_limit: int, gpu_memory_utilization: float, weights_bytes: int,
           others_bytes: int, temporaries: dict[str, int]) -> "MemoryBudget":
        """The budget of a device; `temporaries`: each program's temporaries and unaliased
        outputs, by name (the largest counts)."""
        program, temp = max(temporaries.items(), key=lambda item: item[1],
                            default=("none", 0))
        return cls(bytes_limit, gpu_memory_utilization, weights_bytes, others_bytes, temp,
                   program, int(bytes_limit * MARGIN_FRACTION))

    @property
    def allowed_bytes(self) -> int:
        """What this engine may use: its share of the limit, less what others hold."""
        return min(int(self.bytes_limit * self.gpu_memory_utilization),
                   self.bytes_limit - self.others_bytes)

    @property
    def kv_cache_bytes(self) -> int:
        """The pool's bytes on one device (negative: it does not fit)."""
        return self.allowed_bytes - self.weights_bytes - self.temp_bytes - self.margin_bytes

    def terms(self) -> dict[str, int]:
        """What comes out of the allowed bytes, by name."""
        return {"weights": self.weights_bytes,
                f"the temporaries of the {self.temp_program} program": self.temp_bytes,
                "the margin": self.margin_bytes}

    def arithmetic(self) -> str:
        """The sizing in one line, in GiB."""
        share = f"{_gib(self.bytes_limit)} x gpu_memory_utilization {self.gpu_memory_utilization}"
        if self.others_bytes:
            share = f"min({share}, {_gib(self.bytes_limit)} - {_gib(self.others_bytes)} in " \
                    "use by others)"
        taken = " - ".join(f"{_gib(count)} {name}" for name, count in self.terms().items())
        return f"{share} - {taken} = {_gib(self.kv_cache_bytes)} for the KV cache"

    def problem(self, needed_bytes: int) -> str | None:
        """Why a pool of at least `needed_bytes` (one full-length sequence and the padding
        page) does not fit, naming the largest term, or None."""
        if self.kv_cache_bytes >= needed_bytes:
            return None
        name, count = max(self.terms().items(), key=lambda item: item[1])
        if self.others_bytes > self.bytes_limit * (1 - self.gpu_memory_utilization):
            name, count = "memory in use by others", self.others_bytes
        return (f"the KV cache needs at least {_gib(needed_bytes)} and gets "
                f"{_gib(self.kv_cache_bytes)}: {self.arithmetic()}; the largest term is "
                f"{name} ({_gib(count)}): lower max_model_len, max_num_batched_tokens or "
                "max_num_seqs, quantize the weights, add devices or raise "
                "gpu_memory_utilization")


def bytes_per_device(arrays) -> int:
    """Bytes one device holds of `arrays` (arrays or `ShapeDtypeStruct`s with shardings)."""
    return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
               for a in jax.tree.leaves(arrays))


def abstract_module(module: nnx.Module, mesh: Mesh) -> nnx.Module:
    """`module` with every array replaced by its shape, dtype and partitioning on `mesh`
    (what `Runner` compiles from without running: `jaxserve plan`'s kind of model)."""
    graphdef, state = nnx.split(module)
    return nnx.merge(graphdef, jax.tree.map(lambda a: jax.ShapeDtypeStruct(
        a.shape, a.dtype, sharding=NamedSharding(mesh, a.sharding.spec)), state))


def largest_buckets(buckets: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """The bucket of each kind of program with the most tokens, then rows: the one whose
    temporaries (activations, logits) are the largest of its kind."""
    largest: dict[str, tuple[str, int, int]] = {}
    for bucket in buckets:
        kind = bucket[0]
        if kind not in largest or bucket[1:] > largest[kind][1:]:
            largest[kind] = bucket
    return list(largest.values())


def compiled_temporaries(runner) -> dict[str, int]:
    """`program_temporaries` of the largest bucket program of each kind, by name, compiled
    for `runner` (a `Runner`, usually of an abstract model and a small provisional pool):
    a few compiles, not the ladder's. Every real program is checked against the device
    before its first run all the same (`Runner.check_device_memory`)."""
    return {f"{kind} ({tokens} tokens, {rows} rows)":
            program_temporaries(runner.program(kind, tokens, rows))
            for kind, tokens, rows in largest_buckets(runner.bucket_programs())}


def pages_after_compiling(model: nnx.Module, config: EngineConfig, dtype, mesh: Mesh,
                          device: jax.Device, bytes_limit: int | None = None,
                          draft: nnx.Module | None = None, window: WindowLayout | None = None,
                          reserved_bytes: int = 0,
                          executable_store: ExecutableStore | None = None
                          ) -> tuple[int, MemoryBudget] | None:
    """(the pool's pages, its `MemoryBudget`) of an engine with `gpu_memory_utilization`, its
    `model` (and `draft`) placed on `mesh`, on `device` (the mesh's first of this process).
    `bytes_limit`: the device's limit (default: its allocator's; a test on CPU gives one).
    `reserved_bytes`: what the engine places beside the weights later (LoRA slots).
    None, and nothing compiled, without `gpu_memory_utilization`, with `num_pages`, or where
    the device reports no limit and none is given (CPU). `ValueError` when the pool cannot
    hold one full-length sequence, naming the term that is too big."""
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit") if bytes_limit is None else bytes_limit
    if config.num_pages is not None or config.gpu_memory_utilization is None or limit is None:
        return None
    models = [model] if draft is None else [model, draft]
    placed = sum(bytes_per_device(nnx.state(m)) for m in models)
    others = max(0, stats.get("bytes_in_use", placed) - placed)
    replica_mesh = sharding.replica_meshes(mesh)[0]
    probe = Runner(abstract_module(model, replica_mesh), config, 1 + config.pages_per_seq,
                   replica_mesh, executable_store=executable_store, window=window,
                   draft=None if draft is None else abstract_module(draft, replica_mesh))
    budget = MemoryBudget.of(limit, config.gpu_memory_utilization, placed + reserved_bytes,
                             others, compiled_temporaries(probe))
    tp, draft_config = config.tensor_parallel_size, draft and draft.config
    one_page = full_page_bytes(model.config, config, dtype, tp, device.platform, draft_config,
                               window)
    needed = ((1 + config.pages_per_seq) * one_page
              + window_pool_bytes(model.config, config, dtype, window, tp, device.platform))
    problem = budget.problem(needed)
    if problem:
        raise ValueError(problem)
    pages = pages_for_memory(model.config, config, dtype, limit, 0, tp, device.platform,
                             draft_config, window, available_bytes=budget.kv_cache_bytes)
    return pages, budget


def _gib(count: int) -> str:
    return f"{count / GIB:.2f} GiB"
