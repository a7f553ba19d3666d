"""A draft model (`method` "draft_model"): a smaller model of the target's vocabulary that
proposes k tokens greedily, inside the speculative program.

Its KV cache is a pool of its own with the target's page tables: the same page ids, the same
slots, so the allocator, the scheduler and the prefix cache need to know nothing of it (a
page holds the target's K/V in one pool and the draft's in the other; `kv_cache`'s sizing
counts both). The draft keeps its cache as the target does: every step program runs it over
the step's tokens (prompts, chunks, decode tokens), and each speculative round feeds it the
current token and then each draft, one token a row, k + 1 times: the last draft too, so that
when the round accepts every draft the cache already holds it. Rejected drafts' K/V lie past
the row's length until later tokens overwrite them. A draft that proposes greedily is one
token with probability 1, which is what the acceptance rule of `jaxserve.engine.speculative_rounds`
is exact for.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve.attention import PagedBatch
from jaxserve.sampling.sampler import greedy
from jaxserve.loading import checkpoint
from jaxserve.loading.hub import resolve_model
from jaxserve.model import LlamaModel
from jaxserve.model.config import ModelConfig
from jaxserve.speculative.windows import page_slots


def draft_config(spec, target: ModelConfig, config_only: bool = False
                 ) -> tuple[Path, ModelConfig]:
    """The draft's folder and config; `ValueError` naming `speculative_config.model` when it
    cannot draft for `target` (another vocabulary). `config_only`: a Hub id's config.json is
    all that is fetched (a plan)."""
    folder = resolve_model(spec.model, config_only=config_only)
    config = checkpoint.model_config(folder)
    if config.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config.model {spec.model!r} has a vocabulary of "
                         f"{config.vocab_size} tokens; the target's has {target.vocab_size} "
                         "(a draft must share the target's tokenizer)")
    return folder, config


def load_draft(spec, target: ModelConfig, dtype, mesh: Mesh, progress: bool) -> LlamaModel:
    """The draft model's weights, on `mesh` like the target's, in `dtype`."""
    from jaxserve.loading.weights import load_weights

    folder, config = draft_config(spec, target)
    if checkpoint.is_checkpoint(folder):
        return checkpoint.restore(folder, config, dtype, mesh)
    return load_weights(folder, config, dtype, progress=progress, mesh=mesh)


def propose(draft, context, caches, current: jax.Array, position: jax.Array,
            active: jax.Array, page_indices: jax.Array, num_seqs, k: int, page_size: int):
    """k greedy drafts per row `[S, k]` and the draft's updated cache. `current [S]` at
    `position [S]`; rows not `active` write nothing; `context(batch)`: the draft's
    `StepContext` for a `PagedBatch`. k + 1 one-token steps in a loop (one
    cache write per layer in the program): the current token, then each draft, the last
    only so that the cache holds it when every draft is accepted."""
    rows = current.shape[0]
    valid = jnp.arange(rows) < num_seqs[0]
    columns = page_indices.shape[1]
    cu_q_lens = jnp.minimum(jnp.arange(rows + 1), num_seqs[0]).astype(jnp.int32)

    def step(j, carry):
        token, drafts, caches = carry
        at = position + j  # [S]
        slots = page_slots(page_indices, at[:, None], page_size, active[:, None])[:, 0]
        seen = jnp.minimum(at + 1, columns * page_size)  # no read past the page table
        batch = PagedBatch(slots, jnp.where(valid, seen, 0), page_indices, cu_q_lens, num_seqs,
                           decode_only=True)
        out = draft(token, at, caches, context(batch))
        caches = out.kv_cache
        token = greedy(draft.logits(out.hidden))  # [S, E] → [S]
        return token, drafts.at[:, j].set(token, mode="drop"), caches

    drafts = jnp.zeros((rows, k), jnp.int32)
    _, drafts, caches = jax.lax.fori_loop(0, k + 1, step, (current, drafts, caches))
    return drafts, caches  # [S, k]
