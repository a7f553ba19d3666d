"""Tiny random Hugging Face models and a tiny tokenizer, built with `transformers` and
`tokenizers` inside the tests (no hub access), saved as ordinary model folders.

Every parameter, norms and biases included, is randomised, so a wrong norm, bias or layout
shows up in the logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB = 320
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
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
}


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


def build_model(name: str, folder: Path, seed: int = 0, num_layers: int = 2, **overrides):
    """Save a random model of architecture `name` (see ARCHITECTURES) with a tokenizer;
    `overrides` replace config fields."""
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
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    build_tokenizer(folder)
    return model
