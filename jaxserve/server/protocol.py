"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Fields follow OpenAI's `/v1/completions` and `/v1/chat/completions` (`response_format` and
`echo` included), plus vLLM's extras (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
`stop_token_ids`, `prompt_logprobs`, `skip_special_tokens`, `structured_outputs` and the older
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`; on chat, `tools`,
`tool_choice`, `parallel_tool_calls`, `chat_template_kwargs` and `include_reasoning`). Unknown
fields are ignored, as OpenAI clients send ones this server has no use for. Range checks live
in `SamplingParams`, so the API and Python share one set of rules; what is checked here is what
JSON can carry and Python cannot serve (lone surrogates, NaN, ints past the device's int32).
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from jaxserve.errors import InvalidRequestError
from jaxserve.sampling_params import SamplingParams
from jaxserve.structured_output import StructuredOutputsParams
from jaxserve.tool_calling import ToolChoice, check_tool_choice


def valid_unicode(value):
    """`value`, if no string in it (lists and dict values included) holds a lone surrogate.

    JSON escapes such as "\\ud800" decode to lone surrogates, which neither the tokenizer nor a
    UTF-8 response body can hold: they raised TypeError / UnicodeEncodeError (HTTP 500). The
    walk is iterative because JSON can nest as deep as the recursion limit.
    """
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as err:
                raise ValueError(f"not valid Unicode: lone surrogate "
                                 f"\\u{ord(item[err.start]):04x}") from None
        elif isinstance(item, list):
            pending.extend(item)
        elif isinstance(item, dict):
            pending.extend(item.values())
    return value


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Sampling fields shared by both endpoints. NaN and infinities are refused: they pass every
    range check (comparisons with NaN are false) and would sample garbage."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)
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
    prompt_logprobs: int | None = Field(default=None, ge=0)  # up to --max-logprobs
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    cache_salt: str | None = None  # vLLM's: prefix-cache pages shared only within one salt
    skip_special_tokens: bool = True
    return_token_ids: bool = False  # vLLM's: the ids of the prompt and of each choice
    # the model's max_tokens default when the request gives none (--generation-config)
    _default_max_tokens: int | None = PrivateAttr(default=None)

    @property
    def default_max_tokens(self) -> int | None:
        return self._default_max_tokens

    _valid_unicode = field_validator("*", mode="before")(valid_unicode)

    def structured(self) -> StructuredOutputsParams | None:
        """The output constraint the request asks for, from whichever field names it."""
        return StructuredOutputsParams.from_request(
            response_format=self.response_format, structured_outputs=self.structured_outputs,
            guided_json=self.guided_json, guided_regex=self.guided_regex,
            guided_choice=self.guided_choice, guided_grammar=self.guided_grammar)

    def structured_field(self) -> str:
        """The field that carried the output constraint (what an error about it names)."""
        names = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                 "guided_choice", "guided_grammar")
        return next((n for n in names if getattr(self, n) is not None), "structured_outputs")

    def sampling_params(self, max_tokens: int, logprobs: int | None, index: int,
                        prompt_logprobs: int | None = None,
                        structured: StructuredOutputsParams | None = None,
                        keep_special_tokens: bool = False) -> SamplingParams:
        """Parameters of choice `index` (choices of a seeded request get seeds seed+index)."""
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, max_tokens=max_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            seed=None if self.seed is None else self.seed + index,
            ignore_eos=self.ignore_eos, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, structured_outputs=structured,
            output_kind="delta" if self.stream else "final_only",
            skip_special_tokens=self.skip_special_tokens and not keep_special_tokens)


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = Field(default=None, ge=0)  # up to --max-logprobs (limits)
    echo: bool = False


class ContentPart(BaseModel):
    """One part of a message's content; only text parts reach the model."""

    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None  # typed: a text that is no string failed the join (HTTP 500)


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Union[str, list[ContentPart], None] = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message's answer to that call
    name: str | None = None

    def as_template_message(self) -> dict:
        """The message as chat templates read it: content parts ({"type": "text", ...})
        joined to text; an assistant's tool calls with their arguments as objects (what
        Hugging Face templates expect), not the JSON text OpenAI sends."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text or "" for part in content if part.type == "text")
        message: dict = {"role": self.role, "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name,
                              "arguments": _arguments_object(call.function.arguments)}}
                for call in self.tool_calls]
        for field in ("tool_call_id", "name"):
            if getattr(self, field) is not None:
                message[field] = getattr(self, field)
        return message


def _arguments_object(text: str):
    """A tool call's JSON arguments as an object; text that is not JSON stays text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)  # 0 (scoring only) is for completions
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)  # up to --max-logprobs
    tools: list[Any] | None = None  # checked by `tool_choice_checked`, naming the entry
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. Qwen3's enable_thinking
    include_reasoning: bool = True

    @functools.cached_property
    def tool_choice_checked(self) -> ToolChoice | None:
        """The request's tools and tool choice, checked (`jaxserve.tool_calling`)."""
        return check_tool_choice(self.tools, self.tool_choice, self.parallel_tool_calls)

    def structured(self) -> StructuredOutputsParams | None:
        """The output constraint: a required or named tool choice's, else the fields'."""
        constraint = super().structured()
        choice = self.tool_choice_checked
        from_tools = choice.constraint() if choice is not None else None
        if from_tools is None:
            return constraint
        if constraint is not None:
            raise InvalidRequestError("tool_choice", f"tool_choice {choice.mode!r} constrains "
                                      f"the reply already; drop {super().structured_field()}")
        return from_tools

    def structured_field(self) -> str:
        choice = self.tool_choice_checked
        if choice is not None and choice.constraint() is not None:
            return "tools"
        return super().structured_field()

    def tool_schemas(self) -> list[tuple[str, StructuredOutputsParams]]:
        """Each tool's parameters as a JSON-schema constraint, named by its field: compiling
        them checks that they are schemas the structured-output engine can enforce."""
        choice = self.tool_choice_checked
        return [(f"tools.{i}.function.parameters",
                 StructuredOutputsParams(json=tool["function"]["parameters"]))
                for i, tool in enumerate(choice.tools if choice else ())]


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
