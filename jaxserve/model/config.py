"""The model's configuration: `ModelConfig` (a Llama-family decoder's architecture,
independent of where it was read from) and what it holds (`RopeConfig`, `MoEConfig`,
`GemmaStyle`, `WeightQuantization`), with the helpers that derive one from another
(`with_quantization`, `with_expert_parallel`, `resolve_dtype`).

Supports the Llama family as `transformers` writes it: `model_type` llama, mistral, qwen2 and
qwen3, its mixture-of-experts relatives qwen3_moe, mixtral, glm4_moe and gpt_oss
(`MoEConfig`), and Gemma 2 and Gemma 3 (text) with what they change (`GemmaStyle`); what each
`model_type` changes is a row of `jaxserve.model.families.FAMILIES`. Layers may differ in
their attention: `layer_types` (transformers' per-layer "sliding_attention" /
"full_attention") says which layers see only the last `sliding_window` tokens, and Gemma 3's
sliding layers have a rope of their own (`local_rope`). `jaxserve.model.hf_config` reads a
Hugging Face `config.json` into these types.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp

from jaxserve.model.families import FAMILIES

DTYPES = ("float32", "bfloat16")  # what the engine computes in

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)  # what each changes: `jaxserve.model.families`
LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers' names
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # HF's name -> ours
EXPERT_ACTIVATIONS = ("silu", "clamped_swiglu")
TPU_LANES = 128  # the minor tile of a TPU array: a slice narrower than it is padded
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings. "llama3" uses `factor`, the two frequency factors and
    `original_max_position_embeddings`; "yarn" uses `factor`, the original length,
    `beta_fast`/`beta_slow`, `truncate` and `attention_factor` (cos and sin are scaled by it)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    partial_rotary_factor: float = 1.0  # the share of head_dim rotated (GLM: the first half)


QUANTIZATION_METHODS = ("int8", "fp8")  # weight dtypes a model can be stored in
QUANTIZABLE_WEIGHTS = ("embed", "lm_head")  # besides every linear layer's kernel


@dataclasses.dataclass(frozen=True)
class WeightQuantization:
    """How a model's weights are stored: `method` "int8" (symmetric, -127..127) or "fp8"
    (float8_e4m3fn), with one float32 scale per output channel (`jaxserve.model.quantization`).

    `skip`: weights kept in the compute dtype, among `QUANTIZABLE_WEIGHTS` (a pre-quantized
    checkpoint leaves its embedding and usually its lm head unquantized). `activations`:
    quantize each token's activations too, so the matmul runs int8 x int8 (or fp8 x fp8) on
    the platform's integer/fp8 units; otherwise weights are widened inside the matmul."""

    method: str
    skip: tuple[str, ...] = ()
    activations: bool = False

    def __post_init__(self):
        if self.method not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {list(QUANTIZATION_METHODS)}, got "
                             f"{self.method!r}")
        unknown = sorted(set(self.skip) - set(QUANTIZABLE_WEIGHTS))
        if unknown:
            raise ValueError(f"quantization skip names unknown weight(s) {unknown}; known: "
                             f"{list(QUANTIZABLE_WEIGHTS)}")

    def covers(self, name: str) -> bool:
        """Whether the weight called `name` (e.g. "q_proj", "embed") is stored quantized."""
        return name not in self.skip


def _check_positive(config, names: tuple[str, ...]) -> None:
    """`ValueError` naming the first of `config`'s fields `names` that is no positive int."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"config field {name} must be a positive integer, got {value!r}")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts feed-forward (in place of the dense MLP, on every layer but
    `ModelConfig.dense_layers`): a router scores `num_experts` SwiGLU experts of width
    `intermediate_size` per token and the `top_k` best run, weighted by their scores.

    `scoring` "softmax" (Qwen3-MoE, Mixtral): the softmax's top k, renormalized to sum to 1
    when `normalize_top_k` (always in Mixtral, `norm_topk_prob` in Qwen3-MoE). "sigmoid"
    (GLM-4.5, DeepSeek-V3's MoE): sigmoid scores; the choice adds a per-expert
    `e_score_correction_bias` and keeps only the `top_k_groups` best of `num_groups` groups
    of experts (a group's score: its two best); the weights are the chosen sigmoid scores,
    normalized when `normalize_top_k`, times `routed_scaling_factor`. `shared_experts`: that
    many experts' width of a plain SwiGLU every token also runs (0: none).
    `expert_parallel`: whole experts split among the devices of the mesh's "model" axis
    rather than a slice of every expert on each (the engine's `enable_expert_parallel`).

    gpt-oss: `biases` adds a bias to the router's logits and to each expert's gate, up and
    down projections; `activation` "clamped_swiglu" computes `(clip(up, ±limit) + 1) *
    g * sigmoid(alpha * g)` with `g = min(gate, limit)` (`swiglu_alpha`, `swiglu_limit`)
    where "silu" is `silu(gate) * up`."""

    num_experts: int
    top_k: int
    intermediate_size: int
    normalize_top_k: bool = True
    scoring: str = "softmax"
    num_groups: int = 1
    top_k_groups: int = 1
    routed_scaling_factor: float = 1.0
    shared_experts: int = 0
    expert_parallel: bool = False
    biases: bool = False
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self):
        _check_positive(self, ("num_experts", "top_k", "intermediate_size", "num_groups",
                               "top_k_groups"))
        if self.top_k > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) exceeds the number of "
                             f"experts ({self.num_experts})")
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"router scoring must be 'softmax' or 'sigmoid', got "
                             f"{self.scoring!r}")
        if self.activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"expert activation must be one of {list(EXPERT_ACTIVATIONS)}, "
                             f"got {self.activation!r}")
        if self.num_experts % self.num_groups or self.top_k_groups > self.num_groups:
            raise ValueError(f"n_group ({self.num_groups}) must divide the {self.num_experts} "
                             f"experts and be at least topk_group ({self.top_k_groups})")


