"""What `LLM.embed` and `LLM.score` return, shaped as vLLM's (`EmbeddingRequestOutput`,
`ScoringRequestOutput`), and the per-request `PoolingParams`."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class PoolingParams:
    """Per-request pooling options, as vLLM's: `dimensions` cuts a Matryoshka model's
    vector to its first N values (then normalized); `normalize` overrides the model's."""

    dimensions: int | None = None
    normalize: bool | None = None


@dataclasses.dataclass(frozen=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass(frozen=True)
class ScoringOutput:
    score: float


@dataclasses.dataclass(frozen=True)
class EmbeddingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclasses.dataclass(frozen=True)
class ScoringRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
