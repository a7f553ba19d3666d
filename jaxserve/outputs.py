"""Results returned to Python callers, shaped like vLLM's `RequestOutput`."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CompletionOutput:
    """One generated sequence: its text, its token ids and why it ended."""

    index: int
    text: str
    token_ids: list[int]
    # "stop", "length", "abort", "error", "grammar_dead_end" (structured output could not go
    # on), or None while still running
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None  # per token: {id: log-prob}, if asked


@dataclasses.dataclass
class RequestOutput:
    """Everything generated for one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    # With `SamplingParams.prompt_logprobs`: per prompt token {id: log-prob} of it and the
    # most likely tokens at its position; None for the first token (nothing precedes it).
    prompt_logprobs: list[dict[int, float] | None] | None = None
