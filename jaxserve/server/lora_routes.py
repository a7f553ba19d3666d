"""vLLM's LoRA routes: `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`.

They exist only when the operator allows runtime updating (`--allow-runtime-lora-updating`
or vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING`; `ServerOptions.runtime_lora`); otherwise they
are not registered and answer 404, as vLLM's do. Then an adapter can be added while the
server runs (`{"lora_name": ..., "lora_path": ...}`, `lora_path` a folder under the allowed
roots or, if allowed, a Hub id: `jaxserve.lora.runtime`; read off the event loop) and
removed (`{"lora_name": ...}`; requests already using it finish with it). The operator's
adapters (`--lora-modules`, models-file versions) can be neither replaced nor removed.
Requests name an adapter as their `model`, and `/v1/models` lists it with its base as
`parent`. The answers are vLLM's plain-text lines; two loads of one name at once: one
succeeds, the other answers 409; beyond `max_cpu_loras` adapters a load answers 400.

Errors are answered in OpenAI's shape here rather than raised as `app.APIError`: importing
`app` would be circular once `app` registers these routes.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, field_validator

from jaxserve.lora.registry import LoRACapacityError, LoRAConflictError
from jaxserve.server.protocol import error_body, valid_unicode
from jaxserve.server.state import ServerState

log = logging.getLogger("jaxserve.server")


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
    """Register the two routes on `app`, if the operator allows runtime updating."""
    runtime = state.options.runtime_lora
    if runtime is None:
        return
    sources = [f"folders under {', '.join(runtime.allowed_roots)}"] * bool(
        runtime.allowed_roots) + ["the Hugging Face Hub"] * runtime.allow_hub
    log.warning("runtime LoRA updating is on: clients may load adapters from %s and unload "
                "them", " and ".join(sources))

    def refusal() -> JSONResponse | None:
        if not state.ready:
            return _error(503, state.not_ready_reason())
        if state.llm.engine.loras is None:
            return _error(400, "LoRA adapters need the server started with --enable-lora")
        return None

    def operators(name: str) -> JSONResponse | None:
        """A refusal if `name` is one of the operator's adapters."""
        if name in state.fleet.table.pinned:
            return _error(400, f"{name!r} is a version of the models file; remove it there "
                               "and reload", "lora_name")
        if name in dict(state.options.lora_modules):
            return _error(400, f"{name!r} is served by the operator (--lora-modules); it "
                               "cannot be replaced or unloaded at run time", "lora_name")
        return None

    def load(name: str, lora_path: str) -> None:
        state.load_lora(name, runtime.resolve(lora_path))

    @app.post("/v1/load_lora_adapter", dependencies=dependencies)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        refused = refusal()
        if refused is not None:
            return refused
        name = body.lora_name
        if not name:
            return _error(400, "lora_name must not be empty", "lora_name")
        refused = operators(name)
        if refused is not None:
            return refused
        if state.find_adapter(name) is not None or name in state.fleet.table.ids():
            return _error(400, f"the name {name!r} is already served; unload it first or "
                          "choose another", "lora_name")
        try:
            await asyncio.to_thread(load, name, body.lora_path)
        except LoRAConflictError as err:
            return _error(409, str(err), "lora_name")
        except LoRACapacityError as err:
            return _error(400, str(err))
        except ValueError as err:
            return _error(400, str(err), "lora_path")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=dependencies)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        refused = refusal() or operators(body.lora_name)
        if refused is not None:
            return refused
        if not state.llm.engine.unload_lora(body.lora_name):
            return _error(404, f"no LoRA adapter named {body.lora_name!r} is loaded",
                          "lora_name", "model_not_found")
        return PlainTextResponse(
            f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
