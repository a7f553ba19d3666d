"""What each supported `model_type` changes in the Llama-family decoder and its checkpoint, in
one table (`FAMILIES`), so that reading a config (`jaxserve.model.config`) and loading weights
(`jaxserve.loading.weights`) ask a family's traits instead of testing its name.

A family's readers take the parsed Hugging Face `config.json` (`hf`) and return plain values
(the fields of a `MoEConfig`, one flag per layer), which `config` turns into its types.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

HFConfig = dict[str, Any]


def _every_layer_slides(hf: HFConfig) -> list[bool]:  # Mistral, Mixtral
    return [True] * hf["num_hidden_layers"]


def _even_layers_slide(hf: HFConfig) -> list[bool]:  # Gemma 2, gpt-oss: from the first
    return [i % 2 == 0 for i in range(hf["num_hidden_layers"])]


def _all_but_every_pattern_th(hf: HFConfig) -> list[bool]:  # Gemma 3
    pattern = int(hf.get("sliding_window_pattern") or 6)
    return [(i + 1) % pattern != 0 for i in range(hf["num_hidden_layers"])]


def _qwen_sliding_layers(hf: HFConfig) -> list[bool]:
    """With `use_sliding_window`, the layers from `max_window_layers` on."""
    num_layers = hf["num_hidden_layers"]
    first = hf.get("max_window_layers", num_layers)
    return [bool(hf.get("use_sliding_window")) and i >= first for i in range(num_layers)]


def _qwen3_moe(hf: HFConfig) -> tuple[dict, tuple[int, ...]]:
    """Dense layers: `mlp_only_layers` and those `decoder_sparse_step` skips."""
    step, dense_only = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(hf["num_hidden_layers"])
                  if i in dense_only or (i + 1) % step)
    return dict(num_experts=hf.get("num_experts") or hf.get("num_local_experts"),
                top_k=hf.get("num_experts_per_tok"),
                intermediate_size=hf.get("moe_intermediate_size"),
                normalize_top_k=bool(hf.get("norm_topk_prob"))), dense


def _glm4_moe(hf: HFConfig) -> tuple[dict, tuple[int, ...]]:
    """Sigmoid routing over groups, shared experts; the first `first_k_dense_replace` layers
    dense."""
    dense = tuple(i for i in range(hf["num_hidden_layers"])
                  if i < hf.get("first_k_dense_replace", 0))
    return dict(num_experts=hf.get("n_routed_experts") or hf.get("num_local_experts"),
                top_k=hf.get("num_experts_per_tok"),
                intermediate_size=hf.get("moe_intermediate_size"),
                normalize_top_k=bool(hf.get("norm_topk_prob", True)), scoring="sigmoid",
                num_groups=hf.get("n_group") or 1, top_k_groups=hf.get("topk_group") or 1,
                routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                shared_experts=int(hf.get("n_shared_experts") or 0)), dense


def _gpt_oss_moe(hf: HFConfig) -> tuple[dict, tuple[int, ...]]:
    """Biased router and experts, clamped SwiGLU. Its router takes the softmax of its top k
    logits, which is the renormalized top k of the softmax."""
    return dict(num_experts=hf.get("num_local_experts"), top_k=hf.get("num_experts_per_tok"),
                intermediate_size=hf.get("intermediate_size"), biases=True,
                activation="clamped_swiglu", swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
                swiglu_limit=float(hf.get("swiglu_limit", 7.0))), ()


def _mixtral_moe(hf: HFConfig) -> tuple[dict, tuple[int, ...]]:
    return dict(num_experts=hf.get("num_local_experts"), top_k=hf.get("num_experts_per_tok"),
                intermediate_size=hf.get("intermediate_size")), ()


def _gemma3_local_theta(hf: HFConfig) -> float:  # transformers 4.x's field
    return float(hf.get("rope_local_base_freq") or 10000.0)


@dataclasses.dataclass(frozen=True)
class Family:
    """One `model_type`'s traits (the defaults: Llama's)."""

    gemma: bool = False  # Gemma's norms, scaled embeddings and queries (`GemmaStyle`)
    caps_attention_scores: bool = False  # reads `attn_logit_softcapping` (Gemma 2)
    qkv_bias_always: bool = False  # q/k/v biases whatever `attention_bias` says (Qwen2)
    o_bias: bool = False  # `attention_bias` covers the output projection too
    qk_norm: bool = False  # RMSNorm on each head's q and k
    attention_sinks: bool = False  # a learned logit per head in every softmax (gpt-oss)
    # which layers slide when `config.json` has a window but no `layer_types` (None: none)
    sliding_layers: Callable[[HFConfig], list[bool]] | None = None
    # the sliding layers' rope theta when `rope_parameters` is not per layer type
    local_rope_theta: Callable[[HFConfig], float] | None = None
    # a mixture of experts: (`MoEConfig` fields, the layers that keep a dense MLP)
    moe: Callable[[HFConfig], tuple[dict, tuple[int, ...]]] | None = None
    # the checkpoint's names of one layer's experts: (module prefix, router, gate, up, down)
    expert_names: tuple[str, str, str, str, str] | None = None
    fused_experts: bool = False  # experts stacked, gate and up interleaved, MXFP4 (gpt-oss)


_QWEN_MOE_NAMES = ("mlp.", "gate", "gate_proj", "up_proj", "down_proj")

FAMILIES: dict[str, Family] = {
    "llama": Family(o_bias=True),
    "mistral": Family(sliding_layers=_every_layer_slides),
    "qwen2": Family(qkv_bias_always=True, sliding_layers=_qwen_sliding_layers),
    "qwen3": Family(o_bias=True, qk_norm=True, sliding_layers=_qwen_sliding_layers),
    "qwen3_moe": Family(o_bias=True, qk_norm=True, sliding_layers=_qwen_sliding_layers,
                        moe=_qwen3_moe, expert_names=_QWEN_MOE_NAMES),
    "mixtral": Family(sliding_layers=_every_layer_slides, moe=_mixtral_moe,
                      expert_names=("block_sparse_moe.", "gate", "w1", "w3", "w2")),
    "glm4_moe": Family(moe=_glm4_moe, expert_names=_QWEN_MOE_NAMES),
    "gemma2": Family(gemma=True, caps_attention_scores=True, sliding_layers=_even_layers_slide),
    "gemma3_text": Family(gemma=True, qk_norm=True, sliding_layers=_all_but_every_pattern_th,
                          local_rope_theta=_gemma3_local_theta),
    "gpt_oss": Family(o_bias=True, attention_sinks=True, sliding_layers=_even_layers_slide,
                      moe=_gpt_oss_moe, fused_experts=True),
}
