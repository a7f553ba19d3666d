"""The OpenAI-compatible HTTP server (FastAPI).

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both with `stream: true` as
server-sent events ending in `data: [DONE]`), `GET /v1/models`, `POST /tokenize`,
`POST /detokenize`, `GET /tokenizer_info` (vLLM's), `GET /health` (503 until the
models are loaded and their smallest buckets' programs exist; 200 after, its body saying
per model "warming" while the larger buckets still compile in the background, then "ready",
and the programs ready of total; 500 once none can serve, while the process exits), `GET
/metrics` (Prometheus), `POST /admin/reload` (re-read the models file, `jaxserve.fleet`),
and for vLLM's router `GET /load`, `/get_load`, `/get_server_info`, `/get_model_info`
(`jaxserve.server.router_routes`). Every response carries `X-Request-Id`: the client's, or
one the server made (a completion's body `id`). Which key each route needs:
`jaxserve.server.auth`.

Each request's `model` is routed by `jaxserve.fleet.routing` (a name's versions by weight, a
pinned id `name@version` to its version); the `x-jaxserve-model-version` header names the
version that answered. When that version's queue is full (429) or its engine failed (500),
a version with a `fallback` hands the request to it, and `x-jaxserve-fallback-from` says
so. Errors use OpenAI's JSON shape and name the bad field; a server-side failure is logged
with the request id, and the client gets a plain message and that id (never the raw error,
which may hold paths). A body sent without a JSON content type is refused (415): a web page
can post such a body to a server on 127.0.0.1 without a CORS preflight. The model loads on
a background thread after the socket is open, so orchestrators see the process alive while
`/health` says whether it is ready.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxserve.errors import InvalidRequestError
from jaxserve.fleet.fleet import ReloadError
from jaxserve.fleet.routing import Route, UnknownModelError
from jaxserve.fleet.served_model import ServedModel
from jaxserve.lora.slots import Adapter
from jaxserve.server import handlers
from jaxserve.engine.async_engine import EngineDeadError, QueueFullError, RetiredError
from jaxserve.server.auth import (AuthError, admin_key_dependency, api_key_dependency,
                                  check_api_key)
from jaxserve.server.generation_defaults import with_defaults
from jaxserve.server.lora_routes import add_lora_routes
from jaxserve.server.pooling_routes import add_pooling_routes
from jaxserve.server.protocol import ChatCompletionRequest, CompletionRequest, error_body
from jaxserve.server.router_routes import RequestIdMiddleware, add_router_routes
from jaxserve.server.state import ReloadBusyError, ServerState
from jaxserve.server.tokenizer_routes import add_tokenizer_routes

log = logging.getLogger("jaxserve.server")


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 error_type: str = "invalid_request_error", code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.error_type, self.code, self.headers = error_type, code, headers


def _error(status, message, param=None, error_type="invalid_request_error", code=None,
           headers=None) -> JSONResponse:
    return JSONResponse(error_body(message, error_type, param, code), status_code=status,
                        headers=headers)


def create_app(state: ServerState) -> FastAPI:
    """The FastAPI application serving `state`'s model."""
    app = FastAPI(title="jaxserve", lifespan=state.lifespan)
    app.state.jaxserve = state

    app.add_middleware(BodySizeLimit, max_bytes=state.max_body_bytes)
    app.add_middleware(RequestIdMiddleware)  # a 413 carries the id too
    if state.options.cors is not None:  # outermost: preflights and errors get its headers
        app.add_middleware(CORSMiddleware, **state.options.cors)
    add_error_handlers(app)

    v1 = [api_key_dependency(lambda: state.api_key)]
    admin = [admin_key_dependency(lambda: state.admin_api_key)]
    add_status_routes(app, state, v1, admin)
    add_generation_routes(app, state, v1)
    add_pooling_routes(app, state, v1, _route)
    add_tokenizer_routes(app, state, v1)
    add_lora_routes(app, state, admin)
    add_router_routes(app, state, v1)
    return app


