"""What an `Engine` is built from, in the order it is built: the compilation caches, the
device mesh, the model placed on it (sharded, layers stacked for a scan), the KV page pool's
size, and one `Replica` per data-parallel sub-mesh (allocator, scheduler, runner with its
programs compiled or read). `jaxserve plan` and the CLI's checks call the same functions,
so a plan and a server agree on the mesh and the layer layout."""

from __future__ import annotations

import logging

import jax
from jax.sharding import Mesh

import sharding
from jaxserve.config.engine import EngineConfig
from jaxserve.config.window import WindowLayout
from jaxserve.engine import multihost
from jaxserve.engine.executable_store import ExecutableStore
from jaxserve.engine.kv_cache import choose_num_pages
from jaxserve.engine.memory_budget import MemoryBudget, pages_after_compiling
from jaxserve.engine.page_allocator import PageAllocator
from jaxserve.engine.replica import Replica, on_mesh
from jaxserve.engine.runner import Runner
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.window_pages import WindowPages
from jaxserve.loading.weights import shard_model, stack_layers
from jaxserve.lora.slots import SlotTable
from jaxserve.model import LlamaModel
from jaxserve.model.config import ModelConfig
from jaxserve.platforms import platform as platform_traits

log = logging.getLogger("jaxserve.engine")


def enable_compilation_cache(config: EngineConfig) -> None:
    """Turn on JAX's persistent compilation cache (unless the user already chose a folder),
    so a restart loads the bucket programs instead of compiling them. Not on CPU while the
    executable store is on: the store then caches the programs, and a CPU program that JAX's
    cache answered cannot be stored (`jaxserve.platforms.Platform.restores_cached_programs`,
    `jaxserve.engine.executable_store`)."""
    if jax.config.jax_compilation_cache_dir:
        return
    if (executable_store_for(config) is not None
            and not platform_traits().restores_cached_programs):
        return
    folder = config.resolved_cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def executable_store_for(config: EngineConfig) -> ExecutableStore | None:
    """Where the engine keeps its compiled programs between processes, or None: turned off,
    or a multi-process run (each process compiles through the persistent cache)."""
    if not config.executable_cache or multihost.is_multiprocess():
        return None
    return ExecutableStore(config.resolved_cache_dir() / "executables")


def scan_layers_for(config: EngineConfig, model: ModelConfig,
                    platform: str | None = None) -> bool:
    """Whether the layers run as a scan over stacked weights: as configured, else on TPU/GPU
    when the model's layer kinds repeat (`ModelConfig.scannable`: all alike, or periods
    like Gemma 3's five sliding and one global layer; not GLM's dense then sparse layers,
    which run as a loop). `platform`: where the programs will run (default: JAX's default
    backend)."""
    if config.scan_layers and not model.scannable:
        raise ValueError("scan_layers: this model's layers differ (sliding window, rope, or "
                         "dense and sparse MLPs) without repeating, so no stack of layers "
                         "can stand for them; leave scan_layers unset or false")
    if config.scan_layers is not None:
        return config.scan_layers
    return platform_traits(platform).scan_layers_by_default and model.scannable


def engine_mesh(config: EngineConfig) -> Mesh:
    """The `(data_parallel_size, tensor_parallel_size)` mesh over all processes' devices, or
    over the local devices `config.devices` names."""
    if config.data_parallel_size > 1 and multihost.is_multiprocess():
        raise ValueError("data_parallel_size > 1 is not supported across several processes; "
                         "use tensor_parallel_size over all hosts' devices")
    size = config.tensor_parallel_size * config.data_parallel_size
    if multihost.is_multiprocess() and size != jax.device_count():
        raise ValueError(f"tensor_parallel_size ({config.tensor_parallel_size}) must equal "
                         f"the {jax.device_count()} devices of all processes in a multi-host "
                         "run, so every process takes part in every step")
    devices = None
    if config.devices is not None:
        if multihost.is_multiprocess():
            raise ValueError("devices cannot be chosen in a multi-host run (every process's "
                             "devices take part in every step)")
        local = jax.local_devices()
        outside = [d for d in config.devices if d >= len(local)]
        if outside:
            raise ValueError(f"devices {outside} are out of range: this process has "
                             f"{len(local)} {local[0].platform} device(s), 0 to {len(local) - 1}")
        devices = [local[d] for d in config.devices]
    return sharding.make_mesh(config.tensor_parallel_size, config.data_parallel_size, devices)


def placed_on_mesh(model: LlamaModel, config: EngineConfig, mesh: Mesh) -> LlamaModel:
    """`model` sharded on `mesh` by the partition rules (a no-op when `LLM` loaded it
    sharded), its layers stacked when they run as a scan (`scan_layers_for`; the per-layer
    arrays are consumed)."""
    model = shard_model(model, mesh)
    if scan_layers_for(config, model.config):
        model = stack_layers(model)
    return model


def kv_pool_pages(model: LlamaModel, config: EngineConfig, page_dtype, mesh: Mesh,
                  device_bytes_limit: int | None, draft, window: WindowLayout | None,
                  lora_bytes: int, store: ExecutableStore | None
                  ) -> tuple[int, MemoryBudget | None]:
    """(pages of the full-context pool, the `MemoryBudget` that sized it or None): with
    `gpu_memory_utilization`, sized after compiling (`memory_budget`); else
    `kv_cache_memory_fraction` of the first local device's free memory (`choose_num_pages`),
    `lora_bytes` held back for the adapter slots placed after it. Every process of a
    multi-host run agrees on the smallest."""
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    budget = None
    sized = pages_after_compiling(model, config, page_dtype, mesh, local[0],
                                  device_bytes_limit, draft, window, lora_bytes, store)
    if sized is not None:
        pages, budget = sized
        log.info("KV cache: %s: %d pages", budget.arithmetic(), pages)
    else:
        pages = choose_num_pages(model.config, config, page_dtype, local[0],
                                 config.tensor_parallel_size,
                                 None if draft is None else draft.config,
                                 reserved_bytes=lora_bytes, window=window)
    return multihost.agree(pages), budget


def new_replica(model: LlamaModel, draft, config: EngineConfig, num_pages: int, sub_mesh: Mesh,
                window: WindowLayout | None, store: ExecutableStore | None,
                progress: bool) -> Replica:
    """One data-parallel replica on `sub_mesh`: its page allocators, scheduler and runner,
    the runner's programs warmed up (the smallest rung only when compiling the rest in the
    background) and the scheduler capped to them. `model` and `draft` are the engine's;
    with several replicas each gets views of them on its own devices."""
    allocator = PageAllocator(num_pages, config.page_size, config.enable_prefix_caching)
    windows = None if window is None else WindowPages(
        window, PageAllocator(window.num_pages, config.page_size, config.enable_prefix_caching))
    if config.data_parallel_size > 1:
        model = on_mesh(model, sub_mesh)
        draft = None if draft is None else on_mesh(draft, sub_mesh)
    runner = Runner(model, config, num_pages, sub_mesh, executable_store=store, draft=draft,
                    window=window)
    runner.warm_up(progress, background=config.compile_in_background
                   and not multihost.is_multiprocess())
    slots = SlotTable(config.max_loras) if config.enable_lora else None
    replica = Replica(allocator, Scheduler(config, allocator, slots, windows), runner)
    cap_steps(replica)
    return replica


def cap_steps(replica: Replica) -> None:
    """A replica's scheduler caps: what the programs taken in so far can run."""
    background = replica.runner.background
    if background is not None:
        tokens, rows = background.limits
        replica.scheduler.max_num_batched_tokens = tokens
        replica.scheduler.max_num_seqs = rows
