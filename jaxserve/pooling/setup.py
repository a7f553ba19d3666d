"""Building an `LLM`'s `Pooler` (`runner="pooling"`): for a decoder, over the model the
generation engine loaded; for a BERT-family encoder, from its folder alone (it has no
paged KV cache, so no generation engine)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax

from jaxserve.config.engine import EngineConfig
from jaxserve.loading.tokenizer import Tokenizer
from jaxserve.model.bert import BertConfig
from jaxserve.model.config import resolve_dtype
from jaxserve.pooling.api import Pooler
from jaxserve.pooling.engine import PoolingEngine
from jaxserve.pooling.models import (decoder_runner, encoder_runner, hf_config_of,
                                     load_encoder)
from jaxserve.pooling.spec import is_encoder, pooler_spec
from jaxserve.presets import engine_settings


@dataclasses.dataclass(frozen=True)
class EncoderParts:
    """What an `LLM` over an encoder holds."""

    engine_config: EngineConfig
    tokenizer: Tokenizer | None
    pooler: Pooler


def is_encoder_folder(model_dir: Path) -> bool:
    return is_encoder(hf_config_of(model_dir))


def refuse_encoder(model_dir: Path) -> None:
    """A `ValueError` for an encoder folder where an engine is needed (the server): an
    encoder runs through `LLM.embed` / `LLM.score`, which need none."""
    if is_encoder_folder(model_dir):
        raise ValueError(f"runner: {model_dir.name} is a BERT-family encoder, which jaxserve "
                         "runs through LLM(...).embed / .score; the HTTP server serves "
                         "decoder pooling models (Qwen3-Embedding, gte-Qwen2, "
                         "Qwen3-Reranker)")


def engine_config_for_pooling(config: EngineConfig) -> EngineConfig:
    """A decoder's engine config with `runner="pooling"`: the generation engine beside the
    pooling runner only holds the weights, so unless `num_pages` is set its KV pool is the
    least the engine takes (one sequence and the padding page)."""
    if config.num_pages is not None:
        return config
    return dataclasses.replace(config, num_pages=1 + config.pages_per_seq)


def pooler_for_decoder(model_dir: Path, model, config: EngineConfig,
                       tokenizer: Tokenizer | None) -> Pooler:
    """The pooler over a decoder the engine loaded (`model`, in the engine's layout)."""
    spec = pooler_spec(model_dir, config.convert, config.pooler_config)
    runner = decoder_runner(model, spec, config, tokenizer)
    runner.warm_up()
    return Pooler(PoolingEngine(runner), spec, tokenizer)


def encoder_parts(model_dir: Path, dtype: str | None, preset: str | None,
                  engine_options: dict[str, Any], tokenizer_dir: Path | None
                  ) -> EncoderParts:
    """An encoder folder's engine options (on its preset; `max_model_len` defaults to the
    positions it has), weights, tokenizer and warmed-up pooler."""
    hf = hf_config_of(model_dir)
    limit = BertConfig.from_hf(hf).max_tokens
    preset_dtype, options = engine_settings(preset, jax.default_backend(), engine_options)
    config = EngineConfig(**{"max_model_len": limit, **options})
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len ({config.max_model_len}) exceeds the encoder's "
                         f"position table ({limit} tokens)")
    resolved = resolve_dtype(dtype or preset_dtype or "auto", hf.get("torch_dtype"))
    tokenizer_dir = tokenizer_dir or model_dir
    tokenizer = (Tokenizer(tokenizer_dir) if (tokenizer_dir / "tokenizer.json").is_file()
                 else None)
    spec = pooler_spec(model_dir, config.convert, config.pooler_config)
    runner = encoder_runner(load_encoder(model_dir, resolved), spec, config)
    runner.warm_up()
    return EncoderParts(config, tokenizer, Pooler(PoolingEngine(runner), spec, tokenizer))
