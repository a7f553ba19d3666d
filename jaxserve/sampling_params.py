"""`SamplingParams`: how one request is decoded, shaped like vLLM's so users know it.

Validated at construction: a bad value is an `InvalidRequestError` (a `ValueError`) whose
`field` names it, raised before anything reaches the device.
"""

from __future__ import annotations

import dataclasses

from jaxserve.errors import InvalidRequestError
from jaxserve.structured_output import StructuredOutputsParams

MAX_LOGPROBS = 20  # top log-probabilities computed on device per token
OUTPUT_KINDS = ("delta", "final_only")  # vLLM's RequestOutputKind.DELTA / FINAL_ONLY
INT32_MAX = 2**31 - 1  # the largest top_k: the engine packs it into int32 device arrays


@dataclasses.dataclass
class SamplingParams:
    """Decoding settings of one request.

    temperature 0 is greedy. Penalties follow vLLM: presence and frequency penalties count
    generated tokens, the repetition penalty (divide positive logits, multiply negative ones)
    every token seen, prompt included. `logprobs` N returns, per generated token, its
    log-probability and the N most likely tokens' (of the model's raw distribution). top_k -1
    (or 0) means the whole vocabulary; top_p 1.0 and min_p 0.0 disable those filters. `stop`
    strings end the text before the string; `stop_token_ids` and the model's eos end it
    after the token (eos unless `ignore_eos`). `seed` makes sampling
    reproducible: the same seed and prompt give the same tokens whatever else is batched.
    `prompt_logprobs` N returns, per prompt token after the first, its log-probability and the
    N most likely tokens' at its position (`RequestOutput.prompt_logprobs`); such a request
    computes its whole prompt (it does not read the prefix cache). `max_tokens` 0 is allowed
    with it: only the prompt is scored. `structured_outputs` constrains the output to a JSON
    schema, a regex, a choice of strings or a grammar (`StructuredOutputsParams`, or a dict of
    its fields).
    `output_kind` says how the caller reads the output: "delta" (streaming: every token is
    delivered as soon as it is sampled, so a batch holding such a request decodes one token
    per step) or "final_only" (only the finished output is read, so the engine may run
    `num_decode_steps` decode steps per host round trip). `LLM.generate` and non-streaming
    HTTP requests use "final_only".
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | dict | None = None
    output_kind: str = "delta"
    skip_special_tokens: bool = True

    def __post_init__(self):
        _check_number("temperature", self.temperature, low=0.0)
        _check_number("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_int("top_k", self.top_k)
        if self.top_k < -1 or self.top_k > INT32_MAX:  # the device arrays hold int32
            raise InvalidRequestError(
                "top_k", f"top_k must be -1 (disabled) or a positive integer up to "
                         f"{INT32_MAX}, got {self.top_k}")
        _check_number("min_p", self.min_p, low=0.0, high=1.0)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if not 0 <= value <= MAX_LOGPROBS:
                    raise InvalidRequestError(name, f"{name} must be between 0 and "
                                              f"{MAX_LOGPROBS}, got {value}")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            least = 0 if self.prompt_logprobs is not None else 1
            if self.max_tokens < least:
                raise InvalidRequestError(
                    "max_tokens", f"max_tokens must be at least 1 (0 only with "
                                  f"prompt_logprobs), got {self.max_tokens}")
        _check_number("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_number("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _check_number("repetition_penalty", self.repetition_penalty, low=0.0, high=2.0,
                      low_open=True)
        if self.seed is not None:
            _check_int("seed", self.seed)
        if self.output_kind not in OUTPUT_KINDS:
            raise InvalidRequestError("output_kind", f"output_kind must be one of "
                                      f"{list(OUTPUT_KINDS)}, got {self.output_kind!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequestError(
                "stop", "stop must be a non-empty string or a list of non-empty strings")
        self.stop_token_ids = list(self.stop_token_ids or [])
        for token in self.stop_token_ids:
            _check_int("stop_token_ids", token)
            if not 0 <= token < 2**31:
                raise InvalidRequestError(
                    "stop_token_ids", f"stop_token_ids must be non-negative token ids, got {token}")
        if self.structured_outputs is not None:
            if isinstance(self.structured_outputs, dict):
                try:
                    self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
                except TypeError as err:  # a key that is no field
                    raise InvalidRequestError("structured_outputs", str(err)) from None
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise InvalidRequestError(
                    "structured_outputs", "structured_outputs must be a "
                    f"StructuredOutputsParams or a dict, got {self.structured_outputs!r}")

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def _check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(name, f"{name} must be an integer, got {value!r}")


def _check_number(name: str, value, low=None, high=None, low_open=False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(name, f"{name} must be a number, got {value!r}")
    if low is not None and (value < low or (low_open and value == low)):
        bound = f"> {low}" if low_open else f">= {low}"
        raise InvalidRequestError(name, f"{name} must be {bound}, got {value}")
    if high is not None and value > high:
        raise InvalidRequestError(name, f"{name} must be <= {high}, got {value}")
