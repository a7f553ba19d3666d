"""Rotary position embeddings as Hugging Face Llama computes them (non-interleaved halves).

Frequencies are computed once per model in float32 (numpy, at trace time); cos/sin are made
per token from its position, so prefill chunks, decode steps and padded slots all use one code
path.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxserve.model.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """`[head_dim // 2]` float32 inverse frequencies, with linear or Llama-3 scaling applied."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)  # [D/2]
    if rope.rope_type == "linear":
        return (inv_freq / rope.factor).astype(np.float32)
    if rope.rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope).astype(np.float32)
    return inv_freq.astype(np.float32)


def _llama3_scaled(inv_freq: np.ndarray, rope: RopeConfig) -> np.ndarray:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short ones kept, a smooth blend
    between the two cut-offs."""
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # [D/2]
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, blended, scaled)


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: np.ndarray) -> jnp.ndarray:
    """Rotate `x [..., H, D]` by the angles of `positions [...]`; returns x's dtype."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)  # [..., D/2]
    cos = jnp.cos(angles).astype(x.dtype)[..., None, :]  # [..., 1, D/2]
    sin = jnp.sin(angles).astype(x.dtype)[..., None, :]
    first, second = jnp.split(x, 2, axis=-1)  # [..., H, D/2] each
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
