"""`LLM`: the Python entry point, shaped like vLLM's so users know it.

    from jaxserve import LLM, SamplingParams
    llm = LLM(model="path/to/hf_folder", dtype="bfloat16")
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    print(out[0].outputs[0].text)

Prompts are strings (tokenized with the model's tokenizer) or `{"prompt_token_ids": [...]}`.
Generation currently runs on the dense reference path (`DenseGenerator`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from jaxserve.config import load_config
from jaxserve.dense_generation import DenseGenerator
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampler import SamplingArrays
from jaxserve.sampling_params import SamplingParams
from jaxserve.stop_strings import find_stop
from jaxserve.tokenizer import IncrementalDetokenizer, Tokenizer
from jaxserve.weights import load_weights

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
ENGINE_OPTIONS = ("max_model_len", "max_num_seqs")


def resolve_dtype(dtype: str, checkpoint_dtype: str | None):
    """"auto" keeps a bfloat16/float32 checkpoint's dtype and runs float16 ones in bfloat16."""
    if dtype == "auto":
        dtype = "float32" if checkpoint_dtype == "float32" else "bfloat16"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {['auto', *DTYPES]}, got {dtype!r}")
    return DTYPES[dtype]


def _eos_ids(model_dir: Path, config_ids, tokenizer: Tokenizer | None) -> set[int]:
    """End-of-sequence ids from config.json, generation_config.json and the tokenizer."""
    ids = set(config_ids)
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        value = json.loads(gen_path.read_text()).get("eos_token_id")
        ids.update([value] if isinstance(value, int) else (value or []))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class LLM:
    """Loads a Hugging Face model folder and generates from Python."""

    def __init__(self, model: str, dtype: str = "auto", seed: int = 0, progress: bool = True,
                 **engine_options: Any):
        unknown = sorted(set(engine_options) - set(ENGINE_OPTIONS))
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known: {list(ENGINE_OPTIONS)}")
        model_dir = Path(model)
        if not model_dir.is_dir():
            raise ValueError(f"model {model!r} is not a folder")
        self.config = load_config(model_dir)
        self.dtype = resolve_dtype(dtype, self.config.checkpoint_dtype)
        has_tokenizer = (model_dir / "tokenizer.json").is_file()
        self.tokenizer = Tokenizer(model_dir) if has_tokenizer else None
        self.eos_token_ids = _eos_ids(model_dir, self.config.eos_token_ids, self.tokenizer)
        self.max_model_len = _positive_option(
            engine_options, "max_model_len", self.config.max_position_embeddings)
        if self.max_model_len > self.config.max_position_embeddings:
            raise ValueError(f"max_model_len ({self.max_model_len}) exceeds the model's "
                             f"max_position_embeddings ({self.config.max_position_embeddings})")
        self.max_num_seqs = _positive_option(engine_options, "max_num_seqs", 64)
        self._seed_rng = np.random.default_rng(seed)
        self._next_request = 0
        weights = load_weights(model_dir, self.config, self.dtype, progress=progress)
        self.generator = DenseGenerator(weights)

    # ---- prompts ----------------------------------------------------------------------
    def _prompt_ids(self, prompt, index: int) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"prompts[{index}] is empty")
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer.json: pass prompts as "
                                 "{'prompt_token_ids': [...]}")
            ids = self.tokenizer.encode(prompt)
            text = prompt
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids, text = list(prompt["prompt_token_ids"]), prompt.get("prompt")
            bad = [t for t in ids if not isinstance(t, (int, np.integer))
                   or not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValueError(f"prompts[{index}].prompt_token_ids has ids outside "
                                 f"[0, {self.config.vocab_size}): {bad[:5]}")
        else:
            raise ValueError(f"prompts[{index}] must be a str or a dict with 'prompt_token_ids'")
        if not ids:
            raise ValueError(f"prompts[{index}] has no tokens")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompts[{index}] has {len(ids)} tokens; max_model_len is "
                             f"{self.max_model_len} (prompt plus at least one new token)")
        return text, [int(t) for t in ids]

    # ---- generation -------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None) -> list[RequestOutput]:
        """One `RequestOutput` per prompt, in order."""
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
        encoded = [self._prompt_ids(p, i) for i, p in enumerate(prompts)]
        results = []
        for start in range(0, len(prompts), self.max_num_seqs):
            chunk = slice(start, start + self.max_num_seqs)
            results += self._generate_batch(encoded[chunk], params[chunk])
        return results

    def chat(self, messages, sampling_params: SamplingParams | None = None
             ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of messages) or a list of them."""
        if self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer.json, so no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.tokenizer.encode_chat(c),
                    "prompt": self.tokenizer.apply_chat_template(c)} for c in conversations]
        return self.generate(prompts, sampling_params)

    def _generate_batch(self, encoded, params) -> list[RequestOutput]:
        max_new = [min(p.max_tokens or self.max_model_len, self.max_model_len - len(ids))
                   for (_, ids), p in zip(encoded, params)]
        stop_ids = [sorted(set(p.stop_token_ids) | (set() if p.ignore_eos
                                                      else self.eos_token_ids))
                    for p in params]
        seeds = [p.seed if p.seed is not None else int(self._seed_rng.integers(2**32))
                 for p in params]
        generated = self.generator.generate(
            [ids for _, ids in encoded], max_new, stop_ids,
            lambda rows: SamplingArrays.from_params(params, seeds, rows))
        outputs = []
        for (text, ids), p, (new_ids, hit_stop) in zip(encoded, params, generated):
            outputs.append(RequestOutput(
                request_id=str(self._next_request), prompt=text, prompt_token_ids=ids,
                outputs=[self._completion(new_ids, hit_stop, p)]))
            self._next_request += 1
        return outputs

    def _completion(self, token_ids: list[int], hit_stop: bool,
                    params: SamplingParams) -> CompletionOutput:
        """Detokenize, cutting at the first stop string if one appears."""
        if self.tokenizer is None:
            return CompletionOutput(0, "", token_ids, "stop" if hit_stop else "length")
        detok = IncrementalDetokenizer(self.tokenizer)
        for count, token in enumerate(token_ids, start=1):
            delta = detok.add([token])
            cut = find_stop(detok.text, len(delta), params.stop) if params.stop else None
            if cut is not None:
                return CompletionOutput(0, detok.text[:cut], token_ids[:count], "stop")
        text = self.tokenizer.decode(token_ids)
        return CompletionOutput(0, text, token_ids, "stop" if hit_stop else "length")


def _positive_option(options: dict, name: str, default: int) -> int:
    value = options.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value
