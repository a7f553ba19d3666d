"""Runs scheduled steps on device: one compiled program per bucket, compiled at warm-up.

The programs (traced in `jaxserve.engine.programs`; all take the weights' leaves, the donated
KV cache, the step's `StepInput` packed into one int32 buffer by `packing`, the token history,
the grammar bitmasks, and the previous step's sampled tokens):
- "step" (tokens T, sequences S): a forward over a flat ragged batch of prefill chunks and
  decode tokens, K/V written into the cache, one token sampled per sequence, and the
  log-probabilities of the prompt tokens that follow each position, for the requests that
  asked (`StepInput.prompt_targets`; skipped at run time otherwise).
- "decode" (S): every step whose chunks are all single decode tokens: up to
  `num_decode_steps` decode steps in a `lax.while_loop`, feeding each sampled token back,
  with stop tokens and per-row limits checked on device, so several tokens can come back per
  host round-trip. One token per row, never padded to a token bucket.
- "spec" (S), with `speculative_config`: the decode loop's speculative form, each step a
  round that proposes drafts, verifies them in one forward and keeps the accepted tokens
  (`jaxserve.engine.speculative_rounds`, the drafter behind `jaxserve.speculative.drafters`);
  decode steps of more rows than `disable_by_batch_size` run "decode".

Attention is the configured backend's (`jaxserve.attention.make_backend`, chosen once here):
the runner hands it each step's (and each decode-loop step's) `PagedBatch` and passes what it
returns to the model. The runner itself has no backend-specific code.

Programs are compiled ahead of time (`jit(...).lower(...).compile()`) and kept per bucket, so
a call can never recompile silently; with `strict_compile` a bucket missed at warm-up raises.
With an `ExecutableStore` a program is read back whole from disk when its key (computed
without tracing) is there, and stored after compiling when not; warm-up then runs each program
once on an all-padding batch, which also catches a stored program that cannot run.
This is the one place that calls `jax.jit` for the model step.

The KV cache has the model's layout: per-layer `(k_pages, v_pages)` for a list of layers, one
pool per stack of layers and per-layer pools for the rest with stacked layers (`scan_layers`,
`kv_cache.cache_structure`); with hybrid KV memory the window layers' pools hold the window
pool's pages (`window_pages`).
A model whose parameters are abstract (`jaxserve plan`) gets an abstract cache: its programs
can be compiled for a device that is not attached, never run.

Everything lives on a mesh (one replica's `(1, tp)` mesh; `(1, 1)` on one device): weights
as `jaxserve.loading.weights.shard_model` placed them, the cache split on kv heads, step
inputs and sampled results replicated, so every process of a multi-host run can feed the same inputs
and read the results. `launch_*` only dispatch (several replicas then run concurrently);
`step` / `decode` also fetch the results.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import os
import logging
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from tqdm.auto import tqdm

import sharding

from jaxserve.attention import make_backend
from jaxserve.engine.cache_audit import CacheAudit, PagePools, audit, check_programs_fit
from jaxserve.engine.background_compile import BackgroundCompiler, rungs
from jaxserve.engine.batcher import MAX_DEVICE_STOP_IDS, StepInput
from jaxserve.sampling.arrays import SamplingArrays
from jaxserve.config.engine import EngineConfig
from jaxserve.engine import weight_layouts
from jaxserve.engine.donation_guard import check_donated, placed_for, read_arrays
from jaxserve.engine.kv_cache import allocate_kv_cache, cache_structure
from jaxserve.engine.memory_figures import log_figures
from pallas_kernels.kv_quant import page_dtype
from jaxserve.engine.packing import Layout, pack, packed_shape
from jaxserve.engine.programs import DraftParts, Programs
from jaxserve.engine.executable_store import ExecutableStore, program_store_key
from jaxserve.engine.expert_load import ExpertLoad
from jaxserve.engine.program_cache import compile_shared, forget
from jaxserve.config.window import WindowLayout
from jaxserve.platforms import platform as platform_traits
from jaxserve.sampling.sampler import SampleResult, TargetLogprobs
from jaxserve.lora.adapter import LoRAAdapter
from jaxserve.lora.stacks import slot_stacks, write_slot
from jaxserve import fixed_order
from jaxserve.model import LlamaModel
from jaxserve.model.expert_placement import expert_mixture
from jaxserve.model.lora import LORA_MODULES
from jaxserve.speculative import eagle3

# The batcher builds step inputs in numpy; the programs take them as pytrees.
jax.tree_util.register_dataclass(StepInput)

log = logging.getLogger(__name__)


class CompileAfterWarmupError(RuntimeError):
    """A program was needed that warm-up did not compile, and `strict_compile` is on."""


class Runner:
    """Holds the weights, the KV cache and the compiled programs."""

    def __init__(self, model: LlamaModel, config: EngineConfig, num_pages: int, mesh: Mesh,
                 platform: str | None = None, executable_store: ExecutableStore | None = None,
                 draft: LlamaModel | None = None, window: WindowLayout | None = None):
        """`model` must already be placed on `mesh` (`jaxserve.loading.weights.shard_model`),
        or be abstract (parameters `jax.ShapeDtypeStruct`s with their shardings, as
        `jaxserve plan` builds it): then the KV cache is abstract too and the programs can
        only be compiled, not run. `platform`: where the programs run (default: JAX's
        default backend; `jaxserve plan` names its target's). `draft`: the draft model of
        `speculative_config` method "draft_model", placed like `model`; its KV cache is a
        pool of its own with the same page ids, and `caches` is then (target's, draft's).
        `window`: hybrid KV memory's window pool for the target's window layers
        (`jaxserve.engine.window_pages`); every step then carries their page tables too."""
        self.config = config
        self.model_config = model.config
        self.mesh = mesh
        self.platform = platform or jax.default_backend()
        self.graphdef, self.state = nnx.split(model)
        # The programs take the weights as a flat list: flattening nnx variables per call
        # would cost the host more than the rest of a small step's dispatch.
        self._state_leaves, self._state_def = jax.tree.flatten(self.state)
        self._num_model_leaves = len(self._state_leaves)
        self.draft_config = draft.config if draft is not None else None
        self.eagle = isinstance(draft, eagle3.Eagle3Head)  # drafts from the target's states
        spec = config.speculative_config
        self.spec_width = 0 if spec is None else spec.num_speculative_tokens + 1
        if draft is not None:  # its leaves follow the target's in the same flat list
            self.draft_graphdef, draft_state = nnx.split(draft)
            draft_leaves, self._draft_def = jax.tree.flatten(draft_state)
            self._state_leaves = self._state_leaves + draft_leaves
        abstract = isinstance(model.embed.get_value(), jax.ShapeDtypeStruct)  # compile only
        self._num_lora_leaves = 0
        if config.enable_lora:  # the adapter slots' stacks end the flat list
            if model.config.moe is not None:
                raise ValueError("enable_lora is not supported for mixture-of-experts models")
            lora_leaves, self._lora_def = jax.tree.flatten(slot_stacks(
                model.config, config.max_loras, config.max_lora_rank, mesh,
                model.compute_dtype, abstract))
            self._state_leaves = self._state_leaves + lora_leaves
            self._num_lora_leaves = len(lora_leaves)
            self._write_lora = jax.jit(write_slot, donate_argnums=0,
                                       out_shardings=[a.sharding for a in lora_leaves])
        cache_dtype = page_dtype(config.kv_cache_dtype, model.compute_dtype)
        self.num_pages = num_pages
        self.window = window
        self.attention = make_backend(config, model.config, mesh, num_pages, model.scan_layers,
                                      platform, window)
        models = [model] if draft is None else [model, draft]
        if draft is not None:
            self.draft_attention = make_backend(config, draft.config, mesh, num_pages,
                                                draft.scan_layers, platform)
        # an EAGLE head's cache is its pool and what each row left it to read (`State`)
        head_state = None if not self.eagle else functools.partial(
            eagle3.State.zeros, max(config.seq_buckets), self.spec_width,
            draft.config.hidden_size, draft.compute_dtype, sharding.replicated(mesh), abstract)
        windows = [window, None]  # the target's; a draft's pool follows the full-context ids
        if abstract:
            pools = [cache_structure(m.config, num_pages, config.page_size, cache_dtype,
                                     m.scan_layers, mesh, platform, w)
                     for m, w in zip(models, windows)]
            self.caches = (pools[0] if draft is None else
                           (pools[0], (pools[1], head_state())) if self.eagle else
                           tuple(pools))
        else:
            allocators = [functools.partial(
                allocate_kv_cache, m.config, num_pages, config.page_size, cache_dtype, mesh,
                m.scan_layers, config.calculate_kv_scales, platform, w)
                for m, w in zip(models, windows)]
            self._allocate_caches = (
                allocators[0] if draft is None else
                (lambda: (allocators[0](), (allocators[1](), head_state()))) if self.eagle else
                (lambda: tuple(allocate() for allocate in allocators)))
            self.caches = self._allocate_caches()
        self.replicated = sharding.replicated(mesh)
        caches_sh = jax.tree.map(lambda leaf: leaf.sharding, self.caches)
        rep = self.replicated
        # [max rows] each row's newest sampled token, on device: the next step's PENDING
        # tokens are read from here (`StepInput.token_source`) before the host has them.
        self.max_rows = max(config.seq_buckets)
        traced = Programs(
            config, model.config, self.attention, self.graphdef, self._state_def,
            self._num_model_leaves, self.max_rows,
            expert_mixture(mesh, pallas_kernels=self.attention.name == "pallas"),
            None if draft is None else DraftParts(self.draft_graphdef, self._draft_def,
                                                  self.draft_attention),
            self._lora_def if self._num_lora_leaves else None, self._num_lora_leaves)
        # mixture-of-experts models: every program also returns its expert load [L, X]
        self.counts_experts = traced.counts_experts
        load = (rep,) if self.counts_experts else ()
        self._programs = {"step": (traced.step, (rep, rep, *load, caches_sh, rep)),
                          "decode": (traced.decode, (rep, rep, *load, caches_sh, rep)),
                          "spec": (traced.spec, (rep, rep, rep, *load, caches_sh, rep))}
        self._expert_load = ExpertLoad()
        self.last_tokens = jax.ShapeDtypeStruct((self.max_rows,), jnp.int32, sharding=rep)
        if not abstract:
            self.last_tokens = self._place(np.zeros(self.max_rows, np.int32))
        self.executable_store = executable_store
        self._compiled: dict[tuple, jax.stages.Compiled] = {}
        self._program_keys: dict[tuple, str] = {}  # bucket → its key in the store
        self._from_store: set[tuple] = set()  # buckets whose program was read from the store
        self._layouts: dict[tuple, Layout] = {}
        self._weight_layouts: list | None = None  # chosen at the first compile
        self._weight_layouts_lock = threading.Lock()
        self._no_history: dict[int, jax.Array] = {}  # rows → [rows, max_model_len] of -1
        self.mask_words = -(-model.config.vocab_size // 32)  # int32 words of a token bitmask
        self._all_allowed: dict[int, jax.Array] = {}  # rows → [rows, mask_words] of -1
        self.warmed_up = False
        self.warm_up_seconds = 0.0  # compiling or loading every program
        self.first_runs_seconds = 0.0  # running each once
        self.compiles_after_warmup = 0
        self.background: BackgroundCompiler | None = None  # programs still compiling
        # XLA options of the quick first programs a background warm-up replaces (CPU: -O0)
        self.quick_compile_options = dict(
            platform_traits(next(iter(mesh.devices.flat)).platform).quick_compile_options)

    def load_lora(self, slot: int, weights: LoRAAdapter | None) -> list[jax.Array]:
        """Write an adapter's stacks (None: zeros) into `slot`: one compiled program for any
        slot and adapter, updating the stacks in place; returns the stacks written (to wait
        on them)."""
        count = self._num_lora_leaves
        current = self._state_leaves[-count:]
        if weights is None:
            new = [np.zeros(a.shape[:1] + a.shape[2:], np.float32) for a in current]
        else:
            new = jax.tree.leaves({m: weights.stacks[m] for m in LORA_MODULES})
        written = list(self._write_lora(current, np.int32(slot), new))
        self._state_leaves = self._state_leaves[:-count] + written
        return written

    def expert_load(self) -> np.ndarray | None:
        """`[L, X]` int64: the (token, expert) pairs each expert of each layer has run since
        the engine started, padding not counted (None: a dense model)."""
        return self._expert_load.total() if self.counts_experts else None

    # ---- compilation --------------------------------------------------------------------
    def _input_shapes(self, tokens: int, rows: int) -> StepInput:
        sh = self.replicated
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sh)  # noqa: E731
        f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sh)  # noqa: E731
        flag = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bool_, sharding=sh)  # noqa: E731
        return StepInput(
            token_ids=i32(tokens), token_source=i32(tokens), positions=i32(tokens),
            slot_mapping=i32(tokens),
            kv_lens=i32(rows), page_indices=i32(rows, self.config.pages_per_seq),
            cu_q_lens=i32(rows + 1), num_seqs=i32(1), logits_indices=i32(rows),
            sampling=SamplingArrays(temperature=f32(rows), top_k=i32(rows), top_p=f32(rows),
                                    min_p=f32(rows),
                                    seed=jax.ShapeDtypeStruct((rows,), jnp.uint32,
                                                              sharding=sh),
                                    presence=f32(rows), frequency=f32(rows),
                                    repetition=f32(rows),
                                    wants_logprobs=flag(rows), constrained=flag(rows)),
            max_new=i32(rows), stop_ids=i32(rows, MAX_DEVICE_STOP_IDS),
            history=i32(rows, self.config.max_model_len), prompt_lens=i32(rows),
            prompt_targets=i32(tokens), lora_slots=i32(tokens),
            allowed=i32(rows, self.mask_words),
            window_slot_mapping=None if self.window is None else i32(tokens),
            window_page_indices=(None if self.window is None else
                                 i32(rows, self.config.pages_per_seq)))

    def _layout(self, kind: str, tokens: int, rows: int) -> Layout:
        """How a bucket's inputs are packed: the `StepInput` without its history and
        bitmasks, and for "decode" the number of steps."""
        key = (kind, tokens, rows)
        if key not in self._layouts:
            inputs = dataclasses.replace(self._input_shapes(tokens, rows), history=None,
                                         allowed=None)
            scalars = () if kind == "step" else (jax.ShapeDtypeStruct((), jnp.int32),)
            self._layouts[key] = Layout.of((inputs, *scalars))
        return self._layouts[key]

    def program_inputs(self, kind: str, tokens: int, rows: int) -> tuple[jax.stages.Wrapped,
                                                                           list]:
        """The jitted function of a program and its abstract arguments (what `lower` takes):
        the weights' leaves (in `weight_layouts`), the KV cache (donated), the packed inputs,
        the token history, the grammar bitmasks and the previous step's sampled tokens."""
        function, out_shardings = self._programs[kind]
        if self.config.enable_deterministic_inference:
            function = fixed_order.traced_with_row_tiles(function)
        jitted = jax.jit(functools.partial(function, self._layout(kind, tokens, rows)),
                         donate_argnums=(1,), out_shardings=out_shardings)
        args = self._arguments(kind, tokens, rows)
        args[0] = weight_layouts.pinned(args[0], self.weight_layouts())
        return jitted, args

    def _arguments(self, kind: str, tokens: int, rows: int) -> list:
        """A program's arguments as the runner holds them (see `program_inputs`)."""
        shapes = self._input_shapes(tokens, rows)
        return [self._state_leaves, self.caches,
                packed_shape(self._layout(kind, tokens, rows), self.replicated),
                shapes.history, shapes.allowed, self.last_tokens]

    def weight_layouts(self) -> list:
        """Per leaf of the model's weights, the layout every program takes it in (None: the
        platform's default). On TPU XLA chooses them for the smallest decode loop, once
        (`jaxserve.engine.weight_layouts`); elsewhere none are pinned. A probe that does not
        compile pins none: the programs' own compiles then say why."""
        with self._weight_layouts_lock:  # warm-up compiles from several threads
            if self._weight_layouts is None:
                self._weight_layouts = self._probe_weight_layouts()
        return self._weight_layouts

    def _probe_weight_layouts(self) -> list:
        """`weight_layouts`, chosen: the probe compile on TPU, none elsewhere."""
        if self.platform not in weight_layouts.PINNED_PLATFORMS:
            return []
        kind, tokens, rows = min((b for b in self.bucket_programs() if b[0] != "step"),
                                 key=lambda b: b[2])
        function, out_shardings = self._programs[kind]
        args = self._arguments(kind, tokens, rows)
        key = None
        if self.executable_store is not None:  # a warm restart reads the probe's result
            description = {**self._shape_description(kind, tokens, rows, args),
                           "probe": "weight_layouts"}
            key = program_store_key(description, list(self.mesh.devices.flat))
            kept = self.executable_store.load_record(key)
            if kept is not None:
                try:
                    return weight_layouts.layouts_from_json(kept)
                except ValueError as err:
                    log.warning("probing the weight layouts again: the kept ones are "
                                "unusable (%s)", err)
        try:
            layouts = weight_layouts.chosen_layouts(
                functools.partial(function, self._layout(kind, tokens, rows)), out_shardings,
                args, self._num_model_leaves, self.platform)
        except Exception as err:  # noqa: BLE001 - reported by the programs' compiles
            log.warning("weights keep the default layouts: the layout probe (%s, %d rows) did "
                        "not compile: %s", kind, rows, str(err).splitlines()[0][:300])
            return []
        if key is not None:
            self.executable_store.save_record(key, weight_layouts.layouts_to_json(layouts))
        return layouts

    def program_description(self, kind: str, tokens: int, rows: int, args) -> dict:
        """What shapes a bucket's program, known without tracing it (with the devices and
        the environment, `executable_store.program_store_key` makes it a key)."""
        return {**self._shape_description(kind, tokens, rows, args),
                "weight_layouts": [str(layout) for layout in self.weight_layouts()]}

    def _shape_description(self, kind: str, tokens: int, rows: int, args) -> dict:
        """`program_description` but the weights' pinned layouts (which the probe keyed by
        this description chooses)."""
        cfg = self.config
        spec = None
        if kind == "spec":  # the draft's path does not shape a program; its config does
            spec = {k: v for k, v in cfg.speculative_config.as_dict().items() if k != "model"}
        draft = None if self.draft_config is None else (repr(self.draft_config),
                                                        str(self._draft_def))
        return {"program": (kind, tokens, rows), "model": repr(self.model_config),
                "draft": draft,
                "options": {"max_model_len": cfg.max_model_len, "page_size": cfg.page_size,
                            "num_decode_steps": cfg.num_decode_steps, "speculative": spec,
                            "deterministic": cfg.enable_deterministic_inference},
                "attention": type(self.attention).__name__, "state": str(self._state_def),
                "window_layers": self.attention.window_layers,
                "arguments": [(a.shape, str(a.dtype), str(a.sharding))
                              for a in jax.tree.leaves(args)]}

    def program(self, kind: str, tokens: int, rows: int) -> jax.stages.Compiled:
        """The compiled program of a bucket, compiling it if warm-up did not (counted; with
        `strict_compile` a `CompileAfterWarmupError`). While programs still compile in the
        background, a bucket not yet taken in is always a `CompileAfterWarmupError`: the
        scheduler's caps keep steps off it, and a request must never wait on a compile."""
        bucket = (kind, tokens, rows)
        if bucket not in self._compiled:
            if self.background is not None and not self.background.done:
                raise CompileAfterWarmupError(
                    f"program {bucket} is still compiling in the background")
            if self.warmed_up:
                if self.config.strict_compile:
                    raise CompileAfterWarmupError(
                        f"program {bucket} was not compiled at warm-up (strict_compile=True)")
                self.compiles_after_warmup += 1
            self._keep(bucket, self.build_program(kind, tokens, rows))
        return self._compiled[bucket]

    def build_program(self, kind: str, tokens: int, rows: int, shared_args: list | None = None,
                      quick: bool = False) -> tuple[jax.stages.Compiled, str, bool]:
        """(a bucket's program, its store key, whether it was read from the store), compiled
        or read but not kept (`program` keeps it). `shared_args`: abstract weights, cache
        and last tokens to lower against instead of the live arrays (`abstract_shared_args`:
        a thread compiling beside the serving one must not touch arrays a step donates).
        `quick`: with the platform's `quick_compile_options` (a program of its own key)."""
        jitted, args = self.program_inputs(kind, tokens, rows)
        if shared_args is not None:
            args[:2], args[-1] = shared_args[:2], shared_args[2]
        devices = list(self.mesh.devices.flat)
        options = dict(self.quick_compile_options) if quick else None
        description = self.program_description(kind, tokens, rows, args)
        if options:
            description["compiler_options"] = sorted(options.items())
        key = program_store_key(description, devices)
        stored = []

        def build() -> jax.stages.Compiled:
            if self.executable_store is None:
                return jitted.lower(*args).compile(options)
            compiled, from_store = self.executable_store.load_or_compile(
                key, lambda: jitted.lower(*args), jax.tree.structure((tuple(args), {})),
                devices, options)
            stored.append(from_store)
            return compiled

        compiled = compile_shared(key, build)
        return compiled, key, any(stored)

    def abstract_shared_args(self) -> list:
        """[weights, KV cache, last tokens] as shapes, dtypes and shardings (`build_program`)."""
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                            [self._state_leaves, self.caches, self.last_tokens])

    def _keep(self, bucket: tuple, built: tuple[jax.stages.Compiled, str, bool]) -> None:
        compiled, key, from_store = built
        self._compiled[bucket] = compiled
        self._program_keys[bucket] = key
        if from_store:
            self._from_store.add(bucket)
        else:  # a full program replacing a quick one read from the store
            self._from_store.discard(bucket)

    def adopt_program(self, bucket: tuple, built: tuple[jax.stages.Compiled, str, bool]
                      ) -> None:
        """Take in a program compiled in the background (`build_program`) between steps: keep
        it and run it once on padding, as warm-up does. The padding run writes only the
        padding page; the last sampled tokens a step in flight left are kept."""
        self._keep(bucket, built)
        self.check_device_memory()
        last_tokens = self.last_tokens
        self._first_run_or_rebuild(bucket)
        self.last_tokens = last_tokens

    def in_store(self, kind: str, tokens: int, rows: int) -> bool:
        """Whether the executable store holds this bucket's program (read, not compiled)."""
        if self.executable_store is None:
            return False
        _, args = self.program_inputs(kind, tokens, rows)
        key = program_store_key(self.program_description(kind, tokens, rows, args),
                                list(self.mesh.devices.flat))
        return self.executable_store.path(key).is_file()

    def _cache_bytes_per_device(self) -> int:
        return sum(math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
                   for leaf in jax.tree.leaves(self.caches))

    def page_pools(self) -> PagePools:
        """The KV cache's pools on one device, the target's stacks with their layers."""
        target = self.caches if self.draft_config is None else self.caches[0]
        others = [] if self.draft_config is None else [(self.caches[1], 1)]
        if self.attention.pages_per_layer is None:
            return PagePools.of((target, 1), *others)
        stacks, tail = target
        return PagePools.of((stacks, self.model_config.scan_groups), (tail, 1), *others)

    def cache_audits(self) -> dict[tuple[str, int, int], CacheAudit]:
        """`cache_audit.audit` of every program compiled so far, by bucket: whether each
        updates the KV cache in place and touches no whole page pool beyond its write."""
        pools = self.page_pools()
        cache_bytes = self._cache_bytes_per_device()
        return {bucket: audit(compiled, pools, cache_bytes)
                for bucket, compiled in self._compiled.items()}

    def check_device_memory(self) -> None:
        """Fail at start-up, naming the programs and why, when a compiled program would run
        out of device memory at its first run rather than at some request's
        (`cache_audit.check_programs_fit`; only where the allocator reports its limit)."""
        check_programs_fit(self._compiled, self._cache_bytes_per_device(),
                           self._local_device())

    def _local_device(self) -> jax.Device:
        """The mesh's first device of this process (the one memory is reported for)."""
        return next(d for d in self.mesh.devices.flat if d.process_index == jax.process_index())

    @property
    def programs_from_store(self) -> int:
        """Programs this runner read whole from the executable store."""
        return len(self._from_store)

    @property
    def num_programs(self) -> int:
        """Bucket programs compiled so far."""
        return len(self._compiled)

    def bucket_programs(self) -> list[tuple[str, int, int]]:
        """Every program the bucket ladders can ask for."""
        cfg = self.config
        keys = [("step", t, s) for t in cfg.token_buckets for s in cfg.seq_buckets if s <= t]
        return keys + [(kind, s, s) for kind, s in cfg.decode_programs()]

    def warm_up(self, progress: bool = True, background: bool = False) -> None:
        """Compile every bucket's program (or read it from the executable store / JAX's
        persistent cache), then run each once (`first_runs`). `warm_up_seconds` and
        `first_runs_seconds` say how long each part took. `background`: only the smallest
        rung's programs now; the rest compile on a thread (`self.background`,
        `jaxserve.engine.background_compile`) and the engine takes them in between steps."""
        started = time.perf_counter()
        buckets = self.bucket_programs()
        ladder = rungs(self.config, buckets) if background else []
        quick: list[tuple] = []  # compiled quick now, replaced in the background
        if len(ladder) > 1:
            buckets = list(ladder[0].buckets)
            if self.quick_compile_options:
                quick = [bucket for bucket in buckets if not self.in_store(*bucket)]
        stored = sum(self.in_store(*bucket) for bucket in buckets) if progress else 0

        def build(bucket: tuple) -> None:
            if bucket in quick:
                self._keep(bucket, self.build_program(*bucket, quick=True))
            else:
                self.program(*bucket)

        # Loading and compiling release the GIL: a few at once use the host's cores.
        with concurrent.futures.ThreadPoolExecutor(min(4, os.cpu_count() or 1)) as pool:
            loads = [pool.submit(build, bucket) for bucket in buckets]
            for load in tqdm(concurrent.futures.as_completed(loads), total=len(loads),
                             desc=warm_up_label(len(buckets), stored), unit="program",
                             disable=not progress):
                load.result()
        self.warmed_up = True
        self.warm_up_seconds = time.perf_counter() - started
        if not isinstance(self.last_tokens, jax.ShapeDtypeStruct):  # abstract: compile only
            device = self._local_device()
            log_figures("before the first runs", device, self._state_leaves, self.caches,
                        {f"{kind} ({tokens} tokens, {rows} rows)": compiled for
                         (kind, tokens, rows), compiled in sorted(self._compiled.items())})
            self.check_device_memory()
            started = time.perf_counter()
            if self._num_lora_leaves:
                self.load_lora(0, None)  # compiles the slot write (slots start as zeros)
            self.first_runs()
            self.first_runs_seconds = time.perf_counter() - started
            log_figures("after the first runs", device, self._state_leaves, self.caches)
        if len(ladder) > 1:
            self.background = BackgroundCompiler(self, ladder, self.abstract_shared_args(),
                                                 quick)
            self.background.start()

    def first_runs(self) -> None:
        """Run every compiled program once on an all-padding batch (it writes only the
        padding page 0), so a request never pays a program's first-run costs, weights or a
        cache placed otherwise than a program expects stop start-up, and a program read from
        the store that cannot run or does not update the cache in place (a bad entry) is
        dropped and compiled again (`donation_guard`)."""
        self._state_leaves, self.caches = placed_for(self._compiled, self._state_leaves,
                                                     self.caches)
        for bucket in list(self._compiled):
            self._first_run_or_rebuild(bucket)

    def _first_run_or_rebuild(self, bucket: tuple) -> None:
        """`_first_run`; a program read from the store that fails it is rejected, compiled
        again and run (any other failure is raised)."""
        try:
            self._first_run(*bucket)
        except Exception as err:  # noqa: BLE001 - only a stored program is retried
            if bucket not in self._from_store:
                raise
            self.executable_store.reject(self._program_keys[bucket],
                                         f"its first run failed: {err}")
            self._from_store.discard(bucket)
            forget(self._program_keys.pop(bucket))
            del self._compiled[bucket]
            if not self.caches_usable():
                self.reset_caches()
            self._keep(bucket, self.build_program(*bucket))  # not a compile after warm-up
            self._first_run(*bucket)

    def _first_run(self, kind: str, tokens: int, rows: int) -> None:
        """`_run_padding`, checking that it updated the cache in place (`donation_guard`)."""
        check_donated(f"{kind} ({tokens} tokens, {rows} rows)",
                      lambda: self._run_padding(kind, tokens, rows), "caches", self.caches,
                      read_arrays(self.program(kind, tokens, rows), 1))

    def _run_padding(self, kind: str, tokens: int, rows: int) -> None:
        """One run of a program on zero inputs: no sequences, every token on page 0."""
        inp = self.empty_input(tokens, rows)
        if kind == "step":
            outputs = self._launch(kind, inp)
        else:
            outputs = self._launch(kind, inp, np.int32(1))
        jax.block_until_ready((outputs, self.caches, self.last_tokens))

    # ---- after a failed step -------------------------------------------------------------
    def caches_usable(self) -> bool:
        """Whether the KV cache and the last sampled tokens survived a failed step (a program
        that failed on device leaves its donated inputs deleted or its outputs poisoned)."""
        arrays = jax.tree.leaves((self.caches, self.last_tokens))
        try:
            jax.block_until_ready(arrays)
        except Exception:  # noqa: BLE001 - any failure to materialize means lost
            return False
        return not any(a.is_deleted() for a in arrays)

    def reset_caches(self) -> None:
        """A fresh, zeroed KV cache and last-token buffer (every cached token is lost)."""
        self._state_leaves, self.caches = placed_for(self._compiled, self._state_leaves,
                                                     self._allocate_caches())
        self.last_tokens = self._place(np.zeros(self.max_rows, np.int32))

    def release(self) -> None:
        """Delete the device buffers this runner holds (weights, KV cache, kept inputs), so
        their memory returns now rather than at some later garbage collection; the runner
        cannot run afterwards. For an engine removed from a running server."""
        held = (self._state_leaves, self.caches, self.last_tokens, self._no_history,
                self._all_allowed)
        for array in jax.tree.leaves(held):
            if isinstance(array, jax.Array) and not array.is_deleted():
                array.delete()

    # ---- running ------------------------------------------------------------------------
    def empty_input(self, tokens: int, rows: int) -> StepInput:
        """A zero `StepInput` of a bucket's shape (what a multi-host follower receives into)."""
        return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype),
                            self._input_shapes(tokens, rows))

    def _place(self, tree):
        """Host numpy → arrays replicated on the mesh; every process passes the same values
        and builds only its own devices' copies."""
        if jax.process_count() == 1:
            return jax.device_put(tree, self.replicated)
        return jax.tree.map(lambda a: jax.make_array_from_callback(
            a.shape, self.replicated, lambda index: a[index]), tree)

    def _step_buffer(self, packed: np.ndarray):
        """The packed inputs as the program takes them: on one process the host array
        itself (the compiled call copies it to the devices in one C++ call, cheaper than a
        `device_put`), else replicated from every process's copy."""
        return packed if jax.process_count() == 1 else self._place(packed)

    def _seldom_used(self, array: np.ndarray, used: bool, kept: dict[int, jax.Array]
                     ) -> jax.Array:
        """An input most steps leave at its default (the token history without penalty rows,
        the bitmasks without constrained rows): copied to the device when `used`, else the
        default array of its row count, placed once and kept in `kept`."""
        if used:
            return self._place(array)
        rows = array.shape[0]
        if rows not in kept:
            kept[rows] = self._place(array)
        return kept[rows]

    def _launch(self, kind: str, inp: StepInput, *scalars):
        tokens, rows = inp.token_ids.shape[0], inp.kv_lens.shape[0]
        program = self.program(kind, tokens, rows)
        packed = pack((dataclasses.replace(inp, history=None, allowed=None), *scalars),
                      self._layout(kind, tokens, rows))
        *outputs, self.caches, self.last_tokens = program(
            self._state_leaves, self.caches, self._step_buffer(packed),
            self._seldom_used(inp.history, inp.has_penalties or kind == "spec",
                              self._no_history),
            self._seldom_used(inp.allowed, inp.is_constrained, self._all_allowed),
            self.last_tokens)
        if self.counts_experts:
            *outputs, load = outputs
            self._expert_load.add(load)
        return outputs

    def launch_step(self, inp: StepInput) -> tuple[SampleResult, TargetLogprobs]:
        """Dispatch one forward; returns device arrays: the samples (fields `[S, ...]`) and
        the prompt log-probabilities (fields `[T, ...]`)."""
        result, prompt = self._launch("step", inp)
        return result, prompt

    def launch_decode(self, inp: StepInput, num_steps: int) -> tuple:
        """Dispatch up to `num_steps` decode steps (speculative rounds when the config
        speculates for this many rows); returns device arrays: samples (fields `[S, K,
        ...]`), how many each row produced `[S]`, and for rounds their `DraftCounts`."""
        kind = "spec" if self.config.speculates(int(inp.num_seqs[0])) else "decode"
        return tuple(self._launch(kind, inp, np.int32(num_steps)))

    def step(self, inp: StepInput) -> tuple[SampleResult, TargetLogprobs]:
        """One forward; returns what every row sampled (numpy, fields `[S, ...]`) and the
        prompt log-probabilities (fields `[T, ...]`)."""
        return jax.device_get(self.launch_step(inp))

    def decode(self, inp: StepInput, num_steps: int) -> tuple:
        """Up to `num_steps` decode steps; returns samples (fields `[S, K, ...]`), how many
        each row produced `[S]` (and for speculative rounds, their `DraftCounts`)."""
        return jax.device_get(self.launch_decode(inp, num_steps))


def warm_up_label(programs: int, stored: int) -> str:
    """What warm-up's progress bar says it does: compiling, reading from the store, or both."""
    if stored == programs:
        return f"Reading {programs} programs from the cache"
    if stored == 0:
        return f"Compiling {programs} programs"
    return f"Compiling {programs - stored} programs, reading {stored} from the cache"
