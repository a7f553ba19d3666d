"""How a pooling model turns a sequence's hidden states into one vector: the `PoolerSpec`.

Read as vLLM reads it: from the sentence-transformers files in the model folder
(`modules.json` naming a `Pooling` module whose `config.json` says the mode, and a
`Normalize` module), else the architecture's default (decoders: last token, normalized;
encoders: CLS, normalized; rerankers: last token, a yes/no score), then `--pooler-config`
(vLLM's keys `pooling_type` LAST | MEAN | CLS and `normalize`) on top.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

POOLING_TYPES = ("LAST", "MEAN", "CLS")
RUNNERS = ("generate", "pooling")
CONVERTS = ("auto", "embed", "classify")
# sentence-transformers' `pooling_mode_*` flags → vLLM's pooling types
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
             "pooling_mode_cls_token": "CLS"}
_ENCODER_TYPES = ("bert", "xlm-roberta", "roberta")


@dataclasses.dataclass(frozen=True)
class PoolerSpec:
    """What a pooling model returns per sequence.

    `task` "embed": a vector of the hidden size (`pooling_type` over the sequence, then
    L2-normalized if `normalize`); "classify": one score, the sigmoid of a logit (a
    Qwen3-Reranker's yes-vs-no logit difference, `jaxserve.pooling.reranker`).
    `matryoshka`: the model was trained so that any leading slice of its vector is an
    embedding (`dimensions` may cut it; vLLM's `is_matryoshka`)."""

    pooling_type: str = "LAST"
    normalize: bool = True
    task: str = "embed"
    matryoshka: bool = False

    def __post_init__(self):
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got "
                             f"{self.pooling_type!r}")
        if self.task not in ("embed", "classify"):
            raise ValueError(f"task must be embed or classify, got {self.task!r}")


def is_encoder(hf_config: dict[str, Any]) -> bool:
    """Whether the folder's model is a bidirectional encoder (BERT, XLM-RoBERTa)."""
    return hf_config.get("model_type") in _ENCODER_TYPES


def is_qwen3_reranker(hf_config: dict[str, Any]) -> bool:
    """A Qwen3-Reranker: a causal LM scored by its "yes" and "no" logits (its folder says so
    through `architectures`, or `is_original_qwen3_reranker` as vLLM's hf-overrides set)."""
    return bool(hf_config.get("is_original_qwen3_reranker")) or any(
        "Reranker" in a for a in hf_config.get("architectures") or ())


def _sentence_transformers_spec(model_dir: Path) -> dict[str, Any]:
    """`pooling_type` and `normalize` from `modules.json` and its Pooling module's config,
    or {} when the folder has no sentence-transformers files."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return {}
    modules = json.loads(modules_file.read_text())
    found: dict[str, Any] = {"normalize": any(
        m.get("type", "").endswith("Normalize") for m in modules)}
    for module in modules:
        if module.get("type", "").endswith("Pooling"):
            config = json.loads((model_dir / module["path"] / "config.json").read_text())
            chosen = [kind for key, kind in _ST_MODES.items() if config.get(key)]
            if len(chosen) != 1:
                raise ValueError(f"{module['path']}/config.json: jaxserve pools by one of "
                                 f"{sorted(_ST_MODES)}, this config sets {chosen or 'none'}")
            found["pooling_type"] = chosen[0]
    return found


def pooler_spec(model_dir: str | Path, convert: str = "auto",
                pooler_config: dict[str, Any] | None = None) -> PoolerSpec:
    """The folder's `PoolerSpec`: defaults by architecture, the sentence-transformers files,
    then `pooler_config` (vLLM's `--pooler-config` keys) on top. `convert` "classify" or a
    Qwen3-Reranker folder makes a yes/no scorer."""
    model_dir = Path(model_dir)
    hf = json.loads((model_dir / "config.json").read_text())
    reranker = convert == "classify" or (convert == "auto" and is_qwen3_reranker(hf))
    if reranker and is_encoder(hf):
        raise ValueError("convert: classify turns a causal LM into a yes/no reranker; "
                         f"a {hf.get('model_type')} encoder has no language-model head")
    fields: dict[str, Any] = dict(
        pooling_type="CLS" if is_encoder(hf) else "LAST", normalize=not reranker,
        task="classify" if reranker else "embed",
        matryoshka=bool(hf.get("is_matryoshka") or hf.get("matryoshka_dimensions")))
    if not reranker:
        fields.update(_sentence_transformers_spec(model_dir))
    unknown = sorted(set(pooler_config or {}) - {"pooling_type", "normalize"})
    if unknown:
        raise ValueError(f"pooler_config: unknown key(s) {unknown}; known: pooling_type, "
                         "normalize")
    fields.update(pooler_config or {})
    return PoolerSpec(**fields)
