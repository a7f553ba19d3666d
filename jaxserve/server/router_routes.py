"""What a worker behind vLLM's router (`vllm-router`, the Rust router forked from SGLang's)
is asked for, and the `X-Request-Id` header.

What vllm-router 0.1.17 requests from a worker (source: the vllm-project/router repository;
the retry and header behaviour also checked against the 0.1.17 wheel with a stub worker):

- `GET /health` (`--health-check-endpoint`): at start-up until a worker answers 2xx
  (`src/routers/http/router.rs`, `wait_for_healthy_workers`), then every
  `--health-check-interval-secs` (default 60, timeout 5 s; 3 failures in a row mark the
  worker unhealthy, 2 successes healthy again; `src/core/worker.rs`, `check_health_async`).
  Only the status counts, and no `Authorization` header is sent.
- `GET /get_load`, with `--policy power_of_two`: every `--worker-startup-check-interval`
  seconds, reading the integer `load` of the JSON object; a non-2xx answer or a missing field
  leaves the worker's load unknown (`src/routers/http/router.rs`, `monitor_worker_loads`,
  `get_worker_load_static`); the router's own `GET /get_loads` lists the same numbers. No
  `Authorization` header is sent.
- `GET /get_server_info`, `/get_model_info`, `/v1/models`, `/health_generate`: the router's
  routes of these names forward to the first worker with the client's headers
  (`Authorization` too) and return the body unread (`proxy_get_request`).
- With `--enable-igw` a worker added without a model id is asked `GET /get_server_info`
  (no `Authorization`), and its `model_id` is read (else the last path component of
  `model_path`); `priority` (integer), `cost` (number), `worker_type`, `tokenizer_path`,
  `tool_parser` and `chat_template` (strings) are optional there, so those names keep those
  types here (`src/routers/router_manager.rs`, `query_server_info`;
  `src/protocols/worker_spec.rs`, `ServerInfo`).
- Request ids (`src/middleware.rs`, `RequestIdLayer`): the router takes the first of
  `x-request-id`, `x-correlation-id`, `x-trace-id`, `request-id` (`--request-id-headers`),
  or makes one up (`cmpl-`/`chatcmpl-` and 24 characters), and sets it as `x-request-id` on
  its answer, replacing the worker's. The client's headers go to the worker unchanged, so a
  client's `X-Request-Id` reaches jaxserve; an id the router made up does not.
- Retries: 408, 429, 500, 502, 503 and 504 answers are retried (`--retry-max-retries`
  attempts, default 5, with back-off); other statuses go back to the client. 5xx answers also
  count against the worker's circuit breaker (`--cb-failure-threshold`, default 10). So
  jaxserve's 429 (queue full), 503 (loading) and 500 (engine failed) get another attempt,
  and its 400s do not.

The routes here: `GET /load` (vLLM's shape, `{"server_load": N}`) and `GET /get_load` (what
the router reads, `{"load": N}`) answer the same body: requests running plus waiting, summed
over every engine of the fleet (versions a reload removed that still finish their requests
too, with `status` "draining"), with each engine's numbers under `models`. `waiting` counts
every accepted request not running yet, those the scheduler has not picked up too (which
`vllm:num_requests_waiting` misses while the engine is inside a step). `GET /get_server_info`
and `GET /get_model_info` describe the served models (the first name by default;
`/get_model_info?model=ID` any id a client may send). With an API key, `/load`,
`/get_server_info` and `/get_model_info` need it like every `/v1` route (they show the
models' paths and settings; the router forwards the client's `Authorization` to them, but
`--enable-igw` discovery sends none: name each worker's model when registering it).
`/get_load` needs it, like `/metrics`, only with `--metrics-need-api-key` (then the router's
polls, which carry no key, are refused and `power_of_two` has no loads); `/health` never
does. Before the models are ready they answer 503.

`RequestIdMiddleware`: a request's `X-Request-Id` (1-256 visible ASCII characters; else, as
the router reads them, `X-Correlation-Id`, `X-Trace-Id` or `Request-Id`) is echoed as
`X-Request-Id` on its response, errors and streams included; without one (or with an
unusable one) the server makes one up: a completion's body `id` (`cmpl-...`, `chatcmpl-...`), else
`req-<hex>`. The id is recorded with the job (`Job.request_id`, logged at debug level with
its engine request ids); the body `id` and the engine's request ids stay the server's own, so
two requests sending the same header never collide in the engine.
"""

from __future__ import annotations

import uuid

import jax
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

import jaxserve
from jaxserve.fleet.served_model import ServedModel
from jaxserve.server.auth import check_api_key
from jaxserve.server.protocol import error_body
from jaxserve.server.state import ServerState

REQUEST_ID_HEADER = b"x-request-id"
# Where a client's id may come from, first found wins: vllm-router's `--request-id-headers`
# default order. It is echoed as `X-Request-Id` whichever header carried it.
REQUEST_ID_HEADERS = (REQUEST_ID_HEADER, b"x-correlation-id", b"x-trace-id", b"request-id")
MAX_REQUEST_ID_CHARS = 256


