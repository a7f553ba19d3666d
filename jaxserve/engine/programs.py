"""The runner's traced programs: "step", "decode" and "spec" (the decode loop's speculative
form, `speculative_rounds`), and the loop both loops run.

`Programs` holds what tracing needs (the weights' tree definitions, the attention backend,
the options) and nothing that changes between calls; the runner (`jaxserve.engine.runner`)
keeps the weights, caches and compiled programs and launches them. Every program takes the
weights' flat leaves, the donated KV cache, the step's `StepInput` packed into one int32
buffer (`packing`), the token history, the grammar bitmasks and the previous step's sampled
tokens; it returns its results, then (mixture-of-experts models) the expert load `[L, X]`,
the cache and the next step's `last_tokens` `[max rows]`.

Speculation is behind one interface (`jaxserve.speculative.drafters`): a program asks its
drafter at fixed points and never branches on which drafter it has.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.attention import PagedBatch
from jaxserve.engine.batcher import StepInput
from jaxserve.config.engine import EngineConfig
from jaxserve.engine.device_loop import empty_samples, loop_until_done
from jaxserve.engine.packing import Layout, unpack
from jaxserve.sampling.sampler import TokenCounts, sample_with_logprobs, target_logprobs
from jaxserve.engine.speculative_rounds import speculative_rounds
from jaxserve.model.config import ModelConfig
from jaxserve.model.contract import ExpertMixture, StepContext
from jaxserve.model.lora import LoRABatch
from jaxserve.speculative.drafters import Drafter, make_drafter


@dataclasses.dataclass(frozen=True)
class DraftParts:
    """A draft model's or EAGLE head's part of the programs: its module's graph, the tree of
    its weights' leaves (which follow the target's in the flat list) and its attention."""

    graphdef: Any
    state_def: Any
    attention: Any


@dataclasses.dataclass(frozen=True)
class Programs:
    """The traced programs of one runner (see the module docstring)."""

    config: EngineConfig
    model_config: ModelConfig
    attention: Any  # the target's attention backend
    graphdef: Any  # the target model's graph
    state_def: Any  # the tree of the target's weights' leaves
    num_model_leaves: int
    max_rows: int  # rows of `last_tokens`
    experts: ExpertMixture | None = None  # how mixture-of-experts layers run their experts
    draft: DraftParts | None = None
    lora_def: Any = None  # the tree of the adapter slots' stacks, which end the flat list
    num_lora_leaves: int = 0

    @property
    def counts_experts(self) -> bool:
        """Mixture-of-experts models: every program also returns its expert load `[L, X]`."""
        return self.model_config.moe is not None

    # ---- what every program unpacks ----------------------------------------------------
    def _unpacked(self, layout: Layout, state_leaves, packed, history, allowed):
        """The model and the program's inputs (a tuple: the `StepInput`, then any scalars)
        from the flat arguments every program takes."""
        model = nnx.merge(self.graphdef, jax.tree.unflatten(
            self.state_def, state_leaves[:self.num_model_leaves]))
        inp, *rest = unpack(packed, layout)
        return model, dataclasses.replace(inp, history=history, allowed=allowed), *rest

    def _lora(self, state_leaves, token_slots) -> LoRABatch | None:
        """The adapters' slot stacks and each token's slot, or None without LoRA."""
        if not self.num_lora_leaves:
            return None
        stacks = jax.tree.unflatten(self.lora_def, state_leaves[-self.num_lora_leaves:])
        return LoRABatch.of(stacks, token_slots)

    def _context(self, batch: PagedBatch, attention=None, lora: LoRABatch | None = None
                 ) -> StepContext:
        """What a forward over `batch` gives the model: `attention`'s (default: the
        target's) for the batch, the experts, the batch's real tokens (mixture-of-experts
        models, which count the expert load), `lora`."""
        attention = self.attention if attention is None else attention
        real_tokens = batch.real_tokens if self.counts_experts else None  # [T] bool
        return StepContext(attention.for_step(batch), self.experts, real_tokens, lora)

    def _drafter(self, state_leaves) -> Drafter:
        """The drafter of `speculative_config`, its model merged from the flat weights."""
        draft = attention = None
        if self.draft is not None:
            end = len(state_leaves) - self.num_lora_leaves
            draft = nnx.merge(self.draft.graphdef, jax.tree.unflatten(
                self.draft.state_def, state_leaves[self.num_model_leaves:end]))
            attention = self.draft.attention
        cfg = self.config
        return make_drafter(cfg.speculative_config, cfg.max_model_len, cfg.page_size, draft,
                            attention, lambda batch: self._context(batch, attention))

    @staticmethod
    def _token_ids(inp: StepInput, last_tokens):
        """The step's tokens `[T]`, those still on device read from `last_tokens`."""
        source = inp.token_source  # [T]
        return jnp.where(source >= 0, last_tokens[jnp.maximum(source, 0)], inp.token_ids)

    def _padded(self, tokens):
        """`[S]` tokens as the `[max rows]` `last_tokens` of the next step."""
        return jnp.zeros((self.max_rows,), jnp.int32).at[:tokens.shape[0]].set(tokens)

    def no_load(self) -> jax.Array | None:
        """The expert load a loop starts from: zeros `[L, X]`, or None for a dense model."""
        if not self.counts_experts:
            return None
        moe = self.model_config.moe
        return jnp.zeros((self.model_config.num_layers, moe.num_experts), jnp.int32)

    def _loads(self, load) -> tuple:
        """What a program returns of its expert load: `(load,)`, or () for a dense model."""
        return (load,) if self.counts_experts else ()

    # ---- the programs --------------------------------------------------------------------
    def step(self, layout: Layout, state_leaves, caches, packed, history, allowed,
             last_tokens):
        """A forward over a flat ragged batch; the samples (`[S]` fields), the prompt
        log-probabilities (`[T]` fields), the expert load, the cache, the next tokens."""
        model, inp = self._unpacked(layout, state_leaves, packed, history, allowed)
        batch = PagedBatch(inp.slot_mapping, inp.kv_lens, inp.page_indices, inp.cu_q_lens,
                           inp.num_seqs, window_slot_mapping=inp.window_slot_mapping,
                           window_page_indices=inp.window_page_indices)
        token_ids = self._token_ids(inp, last_tokens)
        drafter = self._drafter(state_leaves)
        caches, own = drafter.split(caches)
        forward = model(token_ids, inp.positions, caches,
                        self._context(batch, lora=self._lora(state_leaves, inp.lora_slots)),
                        aux_layers=drafter.aux_layers, count_experts=self.counts_experts)
        hidden, caches = forward.hidden, forward.kv_cache  # [T, E]
        logits = model.logits(hidden[inp.logits_indices])  # [S, V]
        counts = TokenCounts.from_history(inp.history, inp.prompt_lens, logits.shape[-1],
                                          inp.sampling)
        result = sample_with_logprobs(logits, inp.sampling, inp.kv_lens, counts, inp.allowed)
        own = drafter.follow_step(model, own, inp, token_ids, batch, forward.aux,
                                  result.tokens)
        prompt = target_logprobs(hidden, inp.prompt_targets, model.logits)  # [T] per field
        return (result, prompt, *self._loads(forward.expert_load), drafter.join(caches, own),
                self._padded(result.tokens))

    def decode(self, layout: Layout, state_leaves, caches, packed, history, allowed,
               last_tokens):
        """The decode loop: up to `num_steps` one-token steps, each sampled token fed back,
        stop tokens and limits checked on device. Rows under a grammar run one step (the
        scheduler sees to it: the next bitmask needs the token just sampled), so `allowed`
        holds for every step run. A drafter follows every token, so that its cache has no
        gap when later steps speculate again (steps of more rows than
        `disable_by_batch_size` run here). Returns samples (`[S, K]` fields), how many each
        row produced `[S]`, the expert load, the cache, the next tokens."""
        model, inp, num_steps = self._unpacked(layout, state_leaves, packed, history, allowed)
        drafter = self._drafter(state_leaves)
        caches, own = drafter.split(caches)
        rows = inp.kv_lens.shape[0]
        page_size = self.config.page_size
        row = jnp.arange(rows)
        valid = row < inp.num_seqs[0]  # [S]
        cu_q_lens = jnp.minimum(jnp.arange(rows + 1), inp.num_seqs[0]).astype(jnp.int32)
        out = empty_samples(rows, self.config.num_decode_steps)  # [S, K] per field
        count = jnp.zeros((rows,), jnp.int32)
        done = ~valid | (inp.max_new <= 0)
        vocab = self.model_config.vocab_size
        counts = TokenCounts.from_history(inp.history, inp.prompt_lens, vocab, inp.sampling)
        lora = self._lora(state_leaves, inp.lora_slots)  # a token a row

        def body(step, done, carry):
            out, count, current, position, counts, caches, drafted, load = carry

            def slots_in(page_indices):  # [S] this step's slot of each row's token
                if page_indices is None:
                    return None
                page = page_indices[row, position // page_size]
                return jnp.where(done, -1, page * page_size + position % page_size)

            batch = PagedBatch(slots_in(inp.page_indices), jnp.where(valid, position + 1, 0),
                               inp.page_indices, cu_q_lens, inp.num_seqs, decode_only=True,
                               window_slot_mapping=slots_in(inp.window_page_indices),
                               window_page_indices=inp.window_page_indices)
            forward = model(current, position, caches, self._context(batch, lora=lora),
                            aux_layers=drafter.aux_layers, count_experts=self.counts_experts)
            hidden, caches = forward.hidden, forward.kv_cache  # [S, E]
            if self.counts_experts:
                load = load + forward.expert_load  # [L, X]
            drafted = drafter.follow_decode(model, drafted, current, position, batch,
                                            forward.aux)
            result = sample_with_logprobs(model.logits(hidden), inp.sampling, position + 1,
                                          counts, inp.allowed)
            new = result.tokens  # [S]
            out = jax.tree.map(lambda buf, value: buf.at[:, step].set(value), out, result)
            counts = counts.add(new, ~done)
            count = count + (~done).astype(jnp.int32)
            stopped = jnp.any(new[:, None] == inp.stop_ids, axis=-1) | (count >= inp.max_new)
            position = jnp.where(done, position, position + 1)
            current = jnp.where(done, current, new)
            return stopped, (out, count, current, position, counts, caches, drafted, load)

        current = self._token_ids(inp, last_tokens)
        carry = (out, count, current, inp.positions, counts, caches,
                 drafter.decode_begin(own, inp, current[:rows]), self.no_load())
        out, count, current, _, _, caches, drafted, load = loop_until_done(
            num_steps, body, done, carry)
        own = drafter.decode_end(drafted, own, current)
        return (out, count, *self._loads(load), drafter.join(caches, own),
                self._padded(current))

    def spec(self, layout: Layout, state_leaves, caches, packed, history, allowed,
             last_tokens):
        """Speculative rounds (`speculative_rounds`): the kept tokens, how many per row, what
        was proposed and accepted, as the decode loop returns them plus `DraftCounts`."""
        model, inp, num_rounds = self._unpacked(layout, state_leaves, packed, history, allowed)
        out, count, drafts, caches, current, load = speculative_rounds(
            model, self._context, inp, caches, self._token_ids(inp, last_tokens), num_rounds,
            self.config, self.model_config.vocab_size, self._drafter(state_leaves),
            self.no_load())
        return (out, count, drafts, *self._loads(load), caches, self._padded(current))
