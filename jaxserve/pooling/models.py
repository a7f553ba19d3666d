"""What the pooling runner runs for each kind of model: a decoder from the engine's
`LlamaModel` (causal attention within each packed sequence) or a BERT-family encoder read
from its folder here (bidirectional attention), and the `PoolingRunner` built for it."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config.engine import EngineConfig
from jaxserve.loading.tokenizer import Tokenizer
from jaxserve.loading.weights import mapped_tensors, safetensors_files
from jaxserve.model.bert import BertConfig, BertModel
from jaxserve.model.contract import StepContext
from jaxserve.pooling.program import PackedSequences, segment_attention
from jaxserve.pooling.reranker import yes_no_token_ids
from jaxserve.pooling.runner import PoolingRunner
from jaxserve.pooling.spec import PoolerSpec

# prefixes of encoder tensors saved from a model with a head (BertForMaskedLM, ...)
_ENCODER_PREFIXES = ("bert.", "roberta.", "model.")


def _empty_cache(model) -> list | tuple:
    """A KV cache of nothing in the model's layer layout (the pooling attention keeps
    none)."""
    if model.scan_layers:
        return [None] * model.config.scan_period, [None] * len(model.tail)
    return [None] * model.config.num_layers


def decoder_forward(model, batch: PackedSequences) -> jax.Array:
    """A decoder's final hidden states `[T, E]` (after its final norm), attention causal
    within each packed sequence."""
    step = StepContext(segment_attention(batch, causal=True))
    return model(batch.token_ids, batch.positions, _empty_cache(model), step).hidden


def encoder_forward(model: BertModel, batch: PackedSequences) -> jax.Array:
    """An encoder's last hidden states `[T, E]`, attention over each whole sequence."""
    return model(batch.token_ids, batch.positions,
                 segment_attention(batch, causal=False))


def load_encoder(model_dir: str | Path, dtype=jnp.float32) -> BertModel:
    """A BERT / XLM-RoBERTa folder's encoder (safetensors; heads' tensors ignored)."""
    model_dir = Path(model_dir)
    cfg = BertConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    tensors: dict[str, np.ndarray] = {}
    for file in safetensors_files(model_dir):
        for name, array in mapped_tensors(file):
            for prefix in _ENCODER_PREFIXES:
                name = name.removeprefix(prefix)
            tensors[name] = np.asarray(array, np.float32)
    try:
        return BertModel(cfg, tensors, dtype)
    except KeyError as err:
        raise ValueError(f"{model_dir.name}: encoder tensor {err} is missing") from None


def decoder_runner(model, spec: PoolerSpec, config: EngineConfig,
                   tokenizer: Tokenizer | None) -> PoolingRunner:
    """The runner of a decoder (the engine's model), a reranker's yes/no tokens found in
    its tokenizer."""
    yes_no = yes_no_token_ids(tokenizer) if spec.task == "classify" else None
    return PoolingRunner(model, decoder_forward, spec, config.token_buckets,
                         config.seq_buckets, config.max_model_len, yes_no,
                         share_prefixes=config.enable_prefix_caching)


def encoder_runner(model: BertModel, spec: PoolerSpec, config: EngineConfig
                   ) -> PoolingRunner:
    """The runner of a BERT-family encoder."""
    return PoolingRunner(model, encoder_forward, spec, config.token_buckets,
                         config.seq_buckets, config.max_model_len,
                         position_offset=model.config.position_offset)


def hf_config_of(model_dir: Path) -> dict:
    """The folder's `config.json` (empty for a folder without one, e.g. orbax)."""
    path = model_dir / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}
