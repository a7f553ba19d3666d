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
    """`[head_dim // 2]` float32 inverse frequencies, with linear, Llama-3 or YaRN scaling."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)  # [D/2]
    if rope.rope_type == "linear":
        return (inv_freq / rope.factor).astype(np.float32)
    if rope.rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope).astype(np.float32)
    if rope.rope_type == "yarn":
        return _yarn_scaled(inv_freq, rope, head_dim).astype(np.float32)
    return inv_freq.astype(np.float32)


def _yarn_scaled(inv_freq: np.ndarray, rope: RopeConfig, head_dim: int) -> np.ndarray:
    """YaRN: dimensions that turn fewer than `beta_slow` times over the original context are
    divided by `factor` (interpolated), those turning more than `beta_fast` times are kept
    (extrapolated), with a linear ramp between the two correction dimensions."""
    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(rope.original_max_position_embeddings
                                    / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of one step
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # [D/2] 1: extrapolated (as trained), 0: interpolated
    return inv_freq / rope.factor * (1 - keep) + inv_freq * keep


def rope_scale(rope: RopeConfig) -> float:
    """The factor cos and sin are multiplied by (YaRN's attention factor; 1 otherwise)."""
    return rope.attention_factor if rope.rope_type == "yarn" else 1.0


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


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: np.ndarray,
               scale: float = 1.0) -> jnp.ndarray:
    """Rotate `x [..., H, D]` by the angles of `positions [...]`, cos and sin times `scale`
    (`rope_scale`); returns x's dtype."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)  # [..., D/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    cos = cos.astype(x.dtype)[..., None, :]  # [..., 1, D/2]
    sin = sin.astype(x.dtype)[..., None, :]
    first, second = jnp.split(x, 2, axis=-1)  # [..., H, D/2] each
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
