"""Each row's sampling settings as arrays (plain numpy, no jax: the batcher builds them, the
sampler reads them on device), so one program serves any mix of settings."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jaxserve.sampling_params import SamplingParams


@dataclasses.dataclass
class SamplingArrays:
    """Per-row sampling settings of one batch."""

    temperature: np.ndarray  # [B] float32, 0 = greedy
    top_k: np.ndarray  # [B] int32, 0 = whole vocabulary
    top_p: np.ndarray  # [B] float32, 1 = off
    min_p: np.ndarray  # [B] float32, 0 = off
    seed: np.ndarray  # [B] uint32
    presence: np.ndarray  # [B] float32, 0 = off
    frequency: np.ndarray  # [B] float32, 0 = off
    repetition: np.ndarray  # [B] float32, 1 = off
    wants_logprobs: np.ndarray  # [B] bool, the request asked for log-probabilities
    constrained: np.ndarray  # [B] bool, the row samples under a grammar (`StepInput.allowed`)

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], seeds: Sequence[int],
                    batch: int) -> "SamplingArrays":
        """Pack `params` into rows, padding to `batch` rows with greedy settings."""
        pad = batch - len(params)
        if pad < 0:
            raise ValueError(f"{len(params)} requests do not fit a batch of {batch}")

        def column(values, fill, dtype):
            return np.asarray(list(values) + [fill] * pad, dtype=dtype)

        return cls(
            temperature=column((p.temperature for p in params), 0.0, np.float32),
            top_k=column((max(p.top_k, 0) for p in params), 0, np.int32),
            top_p=column((p.top_p for p in params), 1.0, np.float32),
            min_p=column((p.min_p for p in params), 0.0, np.float32),
            seed=column((s % 2**32 for s in seeds), 0, np.uint32),
            presence=column((p.presence_penalty for p in params), 0.0, np.float32),
            frequency=column((p.frequency_penalty for p in params), 0.0, np.float32),
            repetition=column((p.repetition_penalty for p in params), 1.0, np.float32),
            wants_logprobs=column((p.logprobs is not None for p in params), False, np.bool_),
            constrained=column((p.structured_outputs is not None for p in params), False,
                               np.bool_),
        )
