"""Security properties kept as tests: the API key guards every route that does work (and
`/metrics` when asked), the admin routes refuse it, it is compared in constant time (more in
test_auth.py, without an engine), the default bind is loopback, chat
templates run sandboxed, nothing unpickles, and request bodies and prompts are capped (a
chunked body without a length too)."""

import json
import re
from pathlib import Path

import httpx
import pytest

from jaxserve.cli.main import build_parser
from jaxserve.lora.runtime import RuntimeLoRAUpdating
from jaxserve.server import auth
from jaxserve.server.state import ServerOptions
from server_helpers import serving
from tiny_models import SMALL_ENGINE, build_model

NAME, KEY = "tiny", "not-a-real-key-0123"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 64 << 10
ROOT = Path(__file__).resolve().parents[2]
ESCAPE = "{{ messages.__class__.__mro__[1].__subclasses__() }}"  # reaches Python internals


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    build_model("llama", folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config,
                                                              "chat_template": ESCAPE}))
    options = ServerOptions(model=str(folder), served_model_name=[NAME],
                            dtype="float32", api_key=KEY, metrics_need_api_key=True,
                            max_body_bytes=MAX_BODY, engine_options=SMALL_ENGINE,
                            runtime_lora=RuntimeLoRAUpdating((str(folder),)))  # the routes
    with serving(options) as running:
        yield running


ADMIN_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")  # the admin key's


def routes(server) -> list[tuple[str, str]]:
    app = server.server.config.app
    return [(method, route.path) for route in app.routes if route.path.startswith("/v1/")
            and route.path not in ADMIN_ROUTES for method in sorted(route.methods)]


def test_every_v1_route_and_metrics_need_the_key(server):
    guarded = routes(server) + [("GET", "/metrics")]
    assert {path for _, path in guarded} >= {"/v1/models", "/v1/completions",
                                            "/v1/chat/completions", "/metrics"}
    body = {"model": NAME, "prompt": "x", "max_tokens": 1}
    wrong = {"Authorization": "Bearer " + "x" * len(KEY)}
    for method, path in guarded:
        for headers in ({}, wrong, {"Authorization": KEY}):
            response = httpx.request(method, server.url + path, headers=headers, json=body)
            assert response.status_code == 401, (method, path, headers)
            assert response.json()["error"]["type"] == "authentication_error"
        # past the key: 200, or 400 where this body does not suit the route (chat)
        allowed = httpx.request(method, server.url + path, headers=AUTH, json=body)
        assert allowed.status_code in (200, 400), (method, path, allowed.text)
    assert httpx.get(f"{server.url}/health").status_code == 200  # probes need no key
    for path in ADMIN_ROUTES:  # no admin key configured: refused, whatever the key
        refused = httpx.post(server.url + path, headers=AUTH, json={"lora_name": "x"})
        assert refused.status_code == 403 and refused.json()["error"]["type"] == (
            "permission_error")


def test_the_key_is_compared_in_constant_time(server, monkeypatch):
    seen = []
    real = auth.hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest",
                        lambda a, b: seen.append((a, b)) or real(a, b))
    httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer guess"})
    assert seen and seen[0][0] == b"Bearer guess"


def test_the_default_bind_is_loopback():
    assert build_parser().parse_args(["serve"]).host == "127.0.0.1"


def test_a_chat_template_reaching_python_internals_is_refused(server):
    response = httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH, json={
        "model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and "sandbox" in error["message"]
    ok = httpx.post(f"{server.url}/v1/completions", headers=AUTH,
                    json={"model": NAME, "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200


def test_bodies_and_prompts_are_capped(server):
    big = json.dumps({"model": NAME, "prompt": "x" * MAX_BODY}).encode()
    declared = httpx.post(f"{server.url}/v1/completions", headers=AUTH, content=big)
    assert declared.status_code == 413

    def chunks():  # no Content-Length: the server must count what it receives
        for start in range(0, len(big), 4096):
            yield big[start:start + 4096]
    chunked = httpx.post(f"{server.url}/v1/completions", headers=AUTH, content=chunks())
    assert chunked.status_code == 413 and "error" in chunked.json()
    too_long = httpx.post(f"{server.url}/v1/completions", headers=AUTH,
                          json={"model": NAME, "prompt": list(range(2, 300))})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "prompt"


def test_nothing_unpickles():
    """No code path can load a pickle: not in jaxserve, its kernels or its sharding — except the
    executable store, whose entries are machine code of the process's own user (it reads only
    files and a folder no one else can write: tests/engine/test_executable_store.py)."""
    pattern = re.compile(r"\bimport (c?pickle|dill|joblib)\b|pickle\.loads?\(|torch\.load\("
                         r"|allow_pickle\s*=\s*True")
    offenders = [str(path.relative_to(ROOT)) for folder in ("jaxserve", "pallas_kernels",
                                                            "sharding")
                 for path in (ROOT / folder).rglob("*.py") if pattern.search(path.read_text())]
    assert offenders == ["jaxserve/engine/executable_store.py"]
    store = (ROOT / offenders[0]).read_text()
    assert "untrusted_reason(path)" in store and "untrusted_reason(self.folder)" in store
