"""`jaxserve plan`: build a deployment as `serve` would and compile it for hardware that is
not attached, to prove before renting anything that every program compiles and fits.

The engine is built from the same parts as `serve`'s: the preset's options checked against
the model (`engine_config_for`), the mesh over the target's devices, the parameters placed by
the partition rules (`abstract_sharded_model`: shapes and shardings from `config.json` alone,
no weight files), the KV cache sized as the engine sizes it (`pages_for_memory`: a fraction of
what the weights leave of the device's memory; with `gpu_memory_utilization`, after compiling
the programs for a provisional pool, `jaxserve.engine.memory_budget`), and the `Runner`, whose
`program_inputs` are what warm-up compiles. Each chosen program is traced, lowered for the
target's platform and compiled by XLA:TPU / XLA:GPU (Mosaic and Triton compile the Pallas
kernels on the way).

What is checked, per device, from each compiled executable's `memory_analysis()`:
- the KV cache guard (`jaxserve.engine.cache_audit`, the same as on CPU): `cache_donated`,
  the KV cache input aliased to its output (the step updates pages in place);
  `cache_copies`, no copy of a page pool on one device (e.g. XLA relaying the pool out for the
  attention kernel; `pallas_kernels.kv_quant` says which layouts avoid it), and
  `cache_whole_pool_ops`, nothing else producing a whole pool but its one write. Read from
  the compiled HLO: memory_analysis may not count such a copy;
- `weight_copies`, relayouts of a whole weight (`jaxserve.engine.weight_layouts`: on TPU the
  programs take the weights in the layouts XLA chooses for the decode loop), reported;
- the program's peak, arguments + outputs - aliased + temporaries + code, within the device's
  memory. `fits` holds when the weights plus the cache fit and every program's peak does.

A models file runs several engines on one host (`jaxserve.aot.models_plan`): each is planned
here with the bytes that engines loaded before it already hold (`in_use_bytes`) and on the
devices its `devices` option names, so that its cache is sized from what is left and the
checks above count the others' weights and caches too.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
from flax import nnx
from tqdm.auto import tqdm

import sharding
from jaxserve.aot import gpu_kernels
from jaxserve.aot.collectives import collectives
from jaxserve.aot.targets import GIB, Target, compile_only_devices
from jaxserve.loading.checkpoint import model_config as checkpoint_model_config
from jaxserve.model.config import with_expert_parallel, with_quantization
from jaxserve.engine import cache_audit, weight_layouts
from jaxserve.engine.cache_audit import PagePools
from jaxserve.config.engine import EngineConfig
from jaxserve.engine.engine_setup import scan_layers_for
from jaxserve.engine.kv_cache import full_page_bytes, pages_for_memory, window_pool_bytes
from jaxserve.engine.memory_budget import MemoryBudget
from jaxserve.config.window import WindowLayout
from jaxserve.engine.window_pages import window_layout
from pallas_kernels.kv_quant import page_dtype
from jaxserve.llm import engine_config_for
from jaxserve.model.config import resolve_dtype
from jaxserve.presets import Preset
from jaxserve.engine.runner import Runner
from jaxserve.loading.weights import abstract_sharded_model
from jaxserve.lora.stacks import slot_stack_bytes
from jaxserve.speculative import eagle3
from jaxserve.speculative.draft import draft_config


@dataclasses.dataclass
class ProgramReport:
    """One compiled program: its bucket, what compiling it took and what it needs per device."""

    name: str
    tokens: int
    seqs: int
    compiled: bool = False
    compile_seconds: float = 0.0
    temp_bytes: int = 0
    output_bytes: int = 0  # outputs not aliased to a donated input
    peak_bytes: int = 0
    cache_donated: bool = False
    cache_copies: int = 0  # copy instructions of a whole page pool (relayouts)
    cache_whole_pool_ops: int = 0  # other instructions producing a whole pool, beyond writes
    cache_staged: int = 0  # XLA:TPU moving a whole (test-sized) pool into VMEM and back
    weight_copies: int = 0  # copies or transposes of a whole weight (relayouts)
    error: str | None = None
    kernels: list[dict] | None = None  # GPU, with --verbose: the Triton kernels' resources
    collectives: dict[str, dict[str, int]] | None = None  # kind -> count, bytes per device


BUCKET_CHOICES = ("ends", "largest", "all")


def chosen_programs(runner: Runner, buckets: str) -> list[tuple[str, int, int]]:
    """The bucket programs to compile: `all`; per kind the smallest and the largest
    (`ends`); or per kind the largest only (`largest`: the programs whose peak decides the
    fit, half the compile time of `ends`)."""
    if buckets not in BUCKET_CHOICES:
        raise ValueError(f"buckets must be one of {BUCKET_CHOICES}, got {buckets!r}")
    keys = runner.bucket_programs()
    if buckets == "all":
        return keys
    chosen = []
    for kind in dict.fromkeys(kind for kind, _, _ in keys):
        of_kind = sorted((k for k in keys if k[0] == kind), key=lambda k: (k[1] * k[2], k))
        ends = [of_kind[-1]] if buckets == "largest" else [of_kind[0], of_kind[-1]]
        chosen += list(dict.fromkeys(ends))
    return chosen


def compile_program(jitted, args, name: str, tokens: int, seqs: int, kv_cache_bytes: int,
                    platform: str, dump_dir: str | None = None,
                    pools: PagePools | None = None) -> ProgramReport:
    """Compile one jitted program for `platform` from abstract `args` and read its needs.

    `kv_cache_bytes`: the cache's bytes per device, which must all be aliased for
    `cache_donated`. `dump_dir`: where XLA dumps the compile (GPU kernel resources).
    `pools`: the page pools on one device, audited by `cache_audit` (None: no pools)."""
    report = ProgramReport(name, tokens, seqs)
    started = time.perf_counter()
    try:
        lowered = jitted.trace(*args).lower(lowering_platforms=(platform,))
        compiled = lowered.compile({"xla_dump_to": dump_dir} if dump_dir else None)
    except Exception as err:  # a compile error of any kind is this program's result
        report.error = f"{type(err).__name__}: {str(err).splitlines()[0][:500]}"
        return report
    report.compile_seconds = round(time.perf_counter() - started, 2)
    memory = compiled.memory_analysis()
    report.compiled = True
    report.temp_bytes = int(memory.temp_size_in_bytes)
    report.output_bytes = int(memory.output_size_in_bytes - memory.alias_size_in_bytes)
    report.peak_bytes = int(memory.argument_size_in_bytes + memory.output_size_in_bytes
                            - memory.alias_size_in_bytes + memory.temp_size_in_bytes
                            + memory.generated_code_size_in_bytes)
    text = compiled.as_text()  # printed once for the three audits
    found = cache_audit.audit(compiled, pools or PagePools((), ()), kv_cache_bytes, text)
    report.cache_donated = found.donated
    report.cache_copies = found.copies
    report.cache_whole_pool_ops = found.whole_pool_ops
    report.cache_staged = found.staged
    report.weight_copies = weight_layouts.weight_copies(text, args[0])
    report.collectives = collectives(text)
    return report


def weights_bytes_per_device(model) -> int:
    """Bytes of the parameters one device holds (its shards), from their shardings."""
    _, state = nnx.split(model)
    total = 0
    for _, var in nnx.to_flat_state(state):
        value = var.get_value()
        shard = value.sharding.shard_shape(value.shape)
        total += math.prod(shard) * jnp.dtype(value.dtype).itemsize
    return total


def plan_target(preset: Preset) -> Target:
    """What a preset's plan compiles for; `ValueError` for a preset that names none."""
    if preset.platform not in ("tpu", "gpu"):
        raise ValueError(f"{preset.path.name}: plans are for tpu and gpu presets, not "
                         f"{preset.platform!r} (on CPU, `jaxserve serve` compiles at start-up)")
    if preset.accelerator is None:
        raise ValueError(f"{preset.path.name}: hardware.accelerator is needed for a plan")
    return Target(preset.platform, preset.accelerator, preset.devices)


