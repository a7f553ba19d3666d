"""vLLM's LoRA routes: `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`.

With `--enable-lora` an adapter can be added while the server runs
(`{"lora_name": ..., "lora_path": ...}`; its PEFT folder is read off the event loop) and
removed (`{"lora_name": ...}`; requests already using it finish with it). Requests then
name it as their `model`, and `/v1/models` lists it with its base as `parent`. vLLM guards
these routes with `VLLM_ALLOW_RUNTIME_LORA_UPDATING`; here `--enable-lora` is enough (and
`--api-key` guards them like every `/v1` route). The answers are vLLM's plain-text lines.

Errors are answered in OpenAI's shape here rather than raised as `app.APIError`: importing
`app` would be circular once `app` registers these routes.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, field_validator

from jaxserve.server.protocol import error_body, valid_unicode
from jaxserve.server.state import ServerState


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str
    lora_path: str

    _valid_unicode = field_validator("*", mode="before")(valid_unicode)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str

    _valid_unicode = field_validator("*", mode="before")(valid_unicode)


def _error(status: int, message: str, param: str | None = None,
           code: str | None = None) -> JSONResponse:
    error_type = "not_found_error" if status == 404 else "invalid_request_error"
    return JSONResponse(error_body(message, error_type, param, code), status_code=status)


def add_lora_routes(app: FastAPI, state: ServerState, dependencies: list) -> None:
    """Register the two routes on `app`."""

    def refusal() -> JSONResponse | None:
        if not state.ready:
            return _error(503, state.not_ready_reason())
        if state.llm.engine.loras is None:
            return _error(400, "LoRA adapters need the server started with --enable-lora")
        return None

    @app.post("/v1/load_lora_adapter", dependencies=dependencies)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        refused = refusal()
        if refused is not None:
            return refused
        name = body.lora_name
        if not name:
            return _error(400, "lora_name must not be empty", "lora_name")
        if state.find_adapter(name) is not None or name in state.fleet.table.ids():
            return _error(400, f"the name {name!r} is already served; unload it first or "
                          "choose another", "lora_name")
        try:
            await asyncio.to_thread(state.load_lora, name, body.lora_path)
        except ValueError as err:
            return _error(400, str(err), "lora_path")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=dependencies)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        refused = refusal()
        if refused is not None:
            return refused
        if body.lora_name in state.fleet.table.pinned:
            return _error(400, f"{body.lora_name!r} is a version of the models file; remove "
                               "it there and reload", "lora_name")
        if not state.llm.engine.unload_lora(body.lora_name):
            return _error(404, f"no LoRA adapter named {body.lora_name!r} is loaded",
                          "lora_name", "model_not_found")
        return PlainTextResponse(
            f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
