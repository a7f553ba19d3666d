"""The pooling routes of a `--runner pooling` server, in OpenAI's and vLLM's shapes:

- `POST /v1/embeddings` (OpenAI): `input` a string, a list of strings, a list of token ids
  or a list of such lists; `encoding_format` "float" or "base64" (little-endian float32
  bytes, what the `openai` client asks for by default); `dimensions` (Matryoshka models);
  vLLM's `truncate_prompt_tokens` (keep each input's last N tokens; -1: `max_model_len`).
- `POST /pooling` (vLLM): the same inputs, each row's pooled vector as `data`.
- `POST /score`, `/v1/score` (vLLM): `text_1` against `text_2` (or `queries` against
  `documents`), one or pairwise; an embedding model's cosine, a reranker's relevance.
- `POST /rerank`, `/v1/rerank`, `/v2/rerank` (Jina/Cohere, as vLLM takes it): `query`,
  `documents`, `top_n`; `results` sorted by `relevance_score`, each with its `index` and
  `document`.

The work runs on the pooling engine's thread (`jaxserve.pooling.engine`), which batches
concurrent requests; bad input is a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Literal, Union

import numpy as np
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from jaxserve.errors import InvalidRequestError
from jaxserve.pooling.api import Pooler, pairs_of
from jaxserve.pooling.outputs import PoolingParams
from jaxserve.server.protocol import error_body, valid_unicode
from jaxserve.server.state import ServerState

Input = Union[str, list[str], list[int], list[list[int]]]


class PoolingRequestBody(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str | None = None
    user: str | None = None
    # a lone surrogate (JSON "\ud800") in any field is a 400 naming it, not a 500
    _valid_unicode = field_validator("*", mode="before")(valid_unicode)


class EmbeddingRequest(PoolingRequestBody):
    input: Input
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None


class ScoreRequest(PoolingRequestBody):
    text_1: Union[str, list[str], None] = None
    text_2: Union[str, list[str], None] = None
    queries: Union[str, list[str], None] = None  # newer vLLM's names for text_1 / text_2
    documents: Union[str, list[str], None] = None


class RerankRequest(PoolingRequestBody):
    query: str
    documents: list[str] = Field(min_length=1)
    top_n: int | None = None


def _inputs(value: Input) -> list:
    """The request's inputs as a list: a string or a token-id list is one input."""
    if isinstance(value, str) or (isinstance(value, list) and value
                                  and all(isinstance(t, int) for t in value)):
        return [value]
    if not value:
        raise InvalidRequestError("input", "input is empty")
    return list(value)


def _encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()


def _usage(tokens: int) -> dict:
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}


def _answered(handler):
    """`handler`'s reply, or a 400 in OpenAI's shape naming the field of a bad value."""
    async def answer(body):
        try:
            return await handler(body)
        except ValueError as err:
            return JSONResponse(error_body(str(err), param=getattr(err, "field", None)),
                                status_code=400)
    return answer


def add_pooling_routes(app: FastAPI, state: ServerState, v1: list, route) -> None:
    """The routes above; `route(state, model)` picks the served version as the generation
    routes do."""

    def pooler_of(model: str | None) -> tuple[Pooler, str]:
        served = route(state, model).served
        pooler = getattr(served.llm, "pooler", None)
        if pooler is None:
            # names the field only when the client gave it (else the server's one model)
            raise InvalidRequestError(None if model is None else "model",
                                      f"model {served.entry.name!r} runs generation; "
                                      "embeddings and scores need a server started with "
                                      "--runner pooling")
        return pooler, model or served.entry.name

    def head(kind: str, model: str) -> dict:
        return {"id": f"{kind}-{uuid.uuid4().hex}", "object": "list",
                "created": int(time.time()), "model": model}

    async def embed(body: EmbeddingRequest, kind: str):
        pooler, model = pooler_of(body.model)
        sequences = [pooler.truncated(pooler.token_ids(item), body.truncate_prompt_tokens)
                     for item in _inputs(body.input)]
        params = PoolingParams(body.dimensions, body.normalize)
        vectors = await asyncio.to_thread(pooler.embed_ids, sequences, params)
        tokens = sum(len(s) for s in sequences)
        if kind == "embedding":
            data = [{"object": "embedding", "index": i,
                     "embedding": _encoded(v, body.encoding_format)}
                    for i, v in enumerate(vectors)]
        else:
            data = [{"object": "pooling", "index": i, "data": _encoded(v, body.encoding_format)}
                    for i, v in enumerate(vectors)]
        return {**head("embd" if kind == "embedding" else "pool", model), "data": data,
                "usage": _usage(tokens)}

    @app.post("/v1/embeddings", dependencies=v1)
    async def embeddings(body: EmbeddingRequest):
        return await _answered(lambda b: embed(b, "embedding"))(body)

    @app.post("/pooling", dependencies=v1)
    async def pooling(body: EmbeddingRequest):
        return await _answered(lambda b: embed(b, "pooling"))(body)

    async def score(body: ScoreRequest):
        pooler, model = pooler_of(body.model)
        first = body.text_1 if body.text_1 is not None else body.queries
        second = body.text_2 if body.text_2 is not None else body.documents
        if first is None or second is None:
            raise InvalidRequestError("text_1" if first is None else "text_2",
                                      "score needs text_1 and text_2 (or queries and "
                                      "documents)")
        scores, tokens = await asyncio.to_thread(pooler.score_texts, pairs_of(first, second))
        data = [{"object": "score", "index": i, "score": float(s)}
                for i, s in enumerate(scores)]
        return {**head("score", model), "data": data, "usage": _usage(sum(tokens))}

    async def rerank(body: RerankRequest):
        pooler, model = pooler_of(body.model)
        if body.top_n is not None and body.top_n < 1:
            raise InvalidRequestError("top_n", f"top_n must be at least 1, got {body.top_n}")
        scores, tokens = await asyncio.to_thread(
            pooler.score_texts, [(body.query, d) for d in body.documents])
        order = sorted(range(len(scores)), key=lambda i: -float(scores[i]))
        results = [{"index": i, "document": {"text": body.documents[i]},
                    "relevance_score": float(scores[i])} for i in order[:body.top_n]]
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": model,
                "usage": {"total_tokens": sum(tokens)}, "results": results}

    async def score_route(body: ScoreRequest):
        return await _answered(score)(body)

    async def rerank_route(body: RerankRequest):
        return await _answered(rerank)(body)

    for path in ("/score", "/v1/score"):
        app.post(path, dependencies=v1)(score_route)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path, dependencies=v1)(rerank_route)

