"""Request defaults from a model's `generation_config.json`, as vLLM's `--generation-config`.

`auto` (the default) reads the model folder's file, a folder reads that folder's, `vllm`
reads none. Of the file, the sampling fields vLLM takes are kept (temperature, top_p, top_k,
min_p, repetition_penalty, and max_new_tokens as max_tokens), and only those that differ
from transformers' `GenerationConfig` defaults (vLLM reads the file's diff against them: a
`top_k` of 50 is transformers' default, not the model's choice). `do_sample` is ignored, as
vLLM ignores it. A request's own field always wins; a defaulted max_tokens applies to chat
only (a completion's max_tokens defaults to 16 in OpenAI's API) and is capped at the room
the prompt leaves.
"""

from __future__ import annotations

import json
from pathlib import Path

# vLLM's fields of a generation config → transformers' default for each (None: no default)
FIELDS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None,
          "repetition_penalty": 1.0, "max_new_tokens": None}


def read_generation_defaults(setting: str, model_dir: str | Path) -> dict:
    """The request defaults `setting` (`auto`, `vllm` or a folder) gives the model in
    `model_dir`: request field → value (`max_tokens` for max_new_tokens)."""
    if setting == "vllm":
        return {}
    folder = Path(model_dir) if setting == "auto" else Path(setting).expanduser()
    if setting != "auto" and not folder.is_dir():
        raise ValueError(f"--generation-config {setting!r}: expected auto, vllm or a folder "
                         "holding generation_config.json")
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON: {err}") from None
    defaults = {}
    for name, hf_default in FIELDS.items():
        value = config.get(name)
        if value is not None and value != hf_default:
            defaults["max_tokens" if name == "max_new_tokens" else name] = value
    return defaults


def with_defaults(body, defaults: dict):
    """A copy of request `body` with `defaults` in the fields the client left out (a chat
    request's max_tokens default, if any, kept aside as a cap: `default_max_tokens`)."""
    if not defaults:
        return body
    chat = hasattr(body, "messages")
    update = {name: value for name, value in defaults.items()
              if name != "max_tokens" and name not in body.model_fields_set}
    copy = body.model_copy(update=update)
    if chat and not {"max_tokens", "max_completion_tokens"} & body.model_fields_set:
        copy._default_max_tokens = defaults.get("max_tokens")
    return copy
