"""Reference generation path: jitted prefill, then a jitted `lax.while_loop` decode over a
dense KV cache.

It is simple on purpose, and stays as the oracle the paged engine must equal token for token.
Shapes are bucketed so repeated calls do not recompile: batch rows to a power of two, prompt
length to a power of two (at least 16), and the cache (prompt + new tokens) to a power of two.
The number of decode steps is a traced value, so `max_tokens` never changes the program.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.model import LlamaModel
from jaxserve.reference.dense_attention import DenseAttention, empty_dense_cache
from jaxserve.model.contract import StepContext
from jaxserve.sampling.sampler import sample
from pallas_kernels import kv_quant

MIN_PROMPT_BUCKET = 16


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


class DenseGenerator:
    """Generates token ids for a batch of prompts with the model's weights held on device."""

    def __init__(self, model: LlamaModel, kv_cache_dtype: str = "auto",
                 head_scales: jax.Array | None = None):
        """`kv_cache_dtype`: keys and values read back as that KV cache holds them, fp8 with
        `head_scales` `[L, 2, Hkv]` (`jaxserve.reference.dense_attention`)."""
        self.config = model.config
        self.kv_cache_dtype = kv_cache_dtype
        self.head_scales = head_scales
        self.dtype = model.compute_dtype
        self.graphdef, self.state = nnx.split(model)
        self._prefill = jax.jit(self._prefill_impl, static_argnames=("cache_len",))
        self._decode = jax.jit(self._decode_impl)
        self._logits = jax.jit(self._logits_impl)

    # ---- traced functions -------------------------------------------------------------
    def _forward(self, state, tokens, caches):
        model = nnx.merge(self.graphdef, state)
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)  # [B, T]
        attention = DenseAttention.of_model(self.config, positions, self.kv_cache_dtype,
                                            self.head_scales)
        out = model(tokens, positions, caches, StepContext(attention))
        return model, out.hidden, out.kv_cache  # [B, T, E], ...

    def _empty_caches(self, batch, cache_len):
        cfg = self.config
        return empty_dense_cache(cfg.num_layers, batch, cache_len, cfg.num_kv_heads,
                                 cfg.head_dim, self.dtype)

    def _logits_impl(self, state, tokens):
        caches = self._empty_caches(*tokens.shape)
        model, hidden, _ = self._forward(state, tokens, caches)
        return model.logits(hidden)  # [B, T, V]

    def _prefill_impl(self, state, tokens, lengths, arrays, *, cache_len):
        """tokens `[B, T]` right-padded, lengths `[B]` → first new token `[B]`, caches."""
        caches = self._empty_caches(tokens.shape[0], cache_len)
        model, hidden, caches = self._forward(state, tokens, caches)
        last = hidden[jnp.arange(tokens.shape[0]), lengths - 1]  # [B, E]
        first = sample(model.logits(last), arrays, lengths)  # [B]
        return first, caches

    def _decode_impl(self, state, caches, first, lengths, max_new, stop_ids, arrays):
        """Feed back sampled tokens until every row hit a stop token or its `max_new`.

        first `[B]`, lengths `[B]` prompt lengths, max_new `[B]` >= 1, stop_ids `[B, K]`
        (-1 padded). Returns tokens `[B, N]` and the count generated per row `[B]`.
        """
        model = nnx.merge(self.graphdef, state)
        batch, out_len = first.shape[0], caches[0][0].shape[1]
        is_stop = lambda tok: jnp.any(tok[:, None] == stop_ids, axis=-1)  # noqa: E731
        tokens = jnp.zeros((batch, out_len), jnp.int32).at[:, 0].set(first)  # [B, N]
        count = jnp.ones((batch,), jnp.int32)  # tokens generated so far per row
        done = is_stop(first) | (max_new <= 1)  # [B]

        def cond(carry):
            _, count, done, _ = carry
            return ~jnp.all(done) & (jnp.max(count) < out_len)

        def body(carry):
            tokens, count, done, caches = carry
            position = lengths + count - 1  # [B] position of the token being fed
            current = tokens[jnp.arange(batch), count - 1]  # [B]
            attention = DenseAttention.of_model(self.config, position[:, None],
                                                self.kv_cache_dtype, self.head_scales)
            out = model(current[:, None], position[:, None], caches, StepContext(attention))
            caches = out.kv_cache
            new = sample(model.logits(out.hidden[:, 0]), arrays, position + 1)  # [B]
            tokens = tokens.at[jnp.arange(batch), count].set(jnp.where(done, 0, new))
            count = jnp.where(done, count, count + 1)
            done = done | is_stop(new) | (count >= max_new)
            return tokens, count, done, caches

        tokens, count, _, _ = jax.lax.while_loop(cond, body, (tokens, count, done, caches))
        return tokens, count

    # ---- host API ---------------------------------------------------------------------
    def calibrated_head_scales(self, prompt: Sequence[int]) -> jax.Array:
        """The fp8 scales `[L, 2, Hkv]` that an fp8 cache calibrating its scales
        (`calculate_kv_scales`) takes from `prompt` as its first step (`kv_quant.calibrate`):
        each layer's K and V absmax per kv head, later layers reading K/V stored with them."""
        cfg = self.config
        scales = jnp.zeros((cfg.num_layers, 2, cfg.num_kv_heads), jnp.float32)
        tokens = jnp.asarray([prompt], jnp.int32)  # [1, T]
        positions = jnp.arange(len(prompt))[None]  # [1, T]
        real = jnp.ones(len(prompt), bool)  # [T]

        def attention(layer_index, q, k, v, layer_cache, **sinks):  # eager: an int index
            nonlocal scales
            unset = jnp.zeros(cfg.num_kv_heads, jnp.float32)
            fresh = jnp.stack([kv_quant.calibrate(unset, x[0], real) for x in (k, v)])
            scales = scales.at[layer_index].set(fresh)
            return DenseAttention.of_model(cfg, positions, "fp8", scales)(
                layer_index, q, k, v, layer_cache, **sinks)

        model = nnx.merge(self.graphdef, self.state)
        model(tokens, positions, self._empty_caches(1, len(prompt)), StepContext(attention))
        return scales

    def logits(self, prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Float32 logits `[len, V]` for every position of every prompt (for parity checks)."""
        lengths = [len(p) for p in prompts]
        tokens = self._pad(prompts, bucket(len(prompts)), bucket(max(lengths), MIN_PROMPT_BUCKET))
        out = np.asarray(self._logits(self.state, tokens))  # [B, T, V]
        return [out[i, :n] for i, n in enumerate(lengths)]

    def generate(self, prompts: Sequence[Sequence[int]], max_new: Sequence[int],
                 stop_ids: Sequence[Sequence[int]],
                 arrays_for_batch) -> list[tuple[list[int], bool]]:
        """Generate for one batch. Returns per prompt (token ids, ended on a stop token).

        `max_new[i]` >= 1 tokens at most for prompt i; `stop_ids[i]` end it early (kept in
        the output); `arrays_for_batch(rows)` builds the `SamplingArrays` padded to `rows`.
        """
        rows = bucket(len(prompts))
        lengths = [len(p) for p in prompts]
        prompt_len = bucket(max(lengths), MIN_PROMPT_BUCKET)
        cache_len = bucket(max(n + m for n, m in zip(lengths, max_new)) + 1, prompt_len)
        tokens = self._pad(prompts, rows, prompt_len)
        lengths_arr = np.asarray(lengths + [1] * (rows - len(prompts)), np.int32)
        max_new_arr = np.asarray(list(max_new) + [1] * (rows - len(prompts)), np.int32)
        width = max(1, max(len(s) for s in stop_ids))
        stop_arr = np.full((rows, width), -1, np.int32)
        for i, ids in enumerate(stop_ids):
            stop_arr[i, :len(ids)] = ids
        arrays = arrays_for_batch(rows)
        first, caches = self._prefill(self.state, tokens, lengths_arr, arrays,
                                      cache_len=cache_len)
        out, count = self._decode(self.state, caches, first, lengths_arr, max_new_arr,
                                  stop_arr, arrays)
        out, count = np.asarray(out), np.asarray(count)
        results = []
        for i, stops in enumerate(stop_ids):
            ids = out[i, :count[i]].tolist()
            results.append((ids, bool(ids) and ids[-1] in stops))
        return results

    @staticmethod
    def _pad(prompts, rows: int, length: int) -> np.ndarray:
        tokens = np.zeros((rows, length), np.int32)  # [B, T]
        for i, prompt in enumerate(prompts):
            tokens[i, :len(prompt)] = prompt
        return tokens
