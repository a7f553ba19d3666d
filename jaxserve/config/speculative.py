"""`speculative_config`: vLLM's keys, checked once when the engine is configured.

    LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                   "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    jaxserve serve --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
    [speculative]  method = "ngram"  num_speculative_tokens = 4     (a preset's table)

`method` "ngram" proposes, for each row, the tokens that followed the longest earlier
occurrence (between `prompt_lookup_min` and `prompt_lookup_max` tokens; both default to 5, and
one given alone sets the other, as in vLLM) of the row's last tokens, up to
`num_speculative_tokens` of them. `disable_by_batch_size` (vLLM's name): decode steps with more
running requests than this run the plain decode loop, where verifying drafts costs more than
it saves.

`method` "draft_model" proposes with `model`, a smaller model of the same vocabulary (a
Hugging Face folder or Hub id of any family jaxserve loads), greedily, k tokens one after
another (`jaxserve.speculative.draft`). "eagle3" proposes with `model`, an EAGLE-3 head in the
Hugging Face layout, from the target's own hidden states (`jaxserve.speculative.eagle3`);
without a `model`, the shipped model drafts with the head that ships beside it.
vLLM's other methods are not run yet, and saying one is a `ValueError` that says so.
"""

from __future__ import annotations

import dataclasses
from typing import Any

METHODS = ("ngram", "draft_model", "eagle3")
NOT_YET = ("eagle", "medusa", "mlp_speculator", "suffix", "deepseek_mtp")
DEFAULT_LOOKUP = 5  # vLLM's prompt_lookup_min/max when neither is given


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """How decode steps speculate; `num_speculative_tokens` drafts per row and round."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_LOOKUP
    prompt_lookup_max: int = DEFAULT_LOOKUP
    disable_by_batch_size: int | None = None
    model: str | None = None  # the draft model ("draft_model")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SpeculativeConfig":
        """Check vLLM's keys; a `ValueError` names the key that is wrong."""
        if not isinstance(values, dict):
            raise ValueError("speculative_config must be a JSON object / dict, e.g. "
                             '{"method": "ngram", "num_speculative_tokens": 4}, got '
                             f"{values!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {unknown}; known: "
                             f"{sorted(known)}")
        method = values.get("method")
        if method in NOT_YET:
            raise ValueError(f"speculative_config.method {method!r} is not supported yet; "
                             f"supported: {list(METHODS)}")
        if method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {list(METHODS)}, got "
                             f"{method!r}")
        if "num_speculative_tokens" not in values:
            raise ValueError("speculative_config.num_speculative_tokens is required (the "
                             "drafts proposed per row and round)")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            if values.get(name) is not None:
                _check_positive(name, values[name])  # as given, before one fills the other
        low, high = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
        if low is None and high is None:
            low = high = DEFAULT_LOOKUP
        low = high if low is None else low
        high = low if high is None else high
        config = cls(method, values["num_speculative_tokens"], low, high,
                     values.get("disable_by_batch_size"), values.get("model"))
        config.check()
        return config

    def check(self) -> None:
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            _check_positive(name, getattr(self, name))
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) "
                             f"must not exceed prompt_lookup_max ({self.prompt_lookup_max})")
        if self.disable_by_batch_size is not None:
            _check_positive("disable_by_batch_size", self.disable_by_batch_size)
        if self.method == "draft_model" or self.model is not None:
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(f"speculative_config.model is required with method "
                                 f"{self.method!r}: the draft's folder or Hub id")
        if self.method == "ngram" and self.model is not None:
            raise ValueError(f"speculative_config.model is for methods 'draft_model' and "
                             f"'eagle3'; method {self.method!r} has no model")

    def applies_to(self, rows: int) -> bool:
        """Whether a decode step of `rows` running requests speculates."""
        return self.disable_by_batch_size is None or rows <= self.disable_by_batch_size

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"speculative_config.{name} must be a positive integer, got "
                         f"{value!r}")