def mesh_device_indices(engine: EngineConfig) -> tuple[int, ...]:
    """The device indices an engine's mesh uses: its `devices` option, else the first
    tp * dp (as `engine_mesh` picks them at serve time)."""
    if engine.devices is not None:
        return engine.devices
    return tuple(range(engine.tensor_parallel_size * engine.data_parallel_size))


def build_plan(preset: Preset, model_dir: str | Path, dtype: str | None = None,
               overrides: dict[str, Any] | None = None, buckets: str = "ends",
               verbose: bool = False, progress: bool = True,
               model_name: str | None = None,
               in_use_bytes: Mapping[int, int] | None = None) -> dict[str, Any]:
    """The plan of `model_dir` served with `preset` (plus `overrides`), as a JSON-ready dict;
    `model_name`: how the report names the model (default: the folder's name).

    `in_use_bytes`: bytes per device already taken by other engines, by device index (absent:
    0). As `Engine` does, the cache is a fraction of what the mesh's first device has free
    once the weights are placed; the resident check and every program's peak add the largest
    in-use figure over the mesh's devices. The `devices` option (in `overrides` or the preset)
    picks the mesh's devices among the target's, as at serve time.

    Raises `ValueError` for bad usage (an option that cannot work, a CPU preset); a plan that
    does not fit or a program that fails to compile is a result (`fits` false, `reason`)."""
    target = plan_target(preset)
    model_config = checkpoint_model_config(model_dir)
    param_dtype = resolve_dtype(dtype or preset.dtype or "auto", model_config.checkpoint_dtype)
    engine = engine_config_for(model_config, {**preset.engine_options, **(overrides or {})})
    model_config = with_quantization(model_config, engine.quantization,
                                     engine.quantize_activations, target.platform,
                                     target.accelerator or "")
    model_config = with_expert_parallel(model_config, engine.enable_expert_parallel,
                                        engine.tensor_parallel_size, target.platform)
    devices = compile_only_devices(target)
    indices = mesh_device_indices(engine)
    if engine.devices is not None:
        outside = [i for i in indices if i >= len(devices)]
        if outside:
            raise ValueError(f"devices {outside} are out of range: {target.name} has "
                             f"{len(devices)} device(s), 0 to {len(devices) - 1}")
        devices = tuple(devices[i] for i in indices)
    mesh = sharding.make_mesh(engine.tensor_parallel_size, engine.data_parallel_size, devices)
    replica_mesh = sharding.replica_meshes(mesh)[0]  # every replica compiles the same programs
    scan = scan_layers_for(engine, model_config, target.platform)
    model = abstract_sharded_model(model_config, param_dtype, replica_mesh, scan)
    stored = model.config  # as stored on the mesh (kv heads repeated when tp > Hkv)
    draft = _abstract_draft(engine, model_config, param_dtype, replica_mesh, scan, model_dir)
    models = [model] if draft is None else [model, draft]
    hbm = target.hbm_bytes()
    cache_dtype = page_dtype(engine.kv_cache_dtype, param_dtype)
    weights = sum(weights_bytes_per_device(m) for m in models)
    lora_bytes = slot_stack_bytes(stored, engine.max_loras, engine.max_lora_rank,
                                  replica_mesh, param_dtype) if engine.enable_lora else 0
    weights += lora_bytes  # the adapter slots sit beside the weights for good
    result: dict[str, Any] = {
        "platform": target.platform, "target": target.name, "devices": target.devices,
        "preset": preset.path.name, "model": model_name or Path(model_dir).name,
        "dtype": jnp.dtype(param_dtype).name, "scan_layers": model.scan_layers,
        "quantization": model_config.quantization and model_config.quantization.method,
        "expert_parallel": model_config.moe is not None and model_config.moe.expert_parallel,
        "kv_cache_dtype": jnp.dtype(cache_dtype).name,
        "fits": False, "hbm_bytes_per_device": hbm, "weights_bytes_per_device": weights,
        "lora_slots_bytes_per_device": lora_bytes,
        "kv_cache_bytes_per_device": 0, "num_pages": 0, "max_concurrent_tokens": 0,
        "max_temp_bytes_per_device": 0, "warm_up_programs": 0, "programs": [],
        "reason": None}
    tp = engine.tensor_parallel_size
    taken = in_use_bytes or {}
    first_in_use = taken.get(indices[0], 0)  # what the engine sizes its cache from
    most_in_use = max(taken.get(i, 0) for i in indices)  # what the checks hold it to
    window = window_layout(stored, engine)
    budget = None
    if engine.gpu_memory_utilization is not None and engine.num_pages is None:
        budget = _memory_budget(model, engine, replica_mesh, target, draft, window, buckets,
                                weights, first_in_use, progress)
        result["memory_budget"] = {**dataclasses.asdict(budget),
                                   "kv_cache_bytes": budget.kv_cache_bytes,
                                   "arithmetic": budget.arithmetic()}
        needed = ((1 + engine.pages_per_seq) * full_page_bytes(
            stored, engine, cache_dtype, tp, target.platform, draft and draft.config, window)
            + window_pool_bytes(stored, engine, cache_dtype, window, tp, target.platform))
        result["reason"] = budget.problem(needed)
        if result["reason"]:
            result["reason"] += _moe_hint(model_config, engine)
            return result
    try:
        num_pages = pages_for_memory(stored, engine, cache_dtype, hbm, first_in_use + weights,
                                     tp, target.platform, draft and draft.config, window,
                                     budget and budget.kv_cache_bytes)
    except ValueError as err:
        result["reason"] = f"weights take {weights / GIB:.2f} GiB of {hbm / GIB:.2f} GiB " \
                           f"per device{_in_use_note(first_in_use)}: {err}" \
                           + _moe_hint(model_config, engine)
        return result
    kv_bytes = (num_pages * full_page_bytes(stored, engine, cache_dtype, tp, target.platform,
                                            draft and draft.config, window)
                + window_pool_bytes(stored, engine, cache_dtype, window, tp, target.platform))
    result.update(num_pages=num_pages, kv_cache_bytes_per_device=kv_bytes,
                  max_concurrent_tokens=(num_pages - 1) * engine.page_size,
                  **hybrid_memory_report(stored, engine, cache_dtype, hbm,
                                         first_in_use + weights, tp, target.platform,
                                         draft and draft.config, window, num_pages))
    runner = Runner(model, engine, num_pages, replica_mesh, target.platform, draft=draft,
                    window=window)
    reports = []
    programs = chosen_programs(runner, buckets)
    pools = runner.page_pools()
    result["warm_up_programs"] = len(runner.bucket_programs())  # per replica, at serve time
    for kind, tokens, seqs in tqdm(programs, desc=f"Compiling for {target.name}",
                                   unit="program", disable=not progress):
        jitted, args = runner.program_inputs(kind, tokens, seqs)
        with tempfile.TemporaryDirectory() as dump:
            dump_dir = dump if verbose and target.platform == "gpu" else None
            report = compile_program(jitted, args, kind, tokens, seqs, kv_bytes,
                                     target.lowering_platform, dump_dir, pools)
            if dump_dir and report.compiled:
                report.kernels = gpu_kernels.triton_kernel_resources(dump_dir)
        reports.append(report)
    result["programs"] = [dataclasses.asdict(r) for r in reports]
    result["max_temp_bytes_per_device"] = max((r.temp_bytes for r in reports), default=0)
    result["reason"] = _failure(reports, weights + kv_bytes, hbm, most_in_use)
    if result["reason"]:
        result["reason"] += _moe_hint(model_config, engine)
    result["fits"] = result["reason"] is None
    return result


