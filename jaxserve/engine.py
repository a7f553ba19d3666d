"""The serving engine: continuous batching over a paged KV cache.

Each `step()`: drain the inbox (new requests, aborts) → the scheduler picks this step's work
under the token budget → the batcher pads it to a bucket → the runner executes the compiled
program → sampled tokens come back in one host copy → stop checks, detokenization and page
bookkeeping → one `StreamDelta` per request that moved. `add_request` and `abort` are safe to
call from other threads (the server's); `step()` runs on one thread.
"""

from __future__ import annotations

import queue
import time
from typing import Iterable

import jax
import numpy as np

from jaxserve.batcher import build_step_input
from jaxserve.config import ModelConfig
from jaxserve.engine_config import EngineConfig
from jaxserve.kv_cache import choose_num_pages
from jaxserve.metrics import EngineMetrics, StepRecord
from jaxserve.model import LlamaModel
from jaxserve.output_processor import OutputProcessor, StreamDelta
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.page_allocator import PageAllocator
from jaxserve.runner import Runner
from jaxserve.sampler import SampleResult
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler import Scheduler, SchedulerOutput
from jaxserve.sequence import Sequence, Status
from jaxserve.tokenizer import Tokenizer


def enable_compilation_cache(config: EngineConfig) -> None:
    """Turn on JAX's persistent compilation cache (unless the user already chose a folder),
    so a restart loads the bucket programs instead of compiling them."""
    if jax.config.jax_compilation_cache_dir:
        return
    folder = config.resolved_cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def attention_backend_for(config: EngineConfig) -> str | None:
    """"auto": Pallas kernels on TPU/GPU, the jnp reference on CPU (interpret mode is slow)."""
    if config.attention_backend == "reference":
        return "reference"
    if config.attention_backend == "auto" and jax.default_backend() == "cpu":
        return "reference"
    return None  # the kernels pick their backend at lowering time


class Engine:
    """Serves many requests at once on one model."""

    def __init__(self, model: LlamaModel, config: EngineConfig, tokenizer: Tokenizer | None,
                 eos_token_ids: Iterable[int], progress: bool = True):
        self.config = config
        self.model_config: ModelConfig = model.config
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        enable_compilation_cache(config)
        dtype = model.embed[...].dtype
        self.num_pages = choose_num_pages(model.config, config, dtype)
        self.allocator = PageAllocator(self.num_pages, config.page_size,
                                       config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.allocator)
        self.runner = Runner(model, config, self.num_pages, attention_backend_for(config))
        self.runner.warm_up(progress)
        self.metrics = EngineMetrics()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._processors: dict[str, OutputProcessor] = {}
        self._seed_rng = np.random.default_rng(0)

    # ---- requests -----------------------------------------------------------------------
    def make_sequence(self, request_id: str, prompt_token_ids: list[int],
                      params: SamplingParams, prompt: str | None = None) -> Sequence:
        """Validate a request and build its sequence (raises `ValueError` naming the field)."""
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise ValueError("prompt has no tokens")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids has ids outside [0, {vocab}): {bad[:5]}")
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {limit} "
                             "(prompt plus at least one new token)")
        max_new = min(params.max_tokens or limit, limit - len(ids))
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(2**32))
        return Sequence(request_id=request_id, prompt_token_ids=ids, params=params, seed=seed,
                        max_new_tokens=max_new, stop_token_ids=frozenset(stops), prompt=prompt)

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
        return self.scheduler.has_work() or not self._inbox.empty()

    def _drain_inbox(self) -> list[StreamDelta]:
        deltas = []
        while not self._inbox.empty():
            kind, item = self._inbox.get()
            if kind == "add":
                self._processors[item.request_id] = OutputProcessor(item, self.tokenizer)
                self.scheduler.add(item)
            else:
                seq = self.scheduler.abort(item)
                if seq is not None:
                    deltas.append(self._finish(seq, [], time.monotonic()))
        return deltas

    # ---- stepping -----------------------------------------------------------------------
    def step(self) -> list[StreamDelta]:
        """Run one scheduled step (or one decode loop); return what each request gained."""
        deltas = self._drain_inbox()
        started = time.monotonic()
        plan = self.scheduler.schedule()
        if not plan.chunks:
            return deltas
        for chunk in plan.chunks:
            if chunk.seq.times.first_scheduled is None:
                chunk.seq.times.first_scheduled = started
        inp = build_step_input(plan, self.config)
        if plan.num_decode_steps > 1:
            result, produced = self.runner.decode(inp, plan.num_decode_steps)  # [S, K, ...]
            fed = [int(n) for n in produced[:len(plan.chunks)]]
            produced = fed
        else:
            result = jax.tree.map(lambda a: a[:, None], self.runner.step(inp))  # [S, 1, ...]
            fed = [c.num_tokens for c in plan.chunks]
            produced = [int(c.samples) for c in plan.chunks]
        now = time.monotonic()
        deltas += self._apply(plan, result, produced, fed, now)
        self.metrics.record_step(StepRecord(
            num_seqs=len(plan.chunks), num_tokens=plan.num_tokens,
            padded_tokens=int(inp.token_ids.shape[0]), num_decode_steps=plan.num_decode_steps,
            kv_cache_usage=self.allocator.usage, duration=now - started))
        return deltas

    def _apply(self, plan: SchedulerOutput, result: SampleResult, produced: list[int],
               fed: list[int], now: float) -> list[StreamDelta]:
        """Book-keep one step: computed tokens, new pages keyed, tokens through the stop
        checks. `result` fields are `[S, K, ...]`; row i produced `produced[i]` tokens."""
        deltas = []
        for i, chunk in enumerate(plan.chunks):
            seq = chunk.seq
            seq.num_computed_tokens += fed[i]
            self.allocator.register_full_pages(seq.token_ids, seq.pages, seq.page_hashes,
                                               seq.num_computed_tokens)
            if not produced[i]:
                continue
            processor = self._processors[seq.request_id]
            tokens = result.tokens[i, :produced[i]].tolist()
            kept, reason = processor.add_tokens(tokens)
            if seq.params.logprobs is not None:
                processor.add_logprobs(result, i, len(kept))
            seq.times.tokens_arrived(len(kept), now)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                deltas.append(self._finish(seq, kept, now))
            else:
                deltas.append(processor.delta(kept, finished=False))
        return deltas

    def _finish(self, seq: Sequence, kept: list[int], now: float) -> StreamDelta:
        seq.times.finished = now
        self.metrics.record_finished(seq)
        return self._processors[seq.request_id].delta(kept, finished=True)

    def pop_output(self, seq: Sequence) -> RequestOutput:
        """The final output of a finished request; forgets its text state."""
        processor = self._processors.pop(seq.request_id)
        completion = CompletionOutput(0, processor.text, list(seq.output_token_ids),
                                      seq.finish_reason, processor.logprobs)
        return RequestOutput(seq.request_id, seq.prompt, list(seq.prompt_token_ids),
                             [completion], finished=seq.status is Status.FINISHED)