@dataclasses.dataclass(frozen=True)
class GemmaStyle:
    """What Gemma 2 and 3 change in a Llama-family decoder, all as transformers computes it:
    RMSNorms scale by `1 + weight` in float32; a layer norms its attention's and its MLP's
    outputs too (post-norms) before adding them to the residual; embeddings are multiplied by
    sqrt(hidden_size) (in the compute dtype); attention scales by `query_pre_attn_scalar **
    -0.5`; Gemma 2 caps attention scores and final logits with `cap * tanh(x / cap)`."""

    query_pre_attn_scalar: float
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder, independent of where it was read from."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in every softmax
    sliding_window: int | None = None  # the window of the layers that slide
    layer_types: tuple[str, ...] = ()  # per layer, LAYER_TYPES; (): all slide if windowed
    local_rope: RopeConfig | None = None  # the sliding layers' rope (None: `rope`)
    hidden_act: str = "silu"  # of the MLP's gate: "silu" or "gelu_tanh"
    gemma: GemmaStyle | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    checkpoint_dtype: str | None = None  # `torch_dtype`/`dtype` as saved, used by dtype="auto"
    quantization: WeightQuantization | None = None  # None: weights in the compute dtype
    moe: MoEConfig | None = None  # None: dense MLPs
    dense_layers: tuple[int, ...] = ()  # with `moe`: layers whose MLP is dense all the same

    def __post_init__(self):
        _check_positive(self, ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                               "num_heads", "num_kv_heads", "head_dim"))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")

        if self.layer_types and (len(self.layer_types) != self.num_layers
                                 or set(self.layer_types) - set(LAYER_TYPES)):
            raise ValueError(f"layer_types must name one of {list(LAYER_TYPES)} for each of "
                             f"the {self.num_layers} layers, got {list(self.layer_types)}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is "
                             "not set")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: it sees the whole context)."""
        if not self.layer_types:
            return (self.sliding_window,) * self.num_layers
        return tuple(self.sliding_window if kind == "sliding_attention" else None
                     for kind in self.layer_types)

    def layer_rope(self, layer: int) -> RopeConfig:
        """The rope of layer `layer`: `local_rope` for a sliding layer if there is one."""
        if self.local_rope is not None and self.layer_windows[layer] is not None:
            return self.local_rope
        return self.rope

    def _layer_kind(self, layer: int) -> tuple:
        """What sets a layer's code apart: its window, its rope, a dense or sparse MLP."""
        return (self.layer_windows[layer], self.layer_rope(layer), self.sparse_layer(layer))

    @property
    def scan_period(self) -> int:
        """The fewest layers after which the layers' kinds repeat (window, rope, dense or
        sparse MLP): 1 when every layer is alike, 2 for alternating windows (Gemma 2,
        gpt-oss), 6 for Gemma 3; `num_layers` when nothing repeats."""
        kinds = [self._layer_kind(i) for i in range(self.num_layers)]
        return next(p for p in range(1, self.num_layers + 1)
                    if kinds[p:] == kinds[:self.num_layers - p])

    @property
    def scan_groups(self) -> int:
        """Whole periods in the model: a scan runs this many groups of `scan_period` stacked
        layers, then the few layers left (fewer than a period) one by one."""
        return self.num_layers // self.scan_period

    @property
    def scannable(self) -> bool:
        """Whether stacking helps: the layers repeat at least twice (or there is one)."""
        return self.scan_period == 1 or self.scan_groups >= 2

    def sparse_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is the mixture of experts."""
        return self.moe is not None and layer not in self.dense_layers


def as_eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def eos_token_ids(model_dir: Path, config_ids, tokenizer_eos_id: int | None) -> set[int]:
    """End-of-sequence ids from config.json (`config_ids`), generation_config.json and the
    tokenizer."""
    ids = set(config_ids)
    gen_path = Path(model_dir) / "generation_config.json"
    if gen_path.is_file():
        ids.update(as_eos_ids(json.loads(gen_path.read_text()).get("eos_token_id")))
    if tokenizer_eos_id is not None:
        ids.add(tokenizer_eos_id)
    return ids


def resolve_dtype(dtype: str, checkpoint_dtype: str | None) -> jnp.dtype:
    """The dtype the engine runs in: "float32" or "bfloat16"; "auto" keeps a bfloat16/float32
    checkpoint's dtype and runs float16 ones in bfloat16."""
    if dtype == "auto":
        dtype = "float32" if checkpoint_dtype == "float32" else "bfloat16"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {['auto', *DTYPES]}, got {dtype!r}")
    return jnp.dtype(dtype)


