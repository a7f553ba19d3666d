"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Fields follow OpenAI's `/v1/completions` and `/v1/chat/completions`, plus vLLM's sampling
extras (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`). Unknown
fields are ignored, as OpenAI clients send ones this server has no use for. Range checks live
in `SamplingParams`, so the API and Python share one set of rules.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from jaxserve.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Sampling fields shared by both endpoints."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        index: int) -> SamplingParams:
        """Parameters of choice `index` (choices of a seeded request get seeds seed+index)."""
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, max_tokens=max_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            seed=None if self.seed is None else self.seed + index,
            ignore_eos=self.ignore_eos, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logprobs=logprobs,
            output_kind="delta" if self.stream else "final_only")


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[dict], None] = None

    def as_template_message(self) -> dict:
        """{"role", "content"} with content parts ({"type": "text", ...}) joined to text."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content
                              if part.get("type") == "text")
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def error_body(message: str, error_type: str = "invalid_request_error",
               param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error JSON shape."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}
