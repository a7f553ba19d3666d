"""vLLM's tokenizer routes: `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`.

Clients that count tokens or build prompts themselves use them; lm-eval's `local-completions`
probes `/tokenizer_info` and `/tokenize` to decide whether it may tokenize on the server
(`tokenizer_backend=auto`). Bodies and answers follow vLLM's: `/tokenize` takes a prompt
(completions style, special tokens added) or chat messages (rendered with the model's chat
template as `/v1/chat/completions` renders them, `tools` and `chat_template_kwargs` included;
no special tokens added: the template writes its own) and answers `{"tokens", "count",
"max_model_len"}`, plus `token_strs` (the vocabulary's strings of the ids) when asked.

Errors are answered here in OpenAI's shape rather than raised as `app.APIError`: importing
`app` would be circular once `app` registers these routes.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, field_validator

from jaxserve.errors import InvalidRequestError
from jaxserve.fleet.routing import UnknownModelError
from jaxserve.fleet.served_model import ServedModel
from jaxserve.server.protocol import ChatMessage, error_body, valid_unicode
from jaxserve.server.state import ServerState
from jaxserve.tool_calling import check_tool_choice

# tokenizer_config.json fields that are file paths on the serving machine, left out as vLLM does
_PATH_FIELDS = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")


class TokenizeRequest(BaseModel):
    """vLLM's TokenizeCompletionRequest (`prompt`) and TokenizeChatRequest (`messages`) in
    one body, so a bad field is named plainly rather than under a union member's name.
    `add_special_tokens` defaults to true for a prompt, false for messages."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: list[Any] | None = None  # rendered by the chat template, as chat completions do
    chat_template_kwargs: dict[str, Any] | None = None

    _valid_unicode = field_validator("*", mode="before")(valid_unicode)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]

    _valid_unicode = field_validator("*", mode="before")(valid_unicode)


def _error(status: int, message: str, param: str | None = None,
           error_type: str = "invalid_request_error", code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, error_type, param, code), status_code=status)


def add_tokenizer_routes(app: FastAPI, state: ServerState, dependencies: list) -> None:
    """Register the tokenizer routes on `app`, each behind `dependencies` (the API-key check).

    The tokenize routes are plain functions, so FastAPI runs them on its thread pool: encoding
    a body of megabytes must not stall the event loop that streams other requests' tokens."""

    def served_or_refusal(model: str | None, field: str | None):
        """(the version that would answer `model`, None), or (None, the error answer)."""
        if not state.ready:
            return None, _error(503, state.not_ready_reason(), error_type="service_unavailable")
        try:
            served = state.lookup(model)
        except UnknownModelError as err:
            return None, _error(404, str(err), "model", code="model_not_found")
        if served.tokenizer is None:
            return None, _error(400, "this model has no tokenizer (no tokenizer.json)", field)
        return served, None

    @app.post("/tokenize", dependencies=dependencies)
    def tokenize(body: TokenizeRequest):
        field = "messages" if body.messages is not None else "prompt"
        served, refused = served_or_refusal(body.model, field)
        if refused is not None:
            return refused
        try:
            tokens = _tokenize(served.tokenizer, body)
        except InvalidRequestError as err:
            return _error(400, str(err), err.field)
        except ValueError as err:  # e.g. a model whose tokenizer has no chat template
            return _error(400, str(err), field)
        answer: dict[str, Any] = {"tokens": tokens, "count": len(tokens),
                                  "max_model_len": served.max_model_len}
        if body.return_token_strs:
            # vocabulary entries ("Ġword"), as vLLM's convert_ids_to_tokens gives
            answer["token_strs"] = [served.tokenizer.id_to_token(t) for t in tokens]
        return answer

    @app.post("/detokenize", dependencies=dependencies)
    def detokenize(body: DetokenizeRequest):
        served, refused = served_or_refusal(body.model, "tokens")
        if refused is not None:
            return refused
        tokenizer = served.tokenizer
        bad = [t for t in body.tokens if not 0 <= t < tokenizer.vocab_size]
        if bad:
            return _error(400, f"tokens: ids {bad[:5]} are outside the vocabulary "
                               f"(0 to {tokenizer.vocab_size - 1})", "tokens")
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/tokenizer_info", dependencies=dependencies)
    async def tokenizer_info(model: str | None = None):
        served, refused = served_or_refusal(model, "model")
        if refused is not None:
            return refused
        return _tokenizer_info(served)


def _tokenize(tokenizer, body: TokenizeRequest) -> list[int]:
    """Token ids of `body`'s prompt or chat messages (InvalidRequestError naming the field)."""
    if body.prompt is None and body.messages is None:
        raise InvalidRequestError(None, "give prompt (text) or messages (a chat)")
    if body.prompt is not None and body.messages is not None:
        raise InvalidRequestError("messages", "messages cannot be given with prompt: give "
                                              "one of them")
    if body.prompt is not None:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        return tokenizer.encode(body.prompt, add_special_tokens=add_special)
    if not body.messages:
        raise InvalidRequestError("messages", "messages is empty")
    choice = check_tool_choice(body.tools, None, None)
    text = tokenizer.apply_chat_template([m.as_template_message() for m in body.messages],
                                         add_generation_prompt=body.add_generation_prompt,
                                         tools=body.tools if choice else None,
                                         template_kwargs=body.chat_template_kwargs)
    return tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))


def _tokenizer_info(served: ServedModel) -> dict[str, Any]:
    """What vLLM's `/tokenizer_info` answers: the tokenizer's configuration (its
    `tokenizer_config.json`, special tokens as plain strings, no file paths), its
    `tokenizer_class` (vLLM names the class it loaded; here the one the config names, a
    tokenizer.json alone being `PreTrainedTokenizerFast`), the special tokens and the chat
    template jaxserve uses; plus this server's `max_model_len`.
    Read from the file on each call: a few kilobytes, asked once per client."""
    path = served.model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    info = {key: _plain_tokens(value) for key, value in config.items()
            if key not in _PATH_FIELDS}
    tokenizer = served.tokenizer
    info["tokenizer_class"] = config.get("tokenizer_class") or "PreTrainedTokenizerFast"
    info["bos_token"], info["eos_token"] = tokenizer.bos_token, tokenizer.eos_token
    if tokenizer.chat_template:
        info["chat_template"] = tokenizer.chat_template
    info["max_model_len"] = served.max_model_len
    return info


def _plain_tokens(value):
    """`value` with each special token written as an AddedToken dict ({"content": ...,
    "special": ...}) replaced by its text, as vLLM serialises them."""
    if isinstance(value, dict):
        if isinstance(value.get("content"), str):
            return value["content"]
        return {key: _plain_tokens(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain_tokens(item) for item in value]
    return value
