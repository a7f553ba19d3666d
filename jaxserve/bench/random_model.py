"""The benchmarks' default model: a random Llama of about 60M parameters (hidden 512, 8 layers,
8 heads, 4 kv heads, vocab 32000), written as a Hugging Face folder with numpy and
safetensors alone, so a benchmark that needs no baseline needs no torch.

Weights are drawn as transformers initialises a Llama (normal, std 0.02; norms 1), so every
engine that reads the folder (jaxserve, transformers, vLLM) runs the same model at the same
cost. The tokenizer is word-level (token i is the word "w<i>"), so served text streams token
by token.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
          "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
          "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
          "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
          "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
          "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}


def random_llama_weights(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """HF-named float32 tensors (`[out, in]` for projections) of a random Llama."""
    rng = np.random.default_rng(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config["head_dim"]
    q_out = config["num_attention_heads"] * head_dim
    kv_out = config["num_key_value_heads"] * head_dim
    normal = lambda *shape: (0.02 * rng.standard_normal(shape, np.float32))  # noqa: E731
    ones = lambda n: np.ones(n, np.float32)  # noqa: E731
    weights = {"model.embed_tokens.weight": normal(config["vocab_size"], hidden),
               "model.norm.weight": ones(hidden),
               "lm_head.weight": normal(config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        weights.update({
            layer + "self_attn.q_proj.weight": normal(q_out, hidden),
            layer + "self_attn.k_proj.weight": normal(kv_out, hidden),
            layer + "self_attn.v_proj.weight": normal(kv_out, hidden),
            layer + "self_attn.o_proj.weight": normal(hidden, q_out),
            layer + "mlp.gate_proj.weight": normal(inter, hidden),
            layer + "mlp.up_proj.weight": normal(inter, hidden),
            layer + "mlp.down_proj.weight": normal(hidden, inter),
            layer + "input_layernorm.weight": ones(hidden),
            layer + "post_attention_layernorm.weight": ones(hidden)})
    return weights


def build_random_model(folder: Path, seed: int = 0, config: dict | None = None) -> None:
    """Write the random ~60M Llama (or one of `config`, a Llama config.json's fields) and its
    word-level tokenizer into `folder`."""
    config = CONFIG if config is None else config
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(random_llama_weights(config, seed), str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    vocab = config["vocab_size"]
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
