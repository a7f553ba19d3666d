"""`LLM`: the Python entry point, shaped like vLLM's so users know it.

    from jaxserve import LLM, SamplingParams
    llm = LLM(model="path/to/hf_folder", dtype="bfloat16")
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    print(out[0].outputs[0].text)

`model` is a Hugging Face folder (safetensors), a Hub id (`ORG/NAME[@REVISION]`, through the
local Hugging Face cache; see `jaxserve.loading.hub`) or an orbax checkpoint folder written by
`jaxserve.loading.checkpoint.convert`; either way each device receives only its shard of the weights
on the mesh that `tensor_parallel_size` / `data_parallel_size` describe.
Prompts are strings (tokenized with the model's tokenizer), `{"prompt": str}` or
`{"prompt_token_ids": [...]}`, as in vLLM; a dict may also carry `cache_salt` (its prefix-cache
pages are shared only with prompts of the same salt).
Generation runs through the serving engine (paged KV cache, continuous batching); engine
options are keyword arguments, named as in vLLM (see `EngineConfig`), on top of the platform's
preset (cpu.toml on CPU; `config=` names another, see `jaxserve.presets`).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np

from jaxserve.loading import checkpoint
from jaxserve.loading.hub import resolve_model
from jaxserve.model.config import (ModelConfig, eos_token_ids, resolve_dtype,
                                   with_expert_parallel, with_quantization)
from jaxserve.engine.engine import Engine
from jaxserve.engine.engine_setup import engine_mesh
from jaxserve.config.engine import EngineConfig
from jaxserve.errors import InvalidRequestError
from jaxserve.outputs import RequestOutput
from jaxserve.pooling.api import PoolingAPI
from jaxserve.pooling.setup import (encoder_parts, engine_config_for_pooling,
                                    is_encoder_folder, pooler_for_decoder, refuse_encoder)
from jaxserve.presets import engine_settings
from jaxserve.sampling_params import SamplingParams
from jaxserve.speculative import eagle3
from jaxserve.speculative.draft import draft_config, load_draft
from jaxserve.loading.tokenizer import Tokenizer
from jaxserve.loading.weights import load_weights
from jaxserve.lora.request import LoRARequest
from jaxserve.platforms import choose_jax_platforms

# As the command line does, before any backend starts: JAX looks only for the chips this host
# has, so a CPU machine with the `aot` extra installed does not probe libtpu and the CUDA
# plugin and print their failures.
choose_jax_platforms()

ENGINE_OPTIONS = tuple(f.name for f in dataclasses.fields(EngineConfig))


def engine_config_for(config: ModelConfig, engine_options: dict[str, Any]) -> EngineConfig:
    """The engine options checked against each other and the model (`max_model_len`
    defaults to the model's `max_position_embeddings` and may not exceed it)."""
    unknown = sorted(set(engine_options) - set(ENGINE_OPTIONS))
    if unknown:
        raise ValueError(f"unknown engine option(s) {unknown}; known: {list(ENGINE_OPTIONS)}")
    limit = config.max_position_embeddings
    engine_config = EngineConfig(**{"max_model_len": limit, **engine_options})
    if engine_config.max_model_len > limit:
        raise ValueError(f"max_model_len ({engine_config.max_model_len}) exceeds the "
                         f"model's max_position_embeddings ({limit})")
    return engine_config


@dataclasses.dataclass(frozen=True)
class Settings:
    """What an `LLM` is built from, resolved and checked before any weight is read."""

    model_dir: Path
    model_config: ModelConfig
    dtype: Any
    engine_config: EngineConfig


def resolve_settings(model: str, dtype: str | None, config: str | None,
                     engine_options: dict[str, Any]) -> Settings:
    """The model folder's config, the preset with the options on top, and the engine config
    they make, checked against each other (`ValueError` naming what is wrong). Cheap: what
    `jaxserve serve` runs before it opens its socket."""
    model_dir = resolve_model(model)
    if engine_options.get("runner") == "pooling":
        refuse_encoder(model_dir)
    model_config = checkpoint.model_config(model_dir)
    preset_dtype, engine_options = engine_settings(config, jax.default_backend(),
                                                   engine_options)
    resolved_dtype = resolve_dtype(dtype or preset_dtype or "auto", model_config.checkpoint_dtype)
    engine_config = engine_config_for(model_config, engine_options)
    if engine_config.runner == "pooling":
        engine_config = engine_config_for_pooling(engine_config)
    spec = engine_config.speculative_config
    if spec is not None and spec.method == "draft_model":
        draft_config(spec, model_config)  # the draft's folder and vocabulary, checked early
    if spec is not None and spec.method == "eagle3":
        spec = eagle3.with_head(spec, model_dir)
        engine_config = dataclasses.replace(engine_config, speculative_config=spec)
        eagle3.read_config(spec, model_config)  # the head's folder and shapes, checked early
    first = jax.devices()[0]
    model_config = with_quantization(model_config, engine_config.quantization,
                                     engine_config.quantize_activations, first.platform,
                                     first.device_kind)
    model_config = with_expert_parallel(model_config, engine_config.enable_expert_parallel,
                                        engine_config.tensor_parallel_size, first.platform)
    return Settings(model_dir, model_config, resolved_dtype, engine_config)


class LLM(PoolingAPI):
    """Loads a Hugging Face model folder (or orbax checkpoint) and generates from Python;
    with `runner="pooling"` it embeds and scores instead (`embed`, `score`:
    `jaxserve.pooling`)."""

    def __init__(self, model: str, dtype: str | None = None, config: str | None = None,
                 progress: bool = True, tokenizer: str | None = None, seed: int = 0,
                 **engine_options: Any):
        """`config`: a deployment preset (TOML); default: cpu.toml on CPU, none elsewhere.
        `dtype` and `engine_options` override the preset's. As vLLM's: `tokenizer`, a folder
        or Hub id to take the tokenizer from instead of the model's; `seed`, of the random
        draws of requests that give no seed of their own."""
        self.pooler = None
        self._request_ids = itertools.count()
        if engine_options.get("runner") == "pooling" and is_encoder_folder(
                resolve_model(model)):  # a BERT-family encoder: a pooler, no engine
            self.model_dir = resolve_model(model)
            parts = encoder_parts(self.model_dir, dtype, config, engine_options,
                                  None if tokenizer is None else resolve_model(tokenizer))
            self.engine_config, self.tokenizer = parts.engine_config, parts.tokenizer
            self.pooler, self.engine, self.config = parts.pooler, None, None
            return
        settings = resolve_settings(model, dtype, config, engine_options)
        model_dir = settings.model_dir
        self.model_dir = model_dir  # the folder it was loaded from (a Hub id's snapshot)
        self.config, self.dtype = settings.model_config, settings.dtype
        self.engine_config = settings.engine_config
        tokenizer_dir = model_dir if tokenizer is None else resolve_model(tokenizer)
        has_tokenizer = tokenizer is not None or (model_dir / "tokenizer.json").is_file()
        self.tokenizer = Tokenizer(tokenizer_dir) if has_tokenizer else None
        mesh = engine_mesh(self.engine_config)
        started = time.perf_counter()
        if checkpoint.is_checkpoint(model_dir):
            self.model = checkpoint.restore(model_dir, self.config, self.dtype, mesh)
        else:
            self.model = load_weights(model_dir, self.config, self.dtype, progress=progress,
                                      mesh=mesh)
        spec = self.engine_config.speculative_config
        draft = None
        if spec is not None and spec.method == "draft_model":
            draft = load_draft(spec, self.config, self.dtype, mesh, progress)
        elif spec is not None and spec.method == "eagle3":
            draft = eagle3.load_head(spec, self.config, self.dtype)
        eos = eos_token_ids(model_dir, self.config.eos_token_ids,
                            self.tokenizer.eos_token_id if self.tokenizer else None)
        self.engine = Engine(self.model, self.engine_config, self.tokenizer, eos, progress,
                             load_seconds=time.perf_counter() - started, draft=draft)
        self.model = self.engine.model  # the engine's layout (stacked layers consume the list)
        self.engine.reseed(seed)
        if self.engine_config.runner == "pooling":
            self.pooler = pooler_for_decoder(model_dir, self.model, self.engine_config,
                                             self.tokenizer)

    # ---- prompts ----------------------------------------------------------------------
    def _prompt_ids(self, prompt, index: int) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and "prompt" in prompt:
            prompt = prompt["prompt"]  # a text prompt given as vLLM's TextPrompt
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", f"prompts[{index}] is empty")
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer.json: pass prompts as "
                                 "{'prompt_token_ids': [...]}")
            ids = self.tokenizer.encode(prompt)
            text = prompt
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids, text = list(prompt["prompt_token_ids"]), prompt.get("prompt")
            if not all(isinstance(t, (int, np.integer)) for t in ids):
                raise InvalidRequestError("prompt", f"prompts[{index}].prompt_token_ids must be "
                                          "integers")
        else:
            raise InvalidRequestError("prompt", f"prompts[{index}] must be a str or a dict "
                                      "with 'prompt' or 'prompt_token_ids'")
        return text, ids

    def _sequence(self, index: int, prompt, params: SamplingParams,
                  lora_request: LoRARequest | None = None):
        text, ids = self._prompt_ids(prompt, index)
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        try:
            lora = None if lora_request is None else self.engine.load_lora(lora_request)
            return self.engine.make_sequence(str(next(self._request_ids)), ids, params, text,
                                             salt, lora)
        except ValueError as err:
            raise InvalidRequestError(getattr(err, "field", None),
                                      f"prompts[{index}]: {err}") from None

    # ---- generation -------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, lora_request: LoRARequest | Sequence[LoRARequest | None]
                 | None = None) -> list[RequestOutput]:
        """One `RequestOutput` per prompt, in order. `lora_request` (with `enable_lora`): the
        adapter of every prompt, or one per prompt (None: the base model); an adapter's
        folder is read the first time it is named."""
        if self.pooler is not None:
            raise ValueError("this LLM was built with runner='pooling': it embeds and scores "
                             "(embed, score) and does not generate")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts is empty")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params has {len(params)} entries for "
                                 f"{len(prompts)} prompts")
        params = [dataclasses.replace(p, output_kind="final_only") for p in params]
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"lora_request has {len(loras)} entries for {len(prompts)} "
                                 "prompts")
        sequences = [self._sequence(i, prompt, p, lora)
                     for i, (prompt, p, lora) in enumerate(zip(prompts, params, loras))]
        for seq in sequences:  # all validated before any is queued
            self.engine.enqueue(seq)
        while self.engine.has_unfinished():
            self.engine.step()
        return [self.engine.pop_output(seq) for seq in sequences]

    def chat(self, messages, sampling_params: SamplingParams | None = None, *,
             tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of messages) or a list of them.
        `tools` (OpenAI's function entries) and `chat_template_kwargs` reach the chat
        template, as in vLLM's `LLM.chat`; the reply is text (the HTTP server parses calls)."""
        if self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer.json, so no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        texts = [self.tokenizer.apply_chat_template(c, tools=tools,
                                                    template_kwargs=chat_template_kwargs)
                 for c in conversations]
        prompts = [{"prompt_token_ids": self.tokenizer.encode(t, add_special_tokens=False),
                    "prompt": t} for t in texts]
        return self.generate(prompts, sampling_params)
