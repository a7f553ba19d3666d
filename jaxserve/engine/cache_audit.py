"""What a compiled program does with the KV cache, read from its optimized HLO: the guard that a
step's cost cannot grow with the size of the page pool.

A step writes a few tokens into each page pool and reads the pages its rows own, so nothing in
it should touch a whole pool but the one in-place write. Two kinds of instruction break that
and cost a pass over every page, every layer and step, whatever the batch:
- a `copy` of a pool (a relayout for a kernel, or copy insertion around control flow);
- any other instruction, outside fusions, whose result is a whole pool beyond the pool's one
  write: e.g. the write computed twice because a fused view of it fed a `lax.switch`
  (XLA:CPU did this for one-row decode until the CPU backend stopped passing that view).
Both are counted on the program as compiled for its platform (CPU here; TPU and GPU in
`jaxserve plan`), for every bucket. Donation is checked from `memory_analysis()`: the whole
cache must be aliased from input to output.

Not counted as either: XLA:TPU's memory-space assignment staging a whole pool in VMEM and back
(`copy-start`/`copy-done`), which it does only for a pool that fits there (tens of MB: test-sized
caches, never a deployment's); `staged` reports them.

A pool is recognised by its dtype, its number of pages leading and its element count (so any
view of it: `[N, ps, Hkv * D]` or `[N, ps, Hkv, D]`); for a stack of layers (`[G * N, ...]`)
one layer's slice counts too.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

# Instructions that name or pass a buffer on without computing it.
_PASS_THROUGH = {"parameter", "get-tuple-element", "tuple", "bitcast", "while", "conditional",
                 "call", "opt-barrier", "async-start", "async-done", "async-update",
                 "custom-call"}
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%\S+ = (\w+)\[([\d,]*)\]\S* ([\w-]+)\(")
_FUSED = re.compile(r"\bfusion\(.*calls=%([\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class PagePools:
    """One device's page pools: the cache's 3-D leaves (`[N, page_size / f, f * Hkv * D]`)
    and int8 pages' scale pools (2-D leaves as long as them); `layers`: per pool, the
    layers sharing it (1, or a stack's layers)."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    layers: tuple[int, ...] = ()  # () : 1 each

    @classmethod
    def of(cls, *parts: tuple[Any, int]) -> "PagePools":
        """The pools of cache pytrees (arrays or `ShapeDtypeStruct`s with shardings), each
        part given with the layers each of its pools holds."""
        shapes, dtypes, layers = [], [], []
        for caches, count in parts:
            leaves = jax.tree.leaves(caches)
            lengths = {leaf.shape[0] for leaf in leaves if leaf.ndim == 3}
            for leaf in leaves:
                if leaf.ndim == 3 or (leaf.ndim == 2 and leaf.shape[0] in lengths):
                    shapes.append(tuple(leaf.sharding.shard_shape(leaf.shape)))
                    dtypes.append(np.dtype(leaf.dtype).name)
                    layers.append(count)
        return cls(tuple(shapes), tuple(dtypes), tuple(layers))

    @classmethod
    def exactly(cls, arrays) -> "PagePools":
        """`arrays` (with shardings) taken as the pools, whatever their rank."""
        return cls(tuple(tuple(a.sharding.shard_shape(a.shape)) for a in arrays),
                   tuple(np.dtype(a.dtype).name for a in arrays))

    def sizes(self) -> set[tuple[str, int, int]]:
        """(HLO element type, pages, element count) of a whole pool, and of one layer's
        slice: how an array that is (a view of) one is recognised."""
        out = set()
        for shape, dtype, layers in zip(self.shapes, self.dtypes,
                                        self.layers or (1,) * len(self.shapes)):
            count = math.prod(shape)
            out.add((hlo_type(dtype), shape[0], count))
            if layers > 1:
                out.add((hlo_type(dtype), shape[0] // layers, count // layers))
        return out


@dataclasses.dataclass
class CacheAudit:
    """What one compiled program does to the page pools."""

    donated: bool  # every cache byte aliased from input to output
    copies: int  # copy instructions producing a whole pool
    whole_pool_ops: int  # instructions producing a whole pool beyond each pool's one write
    staged: int = 0  # memory-space moves of a whole pool (XLA:TPU, pools that fit VMEM)
    opcodes: list[str] = dataclasses.field(default_factory=list)  # all producing a pool

    @property
    def ok(self) -> bool:
        return self.donated and not self.copies and not self.whole_pool_ops

    def problem(self) -> str | None:
        """What is wrong, in a sentence, or None."""
        if not self.donated:
            return "copies the KV cache (its input is not aliased to its output: not donated)"
        if self.copies:
            return (f"has {self.copies} copy instruction(s) of a whole KV page pool or int8 "
                    "scale pool (on TPU most likely a relayout for the kernel: a page or scale "
                    "row per device not a multiple of 128 lanes, see "
                    "pallas_kernels/kv_quant.py)")
        if self.whole_pool_ops:
            return (f"has {self.whole_pool_ops} instruction(s) producing a whole KV page pool "
                    "besides each pool's one in-place write (a step that touches every page)")
        return None


def unfused_instructions(hlo_text: str, with_fused: bool = False
                         ) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(HLO element type, shape, opcode) of every array-valued instruction of an optimized
    HLO module outside fusion computations (`with_fused`: inside them too), in program
    order (a scalar's shape is (1,))."""
    fused = set(_FUSED.findall(hlo_text))
    inside_fusion = False
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            inside_fusion = header.group(1) in fused and not with_fused
            continue
        match = None if inside_fusion else _INSTRUCTION.match(line)
        if match:
            element, dims, opcode = match.groups()
            yield element, tuple(int(d) for d in dims.split(",")) if dims else (1,), opcode


def pool_instructions(hlo_text: str, pools: PagePools) -> list[str]:
    """The opcodes of the instructions outside fusions whose result is a whole pool (its
    writes, copies and anything else computing one), in program order."""
    sizes = pools.sizes()
    return [opcode for element, shape, opcode in unfused_instructions(hlo_text)
            if (element, shape[0], math.prod(shape)) in sizes and opcode not in _PASS_THROUGH]


def audit(compiled: jax.stages.Compiled, pools: PagePools, cache_bytes: int,
          hlo_text: str | None = None) -> CacheAudit:
    """`CacheAudit` of a compiled program; `cache_bytes`: the cache's bytes on one device;
    `hlo_text`: its `as_text()`, when the caller has it already (a large program's text
    takes a while to print)."""
    found = pool_instructions(hlo_text or compiled.as_text(), pools)
    donated = compiled.memory_analysis().alias_size_in_bytes >= cache_bytes
    staged = found.count("copy-done")
    computed = len(found) - staged
    return CacheAudit(donated, found.count("copy"), max(0, computed - len(pools.shapes)),
                      staged, found)


def memory_problem(compiled: jax.stages.Compiled, cache_bytes: int, free_bytes: int
                   ) -> str | None:
    """Why a run of `compiled` would exhaust the device beside the weights and the KV cache
    already placed there, or None. `cache_bytes`: the cache's bytes on one device;
    `free_bytes`: what the device's allocator has left. A program whose cache input is not
    aliased to its output allocates a second cache at every run; any other needs room for
    its outputs (those not aliased) and temporaries."""
    memory = compiled.memory_analysis()
    if memory is None:
        return None
    if memory.alias_size_in_bytes < cache_bytes:
        return (f"does not update the KV cache in place (its output aliases "
                f"{_gib(memory.alias_size_in_bytes)} of the cache's {_gib(cache_bytes)}): "
                "each run would allocate a second cache")
    needed = (memory.output_size_in_bytes - memory.alias_size_in_bytes
              + memory.temp_size_in_bytes)
    if needed > free_bytes:
        return (f"needs {_gib(needed)} for its outputs and temporaries, and "
                f"{_gib(free_bytes)} are free beside the weights and the KV cache (lower "
                "kv_cache_memory_fraction or gpu_memory_utilization)")
    return None


def check_programs_fit(programs: dict[tuple[str, int, int], jax.stages.Compiled],
                       cache_bytes: int, device: jax.Device) -> None:
    """Raise `RuntimeError`, naming the programs (by bucket) and why, when one of
    `programs` would exhaust `device` at its first run (`memory_problem`), the weights and
    the KV cache (`cache_bytes` on one device) being placed already. Only where the
    allocator reports its limit (TPU, GPU; not CPU)."""
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        return
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    problems = {bucket: memory_problem(compiled, cache_bytes, free)
                for bucket, compiled in sorted(programs.items())}
    failing = {bucket: problem for bucket, problem in problems.items() if problem}
    if failing:
        (kind, tokens, rows), problem = next(iter(failing.items()))
        raise RuntimeError(
            f"{len(failing)} of {len(problems)} compiled programs cannot run on "
            f"{device.device_kind} (jax {jax.__version__}); e.g. the {kind} program of "
            f"{tokens} tokens and {rows} rows {problem}")


def _gib(count: int) -> str:
    return f"{count / 2**30:.2f} GiB"


def hlo_type(dtype: str) -> str:
    """numpy dtype name → HLO element type (float32 → f32, int8 → s8, ...)."""
    names = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int8": "s8",
             "uint8": "u8", "int32": "s32", "float8_e4m3fn": "f8e4m3fn",
             "float8_e5m2": "f8e5m2"}
    return names.get(dtype, dtype)
