"""The pooling side of `LLM` (`runner="pooling"`): `embed` and `score`, as vLLM's, and the
one place that turns texts into the pooling engine's inputs and its outputs into answers
(the HTTP routes call the same functions, `jaxserve.server.pooling_routes`).

Scores follow vLLM: an embedding model's score of two texts is the cosine of their
embeddings; a reranker's (`task` classify) is its yes/no probability of the two texts
joined (`jaxserve.pooling.reranker`).
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np

from jaxserve.errors import InvalidRequestError
from jaxserve.loading.tokenizer import Tokenizer
from jaxserve.pooling.engine import PoolingEngine
from jaxserve.pooling.outputs import (EmbeddingOutput, EmbeddingRequestOutput, PoolingParams,
                                      ScoringOutput, ScoringRequestOutput)
from jaxserve.pooling.runner import finish
from jaxserve.pooling.spec import PoolerSpec


class Pooler:
    """A pooling engine with its model's spec and tokenizer: inputs in, vectors or scores
    out. Thread-safe (the engine batches concurrent calls)."""

    def __init__(self, engine: PoolingEngine, spec: PoolerSpec, tokenizer: Tokenizer | None):
        self.engine, self.spec, self.tokenizer = engine, spec, tokenizer
        self._ids = itertools.count()

    def token_ids(self, prompt, field: str = "input") -> list[int]:
        """A prompt's tokens: a string (tokenized), a list of ids, or vLLM's
        `{"prompt": ...}` / `{"prompt_token_ids": [...]}`."""
        if isinstance(prompt, dict):
            prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError(field, "an input is an empty string")
            if self.tokenizer is None:
                raise InvalidRequestError(field, "this model has no tokenizer.json: send "
                                          "token ids")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(
                isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt):
            return [int(t) for t in prompt]
        raise InvalidRequestError(field, "an input must be a string or a list of token ids")

    def truncated(self, ids: list[int], keep: int | None) -> list[int]:
        """`ids` cut to their last `keep` tokens, as vLLM's `truncate_prompt_tokens` (-1:
        `max_model_len`; None: as they are)."""
        if keep is None:
            return ids
        if keep == -1:
            keep = self.engine.runner.max_model_len
        if keep < 1:
            raise InvalidRequestError("truncate_prompt_tokens", "truncate_prompt_tokens must "
                                      f"be -1 or at least 1, got {keep}")
        return ids[-keep:]

    def check_dimensions(self, dimensions: int | None, hidden_size: int | None = None
                         ) -> None:
        """`InvalidRequestError` naming `dimensions` unless the model is Matryoshka and
        the value is within its hidden size (when known)."""
        if dimensions is None:
            return
        if not self.spec.matryoshka:
            raise InvalidRequestError("dimensions", "this model does not support matryoshka "
                                      "representation; dimensions cannot be set")
        if dimensions < 1 or (hidden_size is not None and dimensions > hidden_size):
            raise InvalidRequestError("dimensions", f"dimensions must be in [1, "
                                      f"{hidden_size or 'the hidden size'}], got {dimensions}")

    def embed_ids(self, sequences: list[list[int]], params: PoolingParams | None = None
                  ) -> np.ndarray:
        """The embeddings `[N, E']` of token sequences (cut and normalized as asked)."""
        if self.spec.task != "embed":
            raise InvalidRequestError("model", "this model is a reranker (classify): it "
                                      "scores pairs (/score, /rerank) and has no embeddings")
        params = params or PoolingParams()
        self.check_dimensions(params.dimensions)  # before the work, where it can be
        vectors = self.engine.encode(sequences)
        self.check_dimensions(params.dimensions, vectors.shape[-1])
        normalize = self.spec.normalize if params.normalize is None else params.normalize
        return finish(vectors, normalize, params.dimensions)

    def score_texts(self, pairs: list[tuple[str | list[int], str | list[int]]]
                    ) -> tuple[np.ndarray, list[int]]:
        """Each pair's score `[N]` and the tokens it took in all."""
        if self.spec.task == "classify":
            sequences = [self.token_ids(a, "text_1") + self._continuation(b) for a, b in pairs]
            return self.engine.encode(sequences), [len(s) for s in sequences]
        firsts = [self.token_ids(a, "text_1") for a, _ in pairs]
        seconds = [self.token_ids(b, "text_2") for _, b in pairs]
        vectors = finish(self.engine.encode(firsts + seconds), normalize=True)
        left, right = vectors[:len(pairs)], vectors[len(pairs):]
        return (np.sum(left * right, axis=-1),
                [len(a) + len(b) for a, b in zip(firsts, seconds)])

    def _continuation(self, second) -> list[int]:
        """The second text of a reranker's pair, tokenized to follow the first."""
        if isinstance(second, str) and self.tokenizer is not None:
            return self.tokenizer.encode(second, add_special_tokens=False)
        return self.token_ids(second, "text_2")

    def next_id(self) -> str:
        return str(next(self._ids))

    def close(self) -> None:
        """Stop the pooling thread once its queued work is done, and drop the weights it
        holds (a model version the server retires)."""
        self.engine.shutdown()
        self.engine.runner.release()


def pairs_of(data_1, data_2) -> list[tuple]:
    """vLLM's score pairing: one first text against each second (1:N) or pairwise (N:N)."""
    first = [data_1] if isinstance(data_1, str) or _is_ids(data_1) else list(data_1)
    second = [data_2] if isinstance(data_2, str) or _is_ids(data_2) else list(data_2)
    if not first or not second:
        raise InvalidRequestError("text_2" if first else "text_1", "nothing to score")
    if len(first) == 1:
        return [(first[0], b) for b in second]
    if len(first) != len(second):
        raise InvalidRequestError("text_2", f"text_1 has {len(first)} items and text_2 "
                                  f"{len(second)}: give one text_1, or as many as text_2")
    return list(zip(first, second))


def _is_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) for t in value)


class PoolingAPI:
    """`LLM`'s pooling methods; the `LLM` sets `self.pooler` (None: a generation runner)."""

    pooler: Pooler | None

    def _needs_pooler(self) -> Pooler:
        if self.pooler is None:
            raise ValueError("this LLM runs generation; embed and score need "
                             "runner='pooling'")
        return self.pooler

    def embed(self, prompts, pooling_params: PoolingParams | None = None,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (strings, token-id lists or vLLM prompt dicts);
        `truncate_prompt_tokens` keeps each prompt's last N tokens, as vLLM's."""
        pooler = self._needs_pooler()
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        if not prompts:
            raise ValueError("prompts is empty")
        sequences = [pooler.truncated(pooler.token_ids(p, "prompts"), truncate_prompt_tokens)
                     for p in prompts]
        vectors = pooler.embed_ids(sequences, pooling_params)
        return [EmbeddingRequestOutput(pooler.next_id(), ids, EmbeddingOutput(v.tolist()))
                for ids, v in zip(sequences, vectors)]

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str]
              ) -> list[ScoringRequestOutput]:
        """One score per pair (`pairs_of`): the embeddings' cosine, or a reranker's
        relevance."""
        pooler = self._needs_pooler()
        pairs = pairs_of(data_1, data_2)
        scores, _ = pooler.score_texts(pairs)
        return [ScoringRequestOutput(pooler.next_id(), [], ScoringOutput(float(s)))
                for s in scores]