# ---- errors ------------------------------------------------------------------------------
async def on_validation_error(request: Request, exc: RequestValidationError):
    first = exc.errors()[0] if exc.errors() else {}
    content_type = request.headers.get("content-type", "")
    if tuple(first.get("loc", ())) == ("body",) and not _is_json(content_type):
        return _error(415, f"the request body must be JSON sent with Content-Type: "
                           f"application/json (got {content_type or 'none'!r})",
                      code="unsupported_media_type")
    if first.get("type") == "json_invalid":  # its loc is a character offset, not a field
        reason = first.get("ctx", {}).get("error", first.get("msg"))
        offset = first.get("loc", (None, None))[-1]
        return _error(400, f"request body is not valid JSON: {reason} (at character "
                           f"{offset})")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid request")
    return _error(400, f"{param}: {message}" if param else message, param)


async def on_http_error(request: Request, exc: StarletteHTTPException):
    return _error(exc.status_code, str(exc.detail), error_type="not_found_error"
                  if exc.status_code == 404 else "invalid_request_error")


async def on_auth_error(request: Request, exc: AuthError):
    return _error(exc.status, exc.message, error_type=exc.error_type, code=exc.code)


async def on_api_error(request: Request, exc: APIError):
    return _error(exc.status, exc.message, exc.param, exc.error_type, exc.code, exc.headers)


async def on_queue_full(request: Request, exc: QueueFullError):
    return _error(429, str(exc), error_type="rate_limit_error", headers={"Retry-After": "1"})


async def on_engine_failure(request: Request, exc: EngineDeadError):
    return _server_error(request, "the engine failed while serving this request", exc)


async def on_unexpected_error(request: Request, exc: Exception):
    """Anything unforeseen (Starlette's outermost layer)."""
    response = _server_error(request, "the server failed to answer this request", exc)
    response.headers["x-request-id"] = request.state.request_id  # past that middleware
    return response


def add_error_handlers(app: FastAPI) -> None:
    """Every error answered in OpenAI's shape, naming the bad field where there is one."""
    for error, handler in ((RequestValidationError, on_validation_error),
                           (StarletteHTTPException, on_http_error), (AuthError, on_auth_error),
                           (APIError, on_api_error), (QueueFullError, on_queue_full),
                           (EngineDeadError, on_engine_failure),
                           (Exception, on_unexpected_error)):
        app.add_exception_handler(error, handler)


# ---- health, metrics, models, reload -----------------------------------------------------
def add_status_routes(app: FastAPI, state: ServerState, v1: list, admin: list) -> None:
    """`/health`, `/metrics`, `/v1/models` and `/admin/reload`."""

    @app.get("/health")
    async def health():
        if state.fatal_error:  # shutting down: a supervisor should restart the process
            return _error(500, state.not_ready_reason(), error_type="server_error")
        if not state.ready:
            return _error(503, state.not_ready_reason(), error_type="service_unavailable")
        served = state.fleet.table.served
        return {"status": "ok",
                "models": {state.fleet.public_id(s): "failed" if s.failure else "warming"
                           if s.llm.engine.warming else "ready" for s in served},
                "programs": {state.fleet.public_id(s): dict(zip(
                    ("ready", "total"), s.llm.engine.programs_ready())) for s in served}}

    @app.get("/metrics")
    async def metrics(request: Request):
        if state.metrics_need_api_key:
            check_api_key(state.api_key, request)
        if not state.ready:
            return Response(b"", media_type="text/plain; version=0.0.4")
        return Response(state.prometheus.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=v1)
    async def models():
        if not state.ready:
            return {"object": "list", "data": []}
        return {"object": "list", "data": model_cards(state)}

    @app.post("/admin/reload", dependencies=admin)
    async def reload(request: Request):
        try:
            timeline = await asyncio.to_thread(state.reload)
        except ValueError as err:
            raise APIError(400, f"reload refused, the previous models keep serving: {err}",
                           "models") from None
        except ReloadBusyError as err:
            raise APIError(409, str(err), code="reload_in_progress") from None
        except ReloadError as err:  # "VERSION failed to load: the error"
            what = str(err).partition(": ")[0]
            return _server_error(request, f"reload failed, the previous models keep serving: "
                                          f"{what}", err, traceback=True)
        return {"status": "ok", "models": state.fleet.table.ids(), "timeline": timeline}


