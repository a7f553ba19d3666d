"""A draft model (`method` "draft_model"): a smaller model of the target's vocabulary that
proposes k tokens greedily, inside the speculative program.

Its KV cache is a pool of its own with the target's page tables: the same page ids, the same
slots, so the allocator, the scheduler and the prefix cache need to know nothing of it (a
page holds the target's K/V in one pool and the draft's in the other; `kv_cache`'s sizing
counts both). The draft keeps its cache as the target does: every step program runs it over
the step's tokens (prompts, chunks, decode tokens), and each speculative round feeds it
- first the row's last two tokens (the one before the current token again, because when a
  round accepted every draft, its last draft was never fed), then the current token's
  logits give the first draft;
- then each draft in turn, one token a row, k - 1 times.
A draft that proposes greedily is one token with probability 1, which is what the
acceptance rule of `jaxserve.speculative.rounds` is exact for.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxserve.attention import PagedBatch
from jaxserve.engine.sampler import greedy
from jaxserve.loading import checkpoint
from jaxserve.loading.hub import resolve_model
from jaxserve.model import LlamaModel
from jaxserve.model.config import ModelConfig


def draft_config(spec, target: ModelConfig) -> tuple[Path, ModelConfig]:
    """The draft's folder and config; `ValueError` naming `speculative_config.model` when it
    cannot draft for `target` (another vocabulary)."""
    folder = resolve_model(spec.model)
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


def propose(draft, attention, caches, history: jax.Array, current: jax.Array,
            position: jax.Array, active: jax.Array, page_indices: jax.Array, num_seqs,
            k: int, page_size: int):
    """k greedy drafts per row `[S, k]` and the draft's updated cache. `current [S]` at
    `position [S]` (at least 1: a prompt token comes before it); rows not `active` write
    nothing; `history [S, L]` holds the token before the current one."""
    rows = current.shape[0]
    row = jnp.arange(rows)
    valid = row < num_seqs[0]

    def slots(at):  # [S, n] positions → cache slots; -1: an inactive row, or past the table
        column = at // page_size
        page = jnp.take_along_axis(page_indices,
                                   jnp.minimum(column, page_indices.shape[1] - 1), 1)
        writes = active[:, None] & (column < page_indices.shape[1])
        return jnp.where(writes, page * page_size + at % page_size, -1)

    at = position[:, None] + jnp.arange(-1, 1)[None, :]  # [S, 2]: before, current
    pair = jnp.stack([history[row, position - 1], current], axis=1)  # [S, 2]
    q_lens = jnp.where(valid, 2, 0)
    first = PagedBatch(slots(at).reshape(-1), jnp.where(valid, position + 1, 0), page_indices,
                       jnp.concatenate([jnp.zeros((1,), jnp.int32),
                                        jnp.cumsum(q_lens).astype(jnp.int32)]), num_seqs)
    hidden, caches = draft(jnp.maximum(pair, 0).reshape(-1), at.reshape(-1), caches,
                           attention.for_step(first))  # [2S, E]
    token = greedy(draft.logits(hidden[1::2]))  # [S] after each current token
    drafts = [token]
    cu_q_lens = jnp.minimum(jnp.arange(rows + 1), num_seqs[0]).astype(jnp.int32)
    for step in range(1, k):  # feed each draft, one token a row
        at = position + step  # [S]
        seen = jnp.minimum(at + 1, page_indices.shape[1] * page_size)  # no read past the table
        batch = PagedBatch(slots(at[:, None])[:, 0], jnp.where(valid, seen, 0), page_indices,
                           cu_q_lens, num_seqs, decode_only=True)
        hidden, caches = draft(token, at, caches, attention.for_step(batch))  # [S, E]
        token = greedy(draft.logits(hidden))
        drafts.append(token)
    return jnp.stack(drafts, axis=1), caches  # [S, k]