def with_quantization(cfg: ModelConfig, method: str | None, activations: bool = False,
                      platform: str | None = None, device_kind: str = "") -> ModelConfig:
    """`cfg` with the weight quantization a user asked for (`method` None: as the checkpoint
    is), checked against the `platform` ("cpu", "tpu", "gpu") and `device_kind` the programs
    will run on when given. On-load quantization covers every linear layer, the embedding and
    the lm head. A checkpoint already quantized keeps its own scheme; asking for another is a
    `ValueError`."""
    quantized = _quantization_asked(cfg, method, activations)
    if platform is not None:
        _check_platform(quantized.quantization, platform, device_kind)
    return quantized


def with_expert_parallel(cfg: ModelConfig, enabled: bool | None, tensor_parallel_size: int,
                         platform: str = "cpu") -> ModelConfig:
    """`cfg` with its experts split whole among the `tensor_parallel_size` devices of the
    "model" axis when `enabled` (`enable_expert_parallel`, vLLM's name; None: chosen by
    `expert_parallel_by_default` for `platform`). A dense model has no experts and is
    returned as it is; experts that do not divide evenly among the devices are a
    `ValueError`."""
    if cfg.moe is None:
        return cfg
    if enabled is None:
        enabled = expert_parallel_by_default(cfg.moe, tensor_parallel_size, platform)
    if not enabled:
        return cfg
    if cfg.moe.num_experts % tensor_parallel_size:
        raise ValueError(f"enable_expert_parallel: the {cfg.moe.num_experts} experts do not "
                         f"divide among tensor_parallel_size {tensor_parallel_size} devices")
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, expert_parallel=True))


def expert_parallel_by_default(moe: MoEConfig, tensor_parallel_size: int, platform: str
                               ) -> bool:
    """Whether experts go whole to the devices when the user does not say: on TPU, when the
    experts divide among the devices and each device's slice of an expert would not be a
    multiple of the 128 lanes (Qwen3-30B-A3B on 8 chips: 768 / 8 = 96 columns). Such slices
    are padded to whole lanes in every tile, a third of the gate and up stacks wasted there,
    while whole experts are as wide as the checkpoint's and their all-reduce is the same size
    (docs/models.md). Wide experts (Mixtral's 14336 / 8) keep the slices, which need fewer
    temporaries on TPU; GPU and CPU keep them too."""
    tp = tensor_parallel_size
    return (platform == "tpu" and tp > 1 and moe.num_experts % tp == 0
            and (moe.intermediate_size // tp) % TPU_LANES != 0)


def _quantization_asked(cfg: ModelConfig, method: str | None,
                        activations: bool) -> ModelConfig:
    if cfg.quantization is not None:
        if method is not None and method != cfg.quantization.method:
            raise ValueError(f"quantization={method!r}: this checkpoint is already quantized "
                             f"({cfg.quantization.method}); leave quantization unset or give "
                             "the same method")
        return dataclasses.replace(cfg, quantization=dataclasses.replace(
            cfg.quantization, activations=activations))
    if method is None:
        if activations:
            raise ValueError("quantize_activations needs quantization ('int8' or 'fp8')")
        return cfg
    return dataclasses.replace(cfg, quantization=WeightQuantization(method, (), activations))


def _check_platform(quant: WeightQuantization | None, platform: str,
                   device_kind: str = "") -> None:
    """`ValueError` (naming `quantization`) when the platform cannot run `quant`'s matmuls:
    fp8 x fp8 needs a GPU with fp8 tensor cores (compute capability 8.9+: L4, H100, H200)."""
    if quant is None or not quant.activations or quant.method != "fp8":
        return
    kind = device_kind.lower()
    if platform != "gpu" or not any(name in kind for name in ("h100", "h200", "h800", "l4",
                                                               "l40", "b200", "gh200")):
        raise ValueError(f"quantization: fp8 activations (fp8 x fp8 matmuls) need a GPU with "
                         f"fp8 tensor cores (H100, H200, L4, ...); this is {platform} "
                         f"{device_kind!r}. Use fp8 weights without activations, or int8.")