# ---- completions ---------------------------------------------------------------------------
def add_generation_routes(app: FastAPI, state: ServerState, v1: list) -> None:
    """`POST /v1/completions` and `POST /v1/chat/completions`."""

    @app.post("/v1/completions", dependencies=v1)
    async def completions(request: Request, body: CompletionRequest):
        return await _run(state, request, body, handlers.CompletionJob)

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        return await _run(state, request, body, functools.partial(
            handlers.ChatJob, parsing=state.chat_parsing))


def _route(state: ServerState, model: str | None) -> Route:
    """The version that answers a request for `model` (503 before the models are ready, 404
    for a name the server does not have)."""
    if not state.ready:
        raise APIError(503, state.not_ready_reason(), error_type="service_unavailable")
    try:
        return state.fleet.router.route(model)
    except UnknownModelError as err:
        raise APIError(404, str(err), "model", code="model_not_found") from None


def _build_job(state: ServerState, served: ServedModel, body, build: Callable, answer_as: str,
               request_id: str | None, lora: Adapter | None):
    """The job of `body` on `served`, not yet queued: its caps checked, its prompts
    tokenized (a chat's rendered), a chat request's tool schemas checked by compiling
    them, its grammar compiled (first here, so that an error names the field the client
    sent; the job finds it cached). Seconds for a long prompt: run it off the event
    loop."""
    if served.llm.pooler is not None:
        raise InvalidRequestError("model", f"model {served.entry.name!r} is served with "
                                  "--runner pooling: it answers /v1/embeddings, /pooling, "
                                  "/score and /rerank, not generation")
    body = with_defaults(body, state.generation_defaults(served))
    state.request_limits.check(body)
    structured = body.structured()
    checks = body.tool_schemas() if isinstance(body, ChatCompletionRequest) else []
    checks += [(body.structured_field(), structured)] if structured is not None else []
    for field, constraint in checks:
        try:
            served.llm.engine.grammar_compiler().compile(constraint)
        except InvalidRequestError as err:
            err.field = field  # the name the client sent
            raise
    return build(served, body, answer_as, request_id, lora=lora)


async def _admit(state: ServerState, served: ServedModel, body, build: Callable,
                 answer_as: str, request_id: str | None, lora: Adapter | None):
    """The job of `body` on `served`, built on a worker thread (so `/health` and every
    stream carry on meanwhile), then queued here on the event loop."""
    job = await asyncio.to_thread(_build_job, state, served, body, build, answer_as,
                                  request_id, lora)
    return job.start()


async def _run(state: ServerState, request: Request, body, build: Callable):
    """Route `body`, admit its job (falling back to another version when the chosen one's
    queue is full or its engine failed), and answer: a stream, or the whole reply."""
    adapter = state.find_adapter(body.model) if state.ready else None
    lora = None if adapter is None else adapter[1]  # `model` names a LoRA adapter
    model = body.model if adapter is None else adapter[0].entry.name
    chosen, tried = _route(state, model), set()
    given_id = request.state.request_id if request.state.request_id_given else None
    while True:
        served = chosen.served
        tried.add(served.pinned_id)
        answer_as = (state.fleet.public_id(served) if state.fleet.pinned_ids
                     and lora is None else body.model or served.entry.name)
        try:
            job = await _admit(state, served, body, build, answer_as, given_id,
                               lora or served.adapter)
            break
        except RetiredError:  # removed by a reload a moment ago: the new table decides
            chosen = _route(state, model)
        except (QueueFullError, EngineDeadError):
            fallback = state.fleet.router.fallback(chosen)
            if lora is not None or fallback is None or fallback.served.pinned_id in tried:
                raise
            chosen = fallback
        except ValueError as err:
            raise APIError(400, str(err), getattr(err, "field", None)) from None
    state.prometheus.count_route(state.fleet.public_id(served), served.entry.version,
                                 chosen.reason)
    request.state.request_id = job.request_id  # the client's, else the body's `id`
    headers = {"x-jaxserve-model-version": served.pinned_id}
    if chosen.fallback_from:
        headers["x-jaxserve-fallback-from"] = chosen.fallback_from
    if body.stream:
        return StreamingResponse(job.sse(), media_type="text/event-stream", headers=headers)
    return JSONResponse(await _unless_disconnected(request, job.collect()), headers=headers)


