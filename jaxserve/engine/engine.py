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
import logging
import queue
import threading
import time
from typing import Iterable

import numpy as np

import sharding
from jaxserve.errors import InvalidRequestError
from jaxserve.engine import multihost
from jaxserve.engine.batcher import StepInput, build_step_input
from jaxserve.model.config import ModelConfig
from jaxserve.config.engine import EngineConfig
from pallas_kernels.kv_quant import page_dtype
from jaxserve.engine.metrics import EngineMetrics, EngineStats
from jaxserve.model import LlamaModel
from jaxserve.engine.output_processor import OutputProcessor, StreamDelta
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.engine.window_pages import window_layout
from jaxserve.engine.program_cache import warn_near_mapping_limit
from jaxserve.engine.engine_adapters import EngineAdapters
from jaxserve.engine.engine_setup import (cap_steps, enable_compilation_cache, engine_mesh,
                                          executable_store_for, kv_pool_pages, new_replica,
                                          placed_on_mesh)
from jaxserve.engine.step_results import EngineFailedError, StepResults
from jaxserve.engine.replica import InFlight, Replica
from jaxserve.engine.runner import Runner
from jaxserve.sampling_params import SamplingParams
from jaxserve.engine.scheduler import SchedulerOutput
from jaxserve.engine.sequence import GrammarState, Sequence, Status
from jaxserve.loading.tokenizer import Tokenizer
from jaxserve.lora.registry import AdapterRegistry
from jaxserve.lora.slots import Adapter
from jaxserve.lora.stacks import slot_stack_bytes


log = logging.getLogger("jaxserve.engine")



class Engine(EngineAdapters, StepResults):
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
        model = placed_on_mesh(model, config, self.mesh)
        self.model = model
        self.model_config: ModelConfig = model.config  # as stored: kv heads maybe repeated
        if draft is not None:  # an EAGLE-3 head is small: every device holds all of it
            draft = (placed_on_mesh(draft, config, self.mesh) if isinstance(draft, LlamaModel)
                     else draft.on_mesh(self.mesh))
        lora_bytes = slot_stack_bytes(model.config, config.max_loras, config.max_lora_rank,
                                      sharding.replica_meshes(self.mesh)[0],
                                      model.compute_dtype) if config.enable_lora else 0
        # hybrid KV memory: the window layers' own pool (`window_pages`)
        self.window = window_layout(model.config, config)
        # with gpu_memory_utilization: the pool sized after compiling (`memory_budget`)
        self.num_pages, self.memory_budget = kv_pool_pages(
            model, config, page_dtype(config.kv_cache_dtype, model.compute_dtype), self.mesh,
            device_bytes_limit, draft, self.window, lora_bytes, self.executable_store)
        self.replicas: list[Replica] = [
            new_replica(model, draft, config, self.num_pages, sub_mesh, self.window,
                        self.executable_store, progress)
            for sub_mesh in sharding.replica_meshes(self.mesh)]
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
                cap_steps(replica)
                if background.done:
                    self.startup_seconds["background_compile"] = background.seconds

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
