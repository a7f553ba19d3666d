"""Tiny random Hugging Face models and a tiny tokenizer, built with `transformers` and
`tokenizers` inside the tests (no hub access), saved as ordinary model folders.

Every parameter, norms and biases included, is randomised, so a wrong norm, bias or layout
shows up in the logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB = 320
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
# A Qwen2.5-style template (hermes tool calls): tools, assistant calls, tool results, and
# Qwen3's enable_thinking.
TOOLS_CHAT_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% else %}You help.{% endif %}

# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call as <tool_call>{"name": <name>, "arguments": <object>}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" %}<|im_start|>assistant
{%- if message.content %}
{{ message.content }}{% endif %}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif not (message.role == "system" and tools) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""

CORPUS = [
    "Once upon a time there was a little fox who lived in the forest.",
    "The quick brown fox jumps over the lazy dog. Héllo wörld, naïve café!",
    "Unicode: 日本語のテキスト, emoji 🦊🌲 and symbols ∑ ∫ √.",
] * 20

# Engine options that keep warm-up short on CPU: one step program and one decode loop (a CPU
# program of even a tiny model takes seconds to compile). Tests of how steps are padded to
# several buckets set ladders of their own (LADDERS, in tests/engine/test_engine.py).
SMALL_ENGINE = dict(max_model_len=128, page_size=16, num_pages=48, max_num_seqs=8,
                    max_num_batched_tokens=64, token_buckets=(64,), seq_buckets=(8,),
                    num_decode_steps=4)
# Two rungs of each ladder: 4 step programs and 2 decode loops.
LADDERS = dict(token_buckets=(16, 64), seq_buckets=(2, 8))

# name → (transformers config class, model class, extra config kwargs)
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True)),
    "llama_tied_headdim_rope3": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True, head_dim=32,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                             low_freq_factor=1.0, high_freq_factor=4.0,
                             original_max_position_embeddings=32))),
    "llama_yarn": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                             original_max_position_embeddings=32, beta_fast=16.0))),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=12)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict()),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48,
        norm_topk_prob=False)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4,
                                                            num_experts_per_tok=2)),
    # GLM-4.5's MoE: sigmoid routing in 2 groups of 3 (one kept), a correction bias, a
    # shared expert, the first layer dense, rope on half of head_dim, q/k norm
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        head_dim=16, n_routed_experts=6, num_experts_per_tok=2, n_group=2, topk_group=1,
        moe_intermediate_size=48, n_shared_experts=1, first_k_dense_replace=1,
        routed_scaling_factor=2.5, partial_rotary_factor=0.5, use_qk_norm=True,
        attention_bias=True)),
    # Gemma: caps small enough to bend these scores and logits, a query scale that is not
    # head_dim's, sliding and global layers alternating, prompts longer than the window
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=16, sliding_window=12, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0, attn_implementation="eager")),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=16, sliding_window=12, query_pre_attn_scalar=24, sliding_window_pattern=2,
        rope_parameters={
            "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=50000.0),
            "sliding_attention": dict(rope_type="default", rope_theta=1000.0)})),
    "qwen2_sliding": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        use_sliding_window=True, sliding_window=12, max_window_layers=1)),
    # gpt-oss: attention sinks, sliding and full layers alternating, YaRN, a router and
    # experts with biases, gate and up interleaved, the SwiGLU clamped low enough to bite
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=12,
        swiglu_limit=0.5, attn_implementation="eager",
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                             original_max_position_embeddings=32, beta_fast=16.0,
                             truncate=False))),
}
# Routers get weights this much larger than the rest, so that which experts a token picks
# (and their weights) changes from token to token and changes the output tokens.
ROUTER_SCALE = 20.0
# Weights scaled up per architecture so that a feature bites: Gemma 2's query and key
# projections, so that scores reach its attention cap (tanh is linear near 0).
# gpt-oss's sinks, so that they take a good share of each softmax.
WEIGHT_SCALES = {"gemma2": {"q_proj": 6.0, "k_proj": 6.0}, "gpt_oss": {"sinks": 40.0}}


def build_tokenizer(folder: Path) -> None:
    """Train a byte-level BPE on a few sentences; write tokenizer.json and its config."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 8, special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": CHAT_TEMPLATE}))


def is_router(name: str) -> bool:
    """Whether the parameter called `name` is a mixture-of-experts router."""
    return ((name.endswith(".gate.weight") and ".experts." not in name)
            or name.endswith(".router.weight"))


def build_model(name: str, folder: Path, seed: int = 0, num_layers: int = 2, **overrides):
    """Save a random model of architecture `name` (see ARCHITECTURES) with a tokenizer;
    `overrides` replace config fields."""
    architecture = name
    config_cls, model_cls, extra = ARCHITECTURES[name]
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, bos_token_id=0, eos_token_id=1,
                  rms_norm_eps=1e-5)
    kwargs.update(extra)
    kwargs.update(overrides)
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    scales = WEIGHT_SCALES.get(architecture, {})
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.add_(0.05 * torch.randn_like(param))
            if is_router(name):
                param.mul_(ROUTER_SCALE)
            for part, scale in scales.items():
                if f".{part}." in name or name.endswith(f".{part}"):
                    param.mul_(scale)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # enough to change the choice
                buffer.copy_(0.3 * torch.randn_like(buffer))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    build_tokenizer(folder)
    return model


def on_grid(shape, method: str, rng) -> np.ndarray:
    """Random weights that quantization `method` stores exactly: each row's largest |value|
    is the top code times 2^-9 and every value a code times 2^-9 (rows are output channels)."""
    if method == "int8":
        codes = rng.integers(-127, 128, size=shape).astype(np.float32)
        codes[:, 0] = 127.0
    else:
        codes = np.clip(rng.normal(scale=60.0, size=shape), -448, 448).astype(
            ml_dtypes.float8_e4m3fn).astype(np.float32)
        codes[:, 0] = 448.0
    return codes * 2.0 ** -9


def put_on_grid(hf_model, method: str, seed: int = 0) -> None:
    """Every Linear weight, every expert's and the embedding of `hf_model` moved onto the
    method's grid (routers, which stay unquantized, as they are)."""
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if param.ndim == 2 and not is_router(name):  # [out, in] and the [V, E] embedding
                param.copy_(torch.from_numpy(on_grid(tuple(param.shape), method, rng)))
            elif param.ndim == 3:  # stacked experts [X, out, in]
                param.copy_(torch.from_numpy(np.stack(
                    [on_grid(tuple(param.shape[1:]), method, rng) for _ in param])))


def transformers_greedy(hf_model, prompt: list[int], count: int) -> list[int]:
    """transformers' own greedy continuation of `prompt`: `count` tokens, eos ignored (the
    reference the engine's tokens are held to)."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=count,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