def model_cards(state: ServerState) -> list[dict]:
    """`/v1/models`: each name (with its versions and weights) and alias; with a models file
    also each pinned id, its parent name and weight."""
    table = state.fleet.table

    def card(model_id: str, served: ServedModel, **more) -> dict:
        return {"id": model_id, "object": "model", "created": state.created,
                "owned_by": "jaxserve", "max_model_len": served.max_model_len, **more}

    cards = []
    for name, versions in table.versions.items():
        cards.append(card(name, versions[0], versions=[
            {"id": v.pinned_id, "weight": table.weight(v)} for v in versions]))
    cards += [card(alias, table.versions[name][0], parent=name)
              for alias, name in table.aliases.items()]
    if state.fleet.pinned_ids:
        cards += [card(s.pinned_id, s, parent=s.entry.name, weight=table.weight(s),
                       status="failed" if s.failure else "ready",
                       **({"root": s.entry.lora_path, "base": s.entry.base}
                          if s.adapter is not None else {})) for s in table.served]
    for served in table.served:  # LoRA adapters, as vLLM lists them
        registry = served.llm.engine.loras if served.adapter is None else None
        cards += [card(a.name, served, root=a.weights.path, parent=served.entry.name)
                  for a in (registry.all() if registry is not None else [])
                  if a.name not in table.pinned]  # adapter versions have their card above
    return cards


def _is_json(content_type: str) -> bool:
    """Whether a Content-Type is one FastAPI parses as JSON (`application/json`,
    `application/*+json`)."""
    media = content_type.partition(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/")
                                           and media.endswith("+json"))


def _server_error(request: Request, message: str, exc: BaseException,
                  traceback: bool = False) -> JSONResponse:
    """A 500 saying `message` and the request id; the error itself goes to the log only
    (with its traceback if asked: an engine failure is logged in full once, by the engine
    thread, and an unforeseen error by uvicorn)."""
    request_id = request.state.request_id
    log.error("request %s: %s: %s", request_id, message, exc, exc_info=exc if traceback else None)
    return _error(500, f"{message} (request id {request_id}; the server log has the "
                       f"details)", error_type="server_error")


class BodySizeLimit:
    """Answers 413 when a request's body exceeds `max_bytes`: at once when its
    Content-Length says so, else (a chunked body) as soon as the bytes received pass it, so
    no body larger than the limit is ever buffered. A plain ASGI middleware: Starlette's
    `BaseHTTPMiddleware` would wrap every streamed chunk in an extra task and memory
    stream."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            response = _error(413, f"request body of {int(length)} bytes exceeds the limit "
                                   f"of {self.max_bytes} bytes")
            return await response(scope, receive, send)
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # FastAPI re-raises HTTPException as is
                    raise StarletteHTTPException(413, f"request body exceeds the limit of "
                                                      f"{self.max_bytes} bytes")
            return message

        await self.app(scope, counted, send)


async def _unless_disconnected(request: Request, work):
    """Await `work`, cancelling it (which aborts its requests) if the client goes away."""
    task = asyncio.ensure_future(work)
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if not done and await request.is_disconnected():
            task.cancel()
            break
    return await task