def add_router_routes(app: FastAPI, state: ServerState, dependencies: list) -> None:
    """`/load`, `/get_load`, `/get_server_info` and `/get_model_info` on `app`;
    `dependencies`: the API-key check of the `/v1` routes."""

    def not_ready() -> JSONResponse | None:
        if not state.ready:
            return JSONResponse(error_body(state.not_ready_reason(), "service_unavailable"),
                                status_code=503)
        return None

    @app.get("/load", dependencies=dependencies)
    async def load():
        return not_ready() or load_body(state)

    @app.get("/get_load")
    async def get_load(request: Request):
        if state.metrics_need_api_key:  # as /metrics: the router polls without a key
            check_api_key(state.api_key, request)
        return not_ready() or load_body(state)

    @app.get("/get_server_info", dependencies=dependencies)
    async def get_server_info():
        return not_ready() or server_info(state)

    @app.get("/get_model_info", dependencies=dependencies)
    async def get_model_info(model: str | None = None):
        refused = not_ready()
        if refused is not None:
            return refused
        served = find(state, model)
        if served is None:
            return JSONResponse(error_body(
                f"The model `{model}` does not exist; served: {state.fleet.table.ids()}",
                "not_found_error", "model", "model_not_found"), status_code=404)
        return model_info(state, served)


# ---- bodies ---------------------------------------------------------------------------
def engine_load(served: ServedModel) -> dict:
    """One version's load. `waiting` is every accepted request that is not running, those
    the engine thread has not handed to its scheduler yet included (a snapshot read without
    stopping the engine: a request finishing meanwhile may count for a moment)."""
    accepted = served.engine.num_in_flight  # submitted and not yet collected by its handler
    stats = served.llm.engine.stats()
    running = stats.num_running
    waiting = max(stats.num_waiting, accepted - running)
    return {"running": running, "waiting": waiting, "load": running + waiting,
            "max_waiting_requests": served.engine.max_waiting,
            "kv_cache_usage": stats.kv_cache_usage, "status": status(served)}


def load_body(state: ServerState) -> dict:
    """Every version's load, those a reload removed that still finish requests included
    (their requests hold the devices too; `status` "draining")."""
    fleet = state.fleet
    models = [{"model": fleet.public_id(served), **engine_load(served)}
              for served in fleet.table.served]
    models += [{"model": fleet.public_id(served), **engine_load(served), "status": "draining"}
               for served in fleet.draining]
    running = sum(m["running"] for m in models)
    waiting = sum(m["waiting"] for m in models)
    return {"server_load": running + waiting, "load": running + waiting,
            "num_running": running, "num_waiting": waiting, "models": models}


def server_info(state: ServerState) -> dict:
    table = state.fleet.table
    first = table.versions[table.default_name][0]
    return {**model_info(state, first),
            "served_model_names": table.ids(),
            "max_waiting_requests": first.engine.max_waiting,
            "version": jaxserve.__version__, "jax_version": jax.__version__,
            "backend": jax.default_backend(), "device_count": jax.device_count(),
            "models": [model_info(state, served) for served in table.served]}


def model_info(state: ServerState, served: ServedModel) -> dict:
    """One version: the names SGLang's `/get_model_info` and `/get_server_info` use (which
    the router reads), then jaxserve's engine settings."""
    llm, entry = served.llm, served.entry
    engine, config = llm.engine, llm.engine_config
    kv_tokens = (engine.num_pages - 1) * config.page_size * len(engine.replicas)  # page 0 pads
    return {
        "model_id": entry.name, "model_path": entry.path,
        "tokenizer_path": entry.path if llm.tokenizer is not None else None,
        "is_generation": True, "served_model_name": state.fleet.public_id(served),
        "pinned_id": entry.pinned_id, "weight_version": entry.version,
        "aliases": list(entry.aliases), "status": status(served),
        "model_type": llm.config.model_type, "dtype": llm.dtype.name,
        "context_length": config.max_model_len, "max_model_len": config.max_model_len,
        "max_total_num_tokens": kv_tokens,
        "max_running_requests": config.max_num_seqs * len(engine.replicas),
        "engine": {"max_model_len": config.max_model_len, "max_num_seqs": config.max_num_seqs,
                   "max_num_batched_tokens": config.max_num_batched_tokens,
                   "page_size": config.page_size, "num_pages": engine.num_pages,
                   "num_decode_steps": config.num_decode_steps,
                   "enable_prefix_caching": config.enable_prefix_caching,
                   "tensor_parallel_size": config.tensor_parallel_size,
                   "data_parallel_size": config.data_parallel_size,
                   "attention_backend": config.attention_backend},
    }


def find(state: ServerState, model: str | None) -> ServedModel | None:
    """The version an id names without the weighted draw (a name: its first version)."""
    versions = state.fleet.table.versions_for(model)
    return versions[0] if versions else None


def status(served: ServedModel) -> str:
    return "failed" if served.failure else "ready"


# ---- X-Request-Id ---------------------------------------------------------------------
def given_request_id(scope) -> str | None:
    """The request's usable id: the first of `REQUEST_ID_HEADERS` it carries (the router's
    order), if 1-256 visible ASCII characters; else None."""
    headers = dict(scope["headers"])  # ASGI header names are lower case
    for name in REQUEST_ID_HEADERS:
        value = headers.get(name)
        if value is not None:
            if 0 < len(value) <= MAX_REQUEST_ID_CHARS and all(33 <= b <= 126 for b in value):
                return value.decode("ascii")
            return None
    return None


class RequestIdMiddleware:
    """Puts the request id on every HTTP response (see the module docstring). The id is in
    `request.state.request_id` (`request_id_given` says whether the client sent it); a
    handler may replace a made-up one before its response starts. A plain ASGI middleware,
    so streamed chunks pass untouched."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = given_request_id(scope)
        state = scope.setdefault("state", {})
        state["request_id"] = given or f"req-{uuid.uuid4().hex}"
        state["request_id_given"] = given is not None

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ())
                           if k.lower() != REQUEST_ID_HEADER]
                headers.append((REQUEST_ID_HEADER, state["request_id"].encode("ascii")))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)
