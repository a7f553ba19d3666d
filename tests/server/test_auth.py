"""Keys and client errors (`jaxserve.server.auth`), without an engine: the app is called in
process (httpx's ASGI transport, no lifespan, so no model loads and routes past the keys
answer 503). Which routes need which key, where the keys come from, a reload while one runs,
bodies without a JSON content type, and server errors that name the request id but not the
error."""

import asyncio
import logging
import threading
import types

import httpx
import pytest
from fastapi import FastAPI

from jaxserve.cli.main import build_parser
from jaxserve.cli.serve_command import run_server
from jaxserve.fleet.fleet import ReloadError
from jaxserve.lora.runtime import RuntimeLoRAUpdating
from jaxserve.server import auth, state as state_module
from jaxserve.server.app import create_app
from jaxserve.engine.async_engine import EngineDeadError
from jaxserve.server.auth import ADMIN_API_KEY_ENV, API_KEY_ENV, key_from, warn_if_open
from jaxserve.server.state import ServerOptions, ServerState

pytestmark = pytest.mark.quick

KEY, ADMIN = "inference-key-0123", "admin-key-4567"
AS_CLIENT, AS_ADMIN = ({"Authorization": f"Bearer {k}"} for k in (KEY, ADMIN))
ADMIN_ROUTES = {"/admin/reload", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
OPEN_ROUTES = {"/health", "/metrics", "/get_load",  # probes, scrapes, the router's polls
               "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}  # FastAPI's
SECRET = "/home/someone/.cache/huggingface/hub/models--org--name/snapshots/abc"


def app_of(**options) -> tuple[FastAPI, ServerState]:
    """The app with runtime LoRA updating on (its routes exist only then)."""
    state = ServerState(ServerOptions(**{
        "model": "tiny", "runtime_lora": RuntimeLoRAUpdating(allow_hub=True), **options}))
    return create_app(state), state


def client(app: FastAPI) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1")


def call(app: FastAPI, method: str, path: str, **kwargs) -> httpx.Response:
    async def one():
        async with client(app) as http:
            return await http.request(method, path, **kwargs)
    return asyncio.run(one())


def routes(app: FastAPI) -> list[tuple[str, str]]:
    return [(method, route.path) for route in app.routes for method in sorted(route.methods)
            if method != "HEAD"]


def assert_refused(response: httpx.Response, status: int, error_type: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == error_type and error["message"]


def test_every_route_but_probes_and_scrapes_needs_a_key():
    app, _ = app_of(api_key=KEY, admin_api_key=ADMIN)
    found = routes(app)
    assert {path for _, path in found} >= ADMIN_ROUTES | {"/load", "/get_server_info",
                                                          "/get_model_info", "/v1/models"}
    for method, path in found:
        if path in OPEN_ROUTES:
            continue
        keyless = call(app, method, path, json={})
        assert_refused(keyless, 401, "authentication_error")
        other = AS_CLIENT if path in ADMIN_ROUTES else AS_ADMIN  # neither key opens the other
        assert_refused(call(app, method, path, json={}, headers=other), 401,
                       "authentication_error")
        right = AS_ADMIN if path in ADMIN_ROUTES else AS_CLIENT
        assert call(app, method, path, json={}, headers=right).status_code not in (401, 403)
    for path in ("/get_load", "/health"):  # open, then 503 while nothing is loaded
        assert call(app, "GET", path).status_code == 503


def test_get_load_and_metrics_need_the_key_when_asked():
    app, _ = app_of(api_key=KEY, metrics_need_api_key=True)
    for path in ("/get_load", "/metrics"):
        assert_refused(call(app, "GET", path), 401, "authentication_error")
        assert call(app, "GET", path, headers=AS_CLIENT).status_code in (200, 503)


def test_admin_routes_without_an_admin_key_are_refused_never_open():
    for options in ({}, {"api_key": KEY}):
        app, _ = app_of(**options)
        for path in ADMIN_ROUTES:
            for headers in ({}, AS_CLIENT, AS_ADMIN):
                refused = call(app, "POST", path, headers=headers,
                               json={"lora_name": "x", "lora_path": "y"})
                assert_refused(refused, 403, "permission_error")
                assert refused.json()["error"]["code"] == "admin_api_key_not_set"


def test_keys_are_compared_in_constant_time(monkeypatch):
    seen = []
    real = auth.hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest",
                        lambda a, b: seen.append((a, b)) or real(a, b))
    app, _ = app_of(api_key=KEY, admin_api_key=ADMIN)
    call(app, "GET", "/v1/models", headers={"Authorization": "Bearer guess"})
    call(app, "POST", "/admin/reload", headers={"Authorization": "Bearer admin-guess"})
    assert seen == [(b"Bearer guess", f"Bearer {KEY}".encode()),
                    (b"Bearer admin-guess", f"Bearer {ADMIN}".encode())]


def test_keys_come_from_the_flags_then_the_environment():
    env = {"VLLM_API_KEY": "vllm", "JAXSERVE_API_KEY": "", "JAXSERVE_ADMIN_API_KEY": "adm"}
    assert key_from(None, API_KEY_ENV, env) == "vllm"  # an empty variable is no key
    assert key_from(None, API_KEY_ENV, {**env, "JAXSERVE_API_KEY": "js"}) == "js"
    assert key_from("flag", API_KEY_ENV, env) == "flag"
    assert key_from(None, ADMIN_API_KEY_ENV, env) == "adm"
    assert key_from(None, ADMIN_API_KEY_ENV, {"VLLM_API_KEY": "vllm"}) is None
    with pytest.raises(ValueError, match="admin API key must differ"):
        ServerOptions(model="tiny", api_key="same", admin_api_key="same")


def test_serve_reads_both_keys_from_the_environment(monkeypatch):
    """`jaxserve serve` hands the environment's keys to the server (stopped at its state)."""
    given = []

    class Stop(Exception):
        pass

    def capture(options):
        given.append(options)
        raise Stop

    monkeypatch.setattr(state_module, "ServerState", capture)
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm-env")
    monkeypatch.setenv("JAXSERVE_ADMIN_API_KEY", "from-admin-env")
    with pytest.raises(Stop):
        run_server(build_parser().parse_args(["serve", "--port", "0"]))
    assert (given[0].api_key, given[0].admin_api_key) == ("from-vllm-env", "from-admin-env")


def test_listening_beyond_loopback_without_a_key_is_warned(caplog):
    with caplog.at_level(logging.WARNING, logger="jaxserve.server"):
        for host, key in (("127.0.0.1", None), ("::1", None), ("localhost", None),
                          ("0.0.0.0", KEY)):
            warn_if_open(host, key)
        assert not caplog.records
        for host in ("0.0.0.0", "::", "10.1.2.3", "server.example"):
            warn_if_open(host, None)
    assert [host in r.getMessage() for r, host in zip(
        caplog.records, ("0.0.0.0", "::", "10.1.2.3", "server.example"))] == [True] * 4


def test_a_reload_while_one_runs_is_409(monkeypatch, tmp_path):
    app, state = app_of(model=None, models_file=str(tmp_path / "models.toml"),
                        admin_api_key=ADMIN)
    started, release = threading.Event(), threading.Event()

    def slow_reload():
        started.set()
        release.wait(30)
        return []

    monkeypatch.setattr(state.fleet, "reload", slow_reload)
    table = types.SimpleNamespace(ids=lambda: ["m@1"])
    monkeypatch.setattr(state.fleet, "router", types.SimpleNamespace(table=table))
    state.ready = True

    async def scenario():
        async with client(app) as http:
            first = asyncio.ensure_future(http.post("/admin/reload", headers=AS_ADMIN))
            assert await asyncio.to_thread(started.wait, 30)
            second = await http.post("/admin/reload", headers=AS_ADMIN)
            release.set()
            return await first, second

    first, second = asyncio.run(scenario())
    assert_refused(second, 409, "invalid_request_error")
    assert second.json()["error"]["code"] == "reload_in_progress"
    assert first.status_code == 200, first.text
    assert not state._reloading.locked()  # the next reload may run


def test_a_json_body_without_a_json_content_type_is_refused():
    """A web page may post `text/plain` to 127.0.0.1 without a CORS preflight."""
    app, _ = app_of()
    body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 1}'
    for content_type in ("text/plain", None):
        headers = {"Content-Type": content_type} if content_type else {}
        refused = call(app, "POST", "/v1/completions", content=body, headers=headers)
        assert_refused(refused, 415, "invalid_request_error")
        assert "application/json" in refused.json()["error"]["message"]
    for content_type in ("application/json", "application/json; charset=utf-8"):
        accepted = call(app, "POST", "/v1/completions", content=body,
                        headers={"Content-Type": content_type})
        assert accepted.status_code == 503  # past the body: the model is not loaded here


def test_server_errors_name_the_request_id_not_the_error(caplog, monkeypatch, tmp_path):
    app, state = app_of()

    async def engine_died():
        raise EngineDeadError(f"cannot read {SECRET}")

    async def broken():
        raise RuntimeError(f"cannot read {SECRET}")

    app.add_api_route("/engine-died", engine_died, methods=["GET"])
    app.add_api_route("/broken", broken, methods=["GET"])
    with caplog.at_level(logging.ERROR, logger="jaxserve.server"):
        for path in ("/engine-died", "/broken"):
            failed = call(app, "GET", path, headers={"X-Request-Id": f"id{path}"})
            assert_refused(failed, 500, "server_error")
            assert failed.headers["x-request-id"] == f"id{path}"
            assert f"id{path}" in failed.json()["error"]["message"]
            assert SECRET not in failed.text and "cannot read" not in failed.text
    logged = [r.getMessage() for r in caplog.records if SECRET in r.getMessage()]
    assert [("id/engine-died" in m, "id/broken" in m) for m in logged] == [(True, False),
                                                                          (False, True)]

    state.fail(f"model failed to load: no config.json in {SECRET}")
    health = call(app, "GET", "/health")
    assert health.status_code == 500 and SECRET not in health.text
    assert "model failed to load" in health.json()["error"]["message"]


def test_a_failed_reload_names_the_version_not_the_error(monkeypatch, tmp_path):
    app, state = app_of(model=None, models_file=str(tmp_path / "models.toml"),
                        admin_api_key=ADMIN)

    def failing_reload():
        raise ReloadError(f"gone@1 failed to load: no folder {SECRET}")

    monkeypatch.setattr(state.fleet, "reload", failing_reload)
    state.ready = True
    failed = call(app, "POST", "/admin/reload", headers={**AS_ADMIN, "X-Request-Id": "r-1"})
    assert_refused(failed, 500, "server_error")
    message = failed.json()["error"]["message"]
    assert "gone@1 failed to load" in message and "r-1" in message and SECRET not in message