def _memory_budget(model, engine: EngineConfig, mesh, target: Target, draft,
                   window: WindowLayout | None, buckets: str, weights: int, in_use: int,
                   progress: bool) -> MemoryBudget:
    """The `MemoryBudget` the engine computes with `gpu_memory_utilization`: the chosen
    programs compiled for a provisional pool of one sequence (their temporaries do not grow
    with the pool), the device's memory as `Target.hbm_bytes`."""
    probe = Runner(model, engine, 1 + engine.pages_per_seq, mesh, target.platform,
                   draft=draft, window=window)
    needs = {}
    for kind, tokens, seqs in tqdm(chosen_programs(probe, buckets), unit="program",
                                   desc="Compiling for the memory budget", disable=not progress):
        jitted, args = probe.program_inputs(kind, tokens, seqs)
        report = compile_program(jitted, args, kind, tokens, seqs, 0, target.lowering_platform)
        if report.compiled:  # a program that fails fails again below, with its error
            needs[f"{kind} ({tokens} tokens, {seqs} rows)"] = (report.temp_bytes
                                                               + report.output_bytes)
    return MemoryBudget.of(target.hbm_bytes(), engine.gpu_memory_utilization, weights,
                           in_use, needs)


def hybrid_memory_report(model, engine: EngineConfig, dtype, hbm: int, in_use: int, tp: int,
                         platform: str, draft, window: WindowLayout | None,
                         num_pages: int) -> dict[str, Any]:
    """What hybrid KV memory buys (`jaxserve.engine.window_pages`): the window pool's pages
    and bytes, and the full-length sequences that fit with it and with full-context pages
    for every layer (`disable_hybrid_kv_cache_manager`)."""
    if window is None:
        return {"window_layers": 0, "window_pool_pages": 0, "window_pool_bytes_per_device": 0}
    try:
        flat = pages_for_memory(model, engine, dtype, hbm, in_use, tp, platform, draft)
    except ValueError:  # without it not even one full-length sequence fits
        flat = 1
    return {"window_layers": len(window.layers), "window_pool_pages": window.num_pages,
            "window_pool_bytes_per_device": window_pool_bytes(model, engine, dtype, window, tp,
                                                              platform),
            "max_seqs_at_max_model_len": (num_pages - 1) // engine.pages_per_seq,
            "max_seqs_at_max_model_len_without_hybrid": (flat - 1) // engine.pages_per_seq}


def _abstract_draft(engine: EngineConfig, target_config, dtype, mesh, scan: bool,
                    model_dir: str | Path):
    """The abstract draft model of `speculative_config` method "draft_model" (its config
    read, its vocabulary checked against the target's), or the EAGLE-3 head of "eagle3",
    or None."""
    spec = engine.speculative_config
    if spec is not None and spec.method == "eagle3":
        return eagle3.abstract_head(eagle3.with_head(spec, Path(model_dir)), target_config,
                                    dtype, mesh)
    if spec is None or spec.method != "draft_model":
        return None
    _, config = draft_config(spec, target_config, config_only=True)
    return abstract_sharded_model(config, dtype, mesh, scan)


def _moe_hint(model_config, engine: EngineConfig) -> str:
    """What a failing plan adds for a mixture of experts split column-wise over several
    devices: each device then holds a slice of every expert, and XLA:TPU relays out the
    stacked expert weights whole when that slice is not a multiple of 128 lanes (Qwen3-30B-A3B
    on v6e-8: 768 / 8 = 96 columns, two 3 GiB copies of the gate and up stacks per device,
    docs/models.md); expert parallelism keeps whole experts on each device."""
    moe = model_config.moe
    tp = engine.tensor_parallel_size
    if moe is None or tp == 1 or moe.expert_parallel:
        return ""
    return (f"; each device holds a {moe.intermediate_size // tp}-column slice of every expert "
            f"({moe.intermediate_size} / {tp}), which XLA may copy whole into another "
            "layout: expert parallelism keeps whole experts per device "
            "(--enable-expert-parallel; the v6e-8-moe preset does)")


def _in_use_note(in_use: int) -> str:
    """How a failure mentions the bytes other engines hold (nothing when they hold none)."""
    return f" with {in_use / GIB:.2f} GiB in use by other engines" if in_use else ""


def _failure(reports: list[ProgramReport], resident: int, hbm: int,
             in_use: int) -> str | None:
    """Why the plan fails (the first reason), or None. `resident`: the engine's weights + KV
    cache bytes per device; `in_use`: bytes other engines hold on its fullest device."""
    note = _in_use_note(in_use)
    for r in reports:
        if not r.compiled:
            return f"program {r.name} ({r.tokens} tokens, {r.seqs} seqs) failed: {r.error}"
        problem = cache_audit.CacheAudit(r.cache_donated, r.cache_copies,
                                         r.cache_whole_pool_ops).problem()
        if problem:
            return f"program {r.name} ({r.tokens}, {r.seqs}) {problem}"
        if in_use + r.peak_bytes > hbm:
            return (f"program {r.name} ({r.tokens}, {r.seqs}) needs {r.peak_bytes / GIB:.2f} "
                    f"GiB per device of {hbm / GIB:.2f}{note}")
    if in_use + resident > hbm:
        return f"weights + KV cache take {resident / GIB:.2f} GiB of {hbm / GIB:.2f}{note}"
    return None
