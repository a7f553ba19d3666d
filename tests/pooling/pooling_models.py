"""Tiny random pooling models saved as sentence-transformers folders (`modules.json`, a
Pooling module's config, optionally Normalize), built with `transformers` inside the tests:
a decoder (Qwen3 or Qwen2 architecture) and BERT / XLM-RoBERTa encoders. The weights are
scaled up so the hidden states of different tokens differ widely, and a wrong pooling,
attention mask or position shows up in the cosines."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from tiny_models import CORPUS, VOCAB, build_model

TEXTS = ["Once upon a time there was a little fox.", "The quick brown fox",
         "Héllo wörld, naïve café!", "a", "Unicode: 日本語のテキスト, emoji 🦊🌲 and symbols"]
ATTENTION_SCALE = 4.0
_ST_MODES = {"LAST": "pooling_mode_lasttoken", "MEAN": "pooling_mode_mean_tokens",
             "CLS": "pooling_mode_cls_token"}


def write_tokenizer(folder: Path, cls_sep: bool = False) -> None:
    """A byte-level BPE whose vocabulary has "yes" and "no" as single tokens; with
    `cls_sep`, a BERT-style post-processor that wraps each text in <s> ... </s>."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 8, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens(["yes", "no"])  # a reranker's answers, one token each
    if cls_sep:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", pair="<s> $A </s> $B </s>",
            special_tokens=[("<s>", 0), ("</s>", 1)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        "tokenizer_class": "PreTrainedTokenizerFast"}))


def write_sentence_transformers(folder: Path, pooling: str, normalize: bool,
                                hidden: int) -> None:
    """`modules.json` (Transformer, Pooling, Normalize if asked) and the Pooling config."""
    modules = [{"idx": 0, "name": "0", "path": "", "type":
                "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type":
                "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type":
                        "sentence_transformers.models.Normalize"})
        (folder / "2_Normalize").mkdir(exist_ok=True)
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128}))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    config = {"word_embedding_dimension": hidden, **{m: False for m in _ST_MODES.values()}}
    config[_ST_MODES[pooling]] = True
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(config))


def _scale(model: torch.nn.Module, factor: float, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for _, param in model.named_parameters():
            param.add_(factor * torch.randn_like(param))


def build_decoder(folder: Path, architecture: str, pooling: str, normalize: bool,
                  **config_overrides) -> None:
    """A tiny Qwen3 / Qwen2 causal LM as a sentence-transformers folder, its attention
    scaled up so that what a token attends to moves its hidden state."""
    model = build_model(architecture, folder, max_position_embeddings=256, **config_overrides)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(f".{part}." in name for part in ("q_proj", "k_proj", "v_proj", "o_proj")):
                param.mul_(ATTENTION_SCALE)
    model.save_pretrained(folder)
    write_tokenizer(folder)
    write_sentence_transformers(folder, pooling, normalize, hidden=64)


def build_encoder(folder: Path, model_type: str, pooling: str, normalize: bool) -> None:
    """A tiny BERT or XLM-RoBERTa encoder (`AutoModel`) as a sentence-transformers folder."""
    folder.mkdir(parents=True, exist_ok=True)
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                  num_attention_heads=4, intermediate_size=128, max_position_embeddings=131,
                  type_vocab_size=2, pad_token_id=2)  # <pad> of `write_tokenizer`
    if model_type == "bert":
        config = transformers.BertConfig(**common)
        model = transformers.BertModel(config, add_pooling_layer=False)
    else:
        config = transformers.XLMRobertaConfig(**common)
        model = transformers.XLMRobertaModel(config, add_pooling_layer=False)
    _scale(model.eval(), 0.3, seed=1)
    model.save_pretrained(folder)
    write_tokenizer(folder, cls_sep=True)
    write_sentence_transformers(folder, pooling, normalize, hidden=64)
