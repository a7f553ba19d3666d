"""The serving engine: continuous batching over a paged KV cache.

Each `step()`: drain the inbox (new requests, aborts) → the scheduler picks this step's work
under the token budget → the batcher pads it to a bucket → the runner executes the compiled
program → sampled tokens come back in one host copy → `Scheduler.postprocess` (tokens
appended, stop tokens and length, pages) → the output processors (text, stop strings) → one
`StreamDelta` per request that moved. `add_request` and `abort` are safe to call from other
threads (the server's); `step()` runs on one thread.

Devices. The engine builds the `("data", "model")` mesh from `tensor_parallel_size` and
`data_parallel_size` and places the model on it by the partition rules (`shard_model`; a
no-op when `LLM` already loaded it sharded). Data parallelism is a set of independent
replicas, one per `(1, tp)` sub-mesh, each with its own scheduler, page pool, KV cache and
compiled programs; a new request joins the least-loaded replica, and each `step()` dispatches
every busy replica before fetching any result, so they run concurrently. Why replicas
rather than one program with the batch split across "data": a paged cache is a pool of pages
that any sequence may use, and splitting it across "data" would need per-shard pools inside
one scheduler and every step padded to the busiest shard; replicas keep the scheduler, the
allocator and the kernels unchanged, and each pads only to its own batch's bucket. Building
a replica copies nothing: its weights are views of the buffers already on its devices.
`runner` is replica 0's; `replicas` lists them all; `stats()` sums them.

Multi-host (see `jaxserve.engine.multihost`): process 0 schedules and broadcasts each step's
input before running it; other processes call `run_follower()`, which runs the same programs until
the leader's `shutdown()`.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import logging
import queue
import threading
import time
from typing import Iterable

import jax
import numpy as np
from jax.sharding import Mesh

import sharding
from jaxserve.errors import InvalidRequestError
from jaxserve.engine import multihost
from jaxserve.engine.batcher import StepInput, build_step_input
from jaxserve.model.config import ModelConfig
from jaxserve.config.engine import EngineConfig
from jaxserve.engine.kv_cache import choose_num_pages
from jaxserve.engine.memory_budget import pages_after_compiling
from pallas_kernels.kv_quant import page_dtype
from jaxserve.engine.metrics import EngineMetrics, EngineStats, StepRecord
from jaxserve.model import LlamaModel
from jaxserve.engine.output_processor import OutputProcessor, StreamDelta, logprob_entries
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.platforms import platform as platform_traits
from jaxserve.engine.page_allocator import PageAllocator
from jaxserve.engine.window_pages import WindowPages, window_layout
from jaxserve.engine.executable_store import ExecutableStore
from jaxserve.engine.program_cache import warn_near_mapping_limit
from jaxserve.engine.replica import InFlight, Replica, on_mesh
from jaxserve.engine.runner import Runner
from jaxserve.sampling.sampler import SampleResult, TargetLogprobs
from jaxserve.sampling_params import SamplingParams
from jaxserve.engine.scheduler import Scheduler, SchedulerOutput, SequenceUpdate
from jaxserve.engine.sequence import GrammarState, Sequence, Status
from jaxserve.loading.tokenizer import Tokenizer
from jaxserve.loading.weights import shard_model, stack_layers
from jaxserve.lora.registry import AdapterRegistry
from jaxserve.lora.request import LoRARequest
from jaxserve.lora.slots import Adapter, SlotTable
from jaxserve.lora.stacks import slot_stack_bytes


log = logging.getLogger("jaxserve.engine")

MAX_CONSECUTIVE_FAILURES = 3  # failed steps in a row after which the engine gives up


class EngineFailedError(RuntimeError):
    """The engine cannot serve any more (`Engine.failure` says why); restart the process."""


def _without_logprobs(pending):
    """A step's device results without the log-probability fields, which are not copied to
    the host when no request asked for them."""
    def drop(node):
        if isinstance(node, SampleResult):
            return dataclasses.replace(node, logprob=None, top_ids=None, top_logprobs=None)
        return node
    return jax.tree.map(drop, pending, is_leaf=lambda node: isinstance(node, SampleResult))


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


class Engine:
    """Serves many requests at once on one model."""

    def __init__(self, model: LlamaModel, config: EngineConfig, tokenizer: Tokenizer | None,
                 eos_token_ids: Iterable[int], progress: bool = True, load_seconds: float = 0.0,
                 draft: LlamaModel | None = None, device_bytes_limit: int | None = None):
        """`load_seconds`: how long reading `model`'s weights took (start-up's "load" phase
        begins there; placing and stacking them here counts too). `draft`: the draft model
        of `speculative_config` method "draft_model" (`jaxserve.speculative.draft`), or
        the head of "eagle3" (`jaxserve.speculative.eagle3`). `device_bytes_limit`: the
        device memory `gpu_memory_utilization` is a share of (default: the allocator's
        `bytes_limit`; CPUs have none, so tests on CPU give one)."""
        started = time.perf_counter()
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        if config.enable_lora and multihost.is_multiprocess():
            raise ValueError("enable_lora is not supported across several processes yet: the "
                             "followers would not receive the adapters' slot writes")
        enable_compilation_cache(config)
        self.executable_store = executable_store_for(config)
        self.mesh = engine_mesh(config)
        def placed(model: LlamaModel) -> LlamaModel:
            model = shard_model(model, self.mesh)
            if scan_layers_for(config, model.config):
                model = stack_layers(model)  # consumes the per-layer arrays
            return model

        model = placed(model)
        self.model = model
        self.model_config: ModelConfig = model.config  # as stored: kv heads maybe repeated
        if draft is not None:  # an EAGLE-3 head is small: every device holds all of it
            draft = placed(draft) if isinstance(draft, LlamaModel) else draft.on_mesh(self.mesh)
        dtype = page_dtype(config.kv_cache_dtype, model.compute_dtype)  # of the KV pages
        local = [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]
        lora_bytes = slot_stack_bytes(model.config, config.max_loras, config.max_lora_rank,
                                      sharding.replica_meshes(self.mesh)[0],
                                      model.compute_dtype) if config.enable_lora else 0
        # hybrid KV memory: the window layers' own pool (`window_pages`)
        self.window = window_layout(model.config, config)
        # with gpu_memory_utilization: the pool sized after compiling (`memory_budget`)
        self.memory_budget = None
        sized = pages_after_compiling(model, config, dtype, self.mesh, local[0],
                                      device_bytes_limit, draft, self.window, lora_bytes,
                                      self.executable_store)
        if sized is not None:
            pages, self.memory_budget = sized
            log.info("KV cache: %s: %d pages", self.memory_budget.arithmetic(), pages)
        else:
            pages = choose_num_pages(model.config, config, dtype, local[0],
                                     config.tensor_parallel_size,
                                     None if draft is None else draft.config,
                                     reserved_bytes=lora_bytes, window=self.window)
        self.num_pages = multihost.agree(pages)
        self.replicas: list[Replica] = []
        for sub_mesh in sharding.replica_meshes(self.mesh):
            allocator = PageAllocator(self.num_pages, config.page_size,
                                      config.enable_prefix_caching)
            windows = None if self.window is None else WindowPages(
                self.window, PageAllocator(self.window.num_pages, config.page_size,
                                           config.enable_prefix_caching))
            replica_model, replica_draft = model, draft
            if config.data_parallel_size > 1:
                replica_model = on_mesh(model, sub_mesh)
                replica_draft = None if draft is None else on_mesh(draft, sub_mesh)
            runner = Runner(replica_model, config, self.num_pages, sub_mesh,
                            executable_store=self.executable_store, draft=replica_draft,
                            window=self.window)
            runner.warm_up(progress, background=config.compile_in_background
                           and not multihost.is_multiprocess())
            slots = SlotTable(config.max_loras) if config.enable_lora else None
            self.replicas.append(Replica(allocator, Scheduler(config, allocator, slots, windows),
                                         runner))
            self._cap_steps(self.replicas[-1])
        self.runner = self.replicas[0].runner
        runners = [r.runner for r in self.replicas]
        compile_s = sum(r.warm_up_seconds for r in runners)
        warm_s = sum(r.first_runs_seconds for r in runners)
        # seconds of each start-up phase (`jaxserve:startup_seconds{phase}`)
        self.startup_seconds = {
            "load": load_seconds + time.perf_counter() - started - compile_s - warm_s,
            "compile": compile_s, "warmup": warm_s}
        log.info("start-up: load %.1f s, compile %.1f s (%d programs, %d read from the "
                 "executable cache), warm-up %.1f s", self.startup_seconds["load"], compile_s,
                 sum(r.num_programs for r in runners),
                 sum(r.programs_from_store for r in runners), warm_s)
        if self.warming:
            ready, total = self.programs_ready()
            log.info("serving on the smallest buckets' %d of %d programs; compiling the rest "
                     "in the background", ready, total)
        warn_near_mapping_limit()
        self.metrics = EngineMetrics()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._processors: dict[str, OutputProcessor] = {}
        self._owners: dict[str, Replica] = {}  # request id → the replica serving it
        self._seed_rng = np.random.default_rng(0)
        self._grammars = None  # GrammarCompiler, built at the first structured request
        # LoRA adapters by name (host memory); each replica's scheduler has their slots
        self.loras = AdapterRegistry(
            self.model_config, config.max_lora_rank, config.tensor_parallel_size,
            config.max_cpu_loras or config.max_loras) if config.enable_lora else None
        self._grammars_lock = threading.Lock()
        self._stopped = False
        self.failure: str | None = None  # why the engine gave up, for good
        if multihost.is_multiprocess() and multihost.is_leader():
            atexit.register(self.shutdown)  # followers must not outlive the leader

    # ---- requests -----------------------------------------------------------------------

    def reseed(self, seed: int) -> None:
        """Seed the draws that give each request without a seed of its own its seed (vLLM's
        `--seed`): the same seed and the same requests in the same order sample the same."""
        self._seed_rng = np.random.default_rng(seed)

    def make_sequence(self, request_id: str, prompt_token_ids: list[int],
                      params: SamplingParams, prompt: str | None = None,
                      cache_salt: str | None = None, lora: Adapter | None = None) -> Sequence:
        """Validate a request and build its sequence (raises `InvalidRequestError`).
        `cache_salt` (vLLM's field): the request shares prefix-cache pages only with requests
        of the same salt. `lora`: the adapter it is generated with (`load_lora`); its pages
        are shared only with requests of the same adapter (`Sequence.prefix_root`)."""
        if cache_salt is not None and not (isinstance(cache_salt, str) and cache_salt):
            raise InvalidRequestError("cache_salt", "cache_salt must be a non-empty string")
        if lora is not None:
            if self.loras is None:
                raise InvalidRequestError("lora_request", "this engine was started without "
                                          "enable_lora")
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise InvalidRequestError("prompt", "prompt has no tokens")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                "prompt", f"prompt_token_ids has ids outside [0, {vocab}): {bad[:5]}")
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise InvalidRequestError(
                "stop_token_ids", f"stop_token_ids has ids outside [0, {vocab}): {bad[:5]}")
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise InvalidRequestError("prompt", f"prompt has {len(ids)} tokens; max_model_len is "
                                      f"{limit} (prompt plus at least one new token)")
        # max_tokens 0 (prompt log-probabilities only): one token is sampled, never shown.
        wanted = limit if params.max_tokens is None else max(params.max_tokens, 1)
        max_new = min(wanted, limit - len(ids))
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(2**32))
        grammar = None
        if params.structured_outputs is not None:
            grammar = GrammarState.start(self.grammar_compiler().compile(
                params.structured_outputs), self.runner.mask_words)
            if grammar is None:
                raise InvalidRequestError("structured_outputs",
                                          "the grammar allows no first token")
        return Sequence(request_id=request_id, prompt_token_ids=ids, params=params, seed=seed,
                        max_new_tokens=max_new, stop_token_ids=frozenset(stops), prompt=prompt,
                        grammar=grammar, cache_salt=cache_salt, lora=lora)

    # ---- LoRA adapters --------------------------------------------------------------------
    def load_lora(self, request: LoRARequest) -> Adapter:
        """Read an adapter's folder into host memory (once per name; thread-safe). It reaches
        a device slot when a request using it is admitted."""
        return self._adapter_registry().add(request)

    def load_lora_folder(self, name: str, path: str, replace: bool = False) -> Adapter:
        """`load_lora` with an unused `lora_int_id` chosen here (the server's adapters have
        names; `AdapterRegistry.add_folder`)."""
        return self._adapter_registry().add_folder(name, path, replace)

    def _adapter_registry(self) -> AdapterRegistry:
        if self.loras is None:
            raise ValueError("this engine was started without enable_lora")
        return self.loras

    def unload_lora(self, name: str) -> bool:
        """Forget the adapter called `name` (thread-safe); requests already using it finish
        with it. False if no adapter has that name."""
        adapter = None if self.loras is None else self.loras.get(name)
        if adapter is not None:
            self.forget_lora(adapter)
        return adapter is not None

    def forget_lora(self, adapter: Adapter) -> None:
        """Forget this load of an adapter: its name, if it still names it, and the slots it
        holds once no sequence uses them."""
        self.loras.remove(adapter)
        self._inbox.put(("forget_lora", adapter))

    def lora_requests(self) -> tuple[list[str], list[str]]:
        """Names of the adapters running sequences use and of those only waiting sequences
        need (vLLM's `vllm:lora_requests_info`; safe from another thread)."""
        running, waiting = set(), set()
        for replica in self.replicas:
            table = replica.scheduler.lora_slots
            queued = [seq.lora for seq in list(replica.scheduler.waiting) if seq.lora]
            now, later = table.running_and_waiting(queued)
            running.update(now)
            waiting.update(later)
        return sorted(running), sorted(waiting - running)

    def _write_adapters(self, replica: Replica) -> None:
        """Write into the replica's slots the adapters its scheduler just gave them, and
        zeros into the slots of unloaded adapters nobody uses any more."""
        if replica.scheduler.lora_slots is not None:
            for slot, adapter in replica.scheduler.lora_slots.take_loads():
                replica.runner.load_lora(slot, None if adapter is None else adapter.weights)

    def grammar_compiler(self):
        """The compiler of structured-output grammars for this model's tokenizer (built on
        first use; grammars are compiled on the caller's thread, never the engine's, and
        cached per spec)."""
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise InvalidRequestError(
                        "structured_outputs", "structured output needs a tokenizer; this "
                        "model has none")
                from jaxserve.structured_output.compiler import GrammarCompiler

                self._grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                                 self.eos_token_ids)
            return self._grammars

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, prompt: str | None = None) -> Sequence:
        """Queue a request (thread-safe); it joins the batch at the next step."""
        seq = self.make_sequence(request_id, prompt_token_ids, params, prompt)
        self.enqueue(seq)
        return seq

    def enqueue(self, seq: Sequence) -> None:
        """Queue a sequence built by `make_sequence` (thread-safe)."""
        self._inbox.put(("add", seq))

    def abort(self, request_id: str) -> None:
        """Stop a request and free its pages at the next step (thread-safe)."""
        self._inbox.put(("abort", request_id))

    def has_unfinished(self) -> bool:
        return (any(r.scheduler.has_work() or r.in_flight is not None for r in self.replicas)
                or not self._inbox.empty())

    def _drain_inbox(self) -> list[StreamDelta]:
        deltas = []
        while not self._inbox.empty():
            kind, item = self._inbox.get()
            if kind == "add":
                replica = min(self.replicas, key=lambda r: r.load)
                self._processors[item.request_id] = OutputProcessor(item, self.tokenizer)
                self._owners[item.request_id] = replica
                replica.scheduler.add(item)
            elif kind == "forget_lora":
                for replica in self.replicas:
                    replica.scheduler.lora_slots.forget(item)
            elif item in self._owners:
                seq = self._owners[item].scheduler.abort(item)
                if seq is not None:
                    deltas.append(self._finish_as(seq, "abort"))
        return deltas

    # ---- stepping -----------------------------------------------------------------------
    @property
    def warming(self) -> bool:
        """Whether some bucket programs are still compiling in the background (steps are
        capped to the buckets whose programs are there)."""
        return any(r.runner.background is not None and not r.runner.background.done
                   for r in self.replicas)

    def programs_ready(self) -> tuple[int, int]:
        """(bucket programs taken in, bucket programs in all), over the replicas."""
        ready = total = 0
        for replica in self.replicas:
            background = replica.runner.background
            programs = replica.runner.num_programs
            ready += programs if background is None else background.ready
            total += programs if background is None else background.total
        return ready, total

    def adopt_programs(self) -> None:
        """Take in the programs compiled in the background since the last call and raise
        each replica's step caps to match (the engine's thread, between steps; `step` does
        it, and an idle server's loop calls it too)."""
        for replica in self.replicas:
            background = replica.runner.background
            if background is not None and not background.done and background.adopt():
                self._cap_steps(replica)
                if background.done:
                    self.startup_seconds["background_compile"] = background.seconds

    @staticmethod
    def _cap_steps(replica: Replica) -> None:
        """A replica's scheduler caps: what the programs taken in so far can run."""
        background = replica.runner.background
        if background is not None:
            tokens, rows = background.limits
            replica.scheduler.max_num_batched_tokens = tokens
            replica.scheduler.max_num_seqs = rows

    def step(self, max_decode_steps: int | None = None) -> list[StreamDelta]:
        """Dispatch every busy replica's next step, then read the step each dispatched before
        (so the host's work on one step's tokens overlaps the device's next step); return
        what each request gained. A decode loop is read at once (how many tokens it made
        decides the next step), and so is a step with penalty rows (their token counts need
        the tokens on the host). `max_decode_steps` caps a decode loop's length."""
        if self.failure is not None:
            raise EngineFailedError(self.failure)
        self.adopt_programs()
        deltas = self._drain_inbox()
        dispatched = []
        for replica in self.replicas:  # dispatch all before fetching any
            previous, replica.in_flight = replica.in_flight, None
            try:
                if previous is not None and previous.needs_host_tokens:
                    self._complete(replica, previous, deltas)
                    previous = None
                dispatched.append((replica, previous,
                                   self._dispatch(replica, max_decode_steps)))
            except Exception as err:  # noqa: BLE001 - fails that step's requests only
                self._recover(replica, err, deltas, previous)
        for replica, previous, flight in dispatched:
            try:
                if previous is not None:
                    self._complete(replica, previous, deltas)
                    previous = None
                if flight is not None and flight.placeholders is None:
                    self._complete(replica, flight, deltas)
                else:
                    replica.in_flight = flight
            except Exception as err:  # noqa: BLE001
                self._recover(replica, err, deltas, previous, flight)
        return deltas

    @property
    def has_in_flight(self) -> bool:
        """Whether a step `step()` dispatched is still unread (`read_in_flight` reads it)."""
        return any(replica.in_flight is not None for replica in self.replicas)

    def read_in_flight(self) -> list[StreamDelta]:
        """Read the steps `step()` left in flight now, rather than at the next `step()`: for
        an engine that gives its shared device to another engine's step next (the overlap
        of host and device then comes from the other engine)."""
        deltas: list[StreamDelta] = []
        for replica in self.replicas:
            flight, replica.in_flight = replica.in_flight, None
            if flight is None:
                continue
            try:
                self._complete(replica, flight, deltas)
            except Exception as err:  # noqa: BLE001 - fails that step's requests only
                self._recover(replica, err, deltas, flight)
        return deltas

    def _recover(self, replica: Replica, err: Exception, deltas: list[StreamDelta],
                 *flights: InFlight | None) -> None:
        """A step of `replica` raised: the requests of the steps it had under way (and the one
        it was scheduling) that have not had their final delta finish with reason "error"
        (appended to `deltas`) and free their pages; if the KV cache did not survive, it is
        rebuilt and the replica's other requests recompute. The engine gives up for good
        (`failure`, then `EngineFailedError` from every `step()`) after
        `MAX_CONSECUTIVE_FAILURES` failed steps in a row on one replica, when recovering
        fails, or at once on several processes (the followers cannot be brought back in
        step)."""
        log.error("engine step failed; failing its requests", exc_info=err)
        replica.consecutive_failures += 1
        replica.in_flight = None
        plans = [f.plan for f in flights if f is not None] + [replica.scheduling]
        replica.scheduling = None
        reason = None
        try:
            failed = {id(c.seq): c.seq for plan in plans if plan is not None
                      for c in plan.chunks if c.seq.request_id in self._owners}
            for seq in failed.values():
                if seq.status is not Status.FINISHED:
                    replica.scheduler.fail(seq)
                seq.finish_reason = "error"  # also one the step finished before it raised
                deltas.append(self._finish_as(seq, "error"))
            if not replica.runner.caches_usable():
                log.error("the KV cache was lost with the failed step; rebuilding it")
                replica.runner.reset_caches()
                replica.allocator.forget_all()
                if replica.scheduler.windows is not None:
                    replica.scheduler.windows.allocator.forget_all()
                replica.scheduler.restart_running()
        except Exception as during:  # noqa: BLE001 - recovery itself failed
            reason = f"could not recover from a failed step ({err!r}): {during!r}"
        if reason is None and multihost.is_multiprocess():
            reason = f"a step failed in a multi-host run: {err!r}"
        if reason is None and replica.consecutive_failures >= MAX_CONSECUTIVE_FAILURES:
            reason = f"{replica.consecutive_failures} steps failed in a row; last: {err!r}"
        if reason is not None:
            self.failure = reason
            raise EngineFailedError(reason) from err

    def _dispatch(self, replica: Replica, max_decode_steps: int | None) -> InFlight | None:
        """Schedule and launch a replica's next step (None if it has no work); a single step
        is booked at once (`Scheduler.advance`), a decode loop when it is read."""
        plan = replica.scheduler.schedule(max_decode_steps)
        if not plan.chunks:
            return None
        replica.scheduling = plan  # until it is in flight: whose requests fail if this raises
        self._write_adapters(replica)
        inp = build_step_input(plan, self.config, replica.runner.mask_words,
                               self.window is not None)
        started = time.monotonic()
        pending = self._launch(replica.runner, plan, inp)
        single = not plan.decode_only or (plan.num_decode_steps == 1 and not plan.speculative)
        placeholders = replica.scheduler.advance(plan) if single else None
        replica.scheduling = None
        return InFlight(plan, inp, pending, started, placeholders)

    def _complete(self, replica: Replica, flight: InFlight, deltas: list[StreamDelta]) -> None:
        """Read a dispatched step's results and book them; the requests' deltas go on
        `deltas` as they are made (a failure part-way keeps those already made)."""
        plan, rows = flight.plan, len(flight.plan.chunks)
        pending, prompt = flight.pending, None
        if not plan.decode_only:
            pending, prompt = pending  # SampleResult [S, ...], TargetLogprobs [T, ...]
            if all(c.seq.params.prompt_logprobs is None for c in plan.chunks):
                prompt = None  # not copied to the host
        if all(c.seq.params.logprobs is None for c in plan.chunks):
            pending = _without_logprobs(pending)
        result, prompt = jax.device_get((pending, prompt))
        if plan.decode_only:
            result, produced, *drafts = result  # [S, K, ...], [S] (, DraftCounts)
            if drafts:
                self._record_drafts(drafts[0], rows)
        else:
            result = jax.tree.map(lambda a: a[:, None], result)  # [S, 1, ...]
        if prompt is not None:
            self._book_prompt_logprobs(plan, flight.inp, prompt)
        if flight.placeholders is None:  # a decode loop
            produced = [int(n) for n in produced[:rows]]
            sampled = [result.tokens[i, :n].tolist() for i, n in enumerate(produced)]
            updates = replica.scheduler.postprocess(plan, sampled, produced)
        else:
            updates = replica.scheduler.complete(plan, result.tokens[:rows, 0].tolist(),
                                                 flight.placeholders)
        for update in updates:
            deltas.append(self._output(replica, update, result))
        replica.consecutive_failures = 0
        self.metrics.record_step(StepRecord(
            num_seqs=rows, num_tokens=plan.num_tokens,
            padded_tokens=int(flight.inp.token_ids.shape[0]),
            num_decode_steps=plan.num_decode_steps, kv_cache_usage=replica.allocator.usage,
            duration=time.monotonic() - flight.started))

    def _record_drafts(self, drafts, rows: int) -> None:
        """A speculative step's `DraftCounts` (numpy, per row) into the metrics."""
        self.metrics.record_drafts(int(drafts.num_drafts[:rows].sum()),
                                   int(drafts.num_draft_tokens[:rows].sum()),
                                   drafts.accepted_per_pos[:rows].sum(axis=0).tolist())

    def _book_prompt_logprobs(self, plan: SchedulerOutput, inp: StepInput,
                              prompt: TargetLogprobs) -> None:
        """Give each request that asked for prompt log-probabilities the entries its chunk
        computed: the token at flat index j (position p) scored prompt token p + 1."""
        for i, chunk in enumerate(plan.chunks):
            seq = chunk.seq
            top = seq.params.prompt_logprobs
            processor = self._processors.get(seq.request_id)
            if top is None or processor is None:
                continue
            start = int(inp.cu_q_lens[i])
            first = int(inp.positions[start])
            count = min(chunk.num_tokens, len(seq.prompt_token_ids) - 1 - first)
            if count <= 0:
                continue
            span = slice(start, start + count)
            entries = logprob_entries(inp.prompt_targets[span], prompt.logprob[span],
                                      prompt.top_ids[span], prompt.top_logprobs[span], top)
            processor.prompt_logprobs[first + 1:first + 1 + count] = entries

    def _output(self, replica: Replica, update: SequenceUpdate,
                result: SampleResult) -> StreamDelta:
        """Text and stream delta of one sequence's new tokens (fields of `result` `[S, K,
        ...]`); a stop string found in the text stops the sequence there."""
        seq = update.seq
        entries = None
        if seq.params.logprobs is not None:
            count, row = len(update.new_token_ids), update.row
            entries = logprob_entries(result.tokens[row, :count], result.logprob[row, :count],
                                      result.top_ids[row, :count],
                                      result.top_logprobs[row, :count], seq.params.logprobs)
        new_tokens = update.new_token_ids
        if seq.params.max_tokens == 0:  # prompt log-probabilities only: the token is unseen
            new_tokens, entries = [], None if entries is None else []
        delta, keep = self._processors[seq.request_id].process(
            new_tokens, update.finish_reason, entries)
        if keep is not None:
            replica.scheduler.stop_early(update, keep)
        if delta.finished:
            self._owners.pop(seq.request_id, None)
            self.metrics.record_finished(seq)
        return delta

    def expert_load(self) -> np.ndarray | None:
        """A mixture-of-experts model's expert load since start, summed over the replicas:
        `[L, X]` int64, the (token, expert) pairs each expert of each layer ran (None: a
        dense model, or nothing run yet)."""
        loads = [r.runner.expert_load() for r in self.replicas]
        loads = [load for load in loads if load is not None]
        return sum(loads) if loads else None

    def stats(self) -> EngineStats:
        """Queue lengths, cache usage and counters summed over the replicas (what the server's
        admission control and `/metrics` read)."""
        totals: dict[str, int] = collections.Counter()
        for replica in self.replicas:
            totals.update(replica.scheduler.stats())
            totals.update(replica.allocator.stats())
            totals["compiles_after_warmup"] += replica.runner.compiles_after_warmup
            totals["compiled_programs"] += replica.runner.num_programs
            totals["programs_from_store"] += replica.runner.programs_from_store
        totals["bucket_programs"] = self.programs_ready()[1]
        usage = sum(r.allocator.usage for r in self.replicas) / len(self.replicas)
        return EngineStats(kv_cache_usage=usage, **totals)

    def _launch(self, runner: Runner, plan: SchedulerOutput, inp: StepInput):
        """Dispatch the step's program (telling followers first in a multi-host run)."""
        decode = plan.decode_only
        if multihost.is_multiprocess():
            if self._stopped:
                raise RuntimeError("engine was shut down; followers have left")
            multihost.send_step(multihost.DECODE if decode else multihost.STEP, inp,
                                plan.num_decode_steps)
        if decode:
            return runner.launch_decode(inp, plan.num_decode_steps)
        return runner.launch_step(inp)

    # ---- multi-host ---------------------------------------------------------------------
    def run_follower(self) -> None:
        """On a process other than 0: run the leader's steps until its `shutdown()`."""
        if multihost.is_leader():
            raise ValueError("run_follower is for processes other than 0; process 0 serves")
        while True:
            kind, inp, num_steps = multihost.receive_step(self.runner.empty_input)
            if kind == multihost.STOP:
                return
            if kind == multihost.DECODE:
                self.runner.decode(inp, num_steps)
            else:
                self.runner.step(inp)

    def release(self) -> None:
        """Free every replica's device memory (weights and KV cache); for an engine that has
        no requests left and will not step again."""
        self.failure = self.failure or "released"
        for replica in self.replicas:
            replica.runner.release()

    def shutdown(self) -> None:
        """On process 0 of a multi-host run: release the followers (idempotent; also run at
        exit). A no-op for one process."""
        if multihost.is_multiprocess() and multihost.is_leader() and not self._stopped:
            self._stopped = True
            multihost.send_stop()

    def _finish_as(self, seq: Sequence, reason: str) -> StreamDelta:
        """The final delta of a request that ended outside a step ("abort", "error")."""
        self._owners.pop(seq.request_id, None)
        self.metrics.record_finished(seq)
        return self._processors[seq.request_id].delta([], reason)

    def pop_output(self, seq: Sequence) -> RequestOutput:
        """The final output of a finished request; forgets its text state."""
        processor = self._processors.pop(seq.request_id)
        tokens = [] if seq.params.max_tokens == 0 else list(seq.output_token_ids)
        completion = CompletionOutput(0, processor.text, tokens, seq.finish_reason,
                                      processor.logprobs)
        return RequestOutput(seq.request_id, seq.prompt, list(seq.prompt_token_ids),
                             [completion], finished=seq.status is Status.FINISHED,
                             prompt_logprobs=processor.prompt_logprobs)
