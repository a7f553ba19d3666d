"""Results returned to Python callers, shaped like vLLM's `RequestOutput`."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CompletionOutput:
    """One generated sequence: its text, its token ids and why it ended."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", or None while still running
    logprobs: list[dict[int, float]] | None = None  # per token: {id: log-prob}, if asked


@dataclasses.dataclass
class RequestOutput:
    """Everything generated for one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
