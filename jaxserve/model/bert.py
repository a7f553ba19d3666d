"""BERT-family encoders (BERT, XLM-RoBERTa, as bge-m3 and e5 use) in Flax NNX, for the
pooling runner: bidirectional attention, learned absolute positions, token types, and a
LayerNorm after each residual sum (post-norm).

Built from a Hugging Face `BertModel` / `XLMRobertaModel` state dict (numpy arrays by HF
name, `[out, in]` kernels; `jaxserve.pooling.models` reads the files). XLM-RoBERTa is BERT
whose positions start at `pad_token_id + 1`; `BertConfig.position_offset` says so. The
encoder decodes nothing, so it keeps no KV cache: attention is whatever callable the caller
passes (`attention(layer, q, k, v, None) -> (out, None)`, e.g. one masked to each packed
sequence).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """The fields of a BERT-family `config.json` the encoder needs."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    position_offset: int  # positions start here: 0 (BERT) or padding_idx + 1 (XLM-RoBERTa)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "BertConfig":
        roberta = hf.get("model_type") in ("xlm-roberta", "roberta")
        act = hf.get("hidden_act", "gelu")
        if act not in ("gelu", "gelu_new", "relu"):
            raise ValueError(f"config.json: hidden_act {act!r} is not supported (gelu, "
                             "gelu_new, relu)")
        if hf.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("config.json: only absolute position embeddings are supported, "
                             f"not {hf['position_embedding_type']!r}")
        return cls(hf["vocab_size"], hf["hidden_size"], hf["num_hidden_layers"],
                   hf["num_attention_heads"], hf["intermediate_size"],
                   hf["max_position_embeddings"], hf.get("type_vocab_size", 2),
                   hf.get("layer_norm_eps", 1e-12), act,
                   hf.get("pad_token_id", 1) + 1 if roberta else 0)

    @property
    def max_tokens(self) -> int:
        """The longest sequence its position table holds."""
        return self.max_position_embeddings - self.position_offset


def _param(value: np.ndarray, dtype) -> nnx.Param:
    return nnx.Param(jnp.asarray(value, dtype))


class Dense(nnx.Module):
    """`x @ kernel + bias`, the kernel stored `[in, out]` (HF's transposed)."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray, dtype):
        self.kernel = _param(weight.T, dtype)  # [in, out]
        self.bias = _param(bias, dtype)  # [out]

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.kernel[...] + self.bias[...]


class LayerNorm(nnx.Module):
    """LayerNorm with scale and bias, computed in float32."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray, eps: float, dtype):
        self.scale, self.bias, self.eps = _param(weight, dtype), _param(bias, dtype), eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
        out = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (out * self.scale[...] + self.bias[...]).astype(x.dtype)


class EncoderLayer(nnx.Module):
    """Self-attention and MLP, each followed by residual sum and LayerNorm."""

    def __init__(self, cfg: BertConfig, tensors: dict[str, np.ndarray], prefix: str, dtype):
        def dense(name):
            return Dense(tensors[f"{prefix}{name}.weight"], tensors[f"{prefix}{name}.bias"],
                         dtype)

        def layer_norm(name):
            return LayerNorm(tensors[f"{prefix}{name}.weight"],
                             tensors[f"{prefix}{name}.bias"], cfg.layer_norm_eps, dtype)

        self.query, self.key = dense("attention.self.query"), dense("attention.self.key")
        self.value = dense("attention.self.value")
        self.attention_out = dense("attention.output.dense")
        self.attention_norm = layer_norm("attention.output.LayerNorm")
        self.up, self.down = dense("intermediate.dense"), dense("output.dense")
        self.mlp_norm = layer_norm("output.LayerNorm")
        self.num_heads, self.act = cfg.num_heads, cfg.hidden_act

    def __call__(self, index: int, x: jax.Array, attention) -> jax.Array:
        tokens, e = x.shape  # [T, E]
        heads = lambda y: y.reshape(tokens, self.num_heads, -1)  # noqa: E731  [T, H, D]
        out, _ = attention(index, heads(self.query(x)), heads(self.key(x)),
                           heads(self.value(x)), None)  # [T, H, D]
        x = self.attention_norm(x + self.attention_out(out.reshape(tokens, e)))
        up = self.up(x)  # [T, I]
        if self.act == "relu":
            up = jax.nn.relu(up)
        else:
            up = jax.nn.gelu(up, approximate=self.act == "gelu_new")
        return self.mlp_norm(x + self.down(up))


class BertModel(nnx.Module):
    """Embeddings (word + position + token type, then LayerNorm) and the encoder layers;
    returns every token's last hidden state."""

    def __init__(self, cfg: BertConfig, tensors: dict[str, np.ndarray], dtype=jnp.float32):
        self.config = cfg
        self.word = _param(tensors["embeddings.word_embeddings.weight"], dtype)  # [V, E]
        self.position = _param(tensors["embeddings.position_embeddings.weight"],
                               dtype)  # [P, E]
        self.token_type = _param(tensors["embeddings.token_type_embeddings.weight"],
                                 dtype)  # [types, E]
        self.embed_norm = LayerNorm(tensors["embeddings.LayerNorm.weight"],
                                    tensors["embeddings.LayerNorm.bias"], cfg.layer_norm_eps,
                                    dtype)
        self.layers = nnx.List([EncoderLayer(cfg, tensors, f"encoder.layer.{i}.", dtype)
                                for i in range(cfg.num_layers)])

    def __call__(self, token_ids: jax.Array, positions: jax.Array, attention,
                 token_types: jax.Array | None = None) -> jax.Array:
        """token_ids, positions `[T]` (positions already offset) → hidden states `[T, E]`."""
        types = jnp.zeros_like(token_ids) if token_types is None else token_types
        x = self.word[...][token_ids] + self.position[...][positions]
        x = self.embed_norm(x + self.token_type[...][types])  # [T, E]
        for index, layer in enumerate(self.layers):
            x = layer(index, x, attention)
        return x
