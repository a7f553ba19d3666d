"""On-device token sampling from per-row arrays.

Every sampling setting is a row of an array, never a Python constant, so a batch that mixes
greedy and sampled requests with different temperatures, top-k, top-p, min-p and seeds runs
one compiled program. Randomness is keyed by (request seed, position of the sampled token),
so a seeded request gives the same tokens however it is batched.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.sampling_params import SamplingParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingArrays:
    """Per-row sampling settings of one batch."""

    temperature: jax.Array  # [B] float32, 0 = greedy
    top_k: jax.Array  # [B] int32, 0 = whole vocabulary
    top_p: jax.Array  # [B] float32, 1 = off
    min_p: jax.Array  # [B] float32, 0 = off
    seed: jax.Array  # [B] uint32

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], seeds: Sequence[int],
                    batch: int) -> "SamplingArrays":
        """Pack `params` into rows, padding to `batch` rows with greedy settings."""
        pad = batch - len(params)
        if pad < 0:
            raise ValueError(f"{len(params)} requests do not fit a batch of {batch}")

        def column(values, fill, dtype):
            return np.asarray(list(values) + [fill] * pad, dtype=dtype)

        return cls(
            temperature=column((p.temperature for p in params), 0.0, np.float32),
            top_k=column((max(p.top_k, 0) for p in params), 0, np.int32),
            top_p=column((p.top_p for p in params), 1.0, np.float32),
            min_p=column((p.min_p for p in params), 0.0, np.float32),
            seed=column((s % 2**32 for s in seeds), 0, np.uint32),
        )


def _filtered_sample(logits: jax.Array, arrays: SamplingArrays,
                     positions: jax.Array) -> jax.Array:
    """Temperature, then top-k, top-p and min-p filters, then one categorical draw per row."""
    vocab = logits.shape[-1]
    temperature = jnp.where(arrays.temperature > 0, arrays.temperature, 1.0)
    scaled = logits / temperature[:, None]  # [B, V]
    order = jnp.argsort(-scaled, axis=-1)  # [B, V] token ids, most likely first
    ranked = jnp.take_along_axis(scaled, order, axis=-1)  # [B, V] descending
    rank = jnp.arange(vocab)[None, :]  # [1, V]
    top_k = jnp.where(arrays.top_k > 0, arrays.top_k, vocab)[:, None]  # [B, 1]
    keep = rank < top_k
    probs = jax.nn.softmax(jnp.where(keep, ranked, -jnp.inf), axis=-1)  # [B, V]
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # [B, V]
    keep &= (mass_before < arrays.top_p[:, None]) | (rank == 0)
    keep &= probs >= arrays.min_p[:, None] * probs[:, :1]
    masked = jnp.where(keep, ranked, -jnp.inf)  # [B, V]
    keys = jax.vmap(lambda seed, pos: jax.random.fold_in(jax.random.key(seed), pos))(
        arrays.seed, positions)
    picked = jax.vmap(jax.random.categorical)(keys, masked)  # [B] rank of the chosen token
    return jnp.take_along_axis(order, picked[:, None], axis=-1)[:, 0]


def sample(logits: jax.Array, arrays: SamplingArrays, positions: jax.Array) -> jax.Array:
    """Choose one token per row.

    logits `[B, V]` float32; positions `[B]` int32, the position the new token will take.
    Returns `[B]` int32. When every row is greedy the sort is skipped at run time.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B]
    all_greedy = jnp.all(arrays.temperature == 0)
    sampled = jax.lax.cond(all_greedy, lambda: greedy,
                           lambda: _filtered_sample(logits, arrays, positions).astype(jnp.int32))
    return jnp.where(arrays.temperature == 0, greedy, sampled)
