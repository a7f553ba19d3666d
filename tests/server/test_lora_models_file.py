"""Adapter versions in a models file (`base` + `lora_path`): a version that is another one's
engine plus a LoRA adapter answers with the tokens transformers + peft give; a reload swaps an
adapter version's folder and adds one without reloading the base, and removing one makes it
unknown. The base's engine is shared, so its warm-up and KV pool are loaded once."""

import json

import httpx
import pytest

from jaxserve.lora.runtime import RuntimeLoRAUpdating
from jaxserve.server.state import ServerOptions
from peft_adapters import base_and_adapters
from server_helpers import ADMIN_KEY, AS_ADMIN, serving
from tiny_models import SMALL_ENGINE

MAX_TOKENS = 8
PROMPT = [7 + (13 * i) % 280 for i in range(29)]
BASE_OPTIONS = {**SMALL_ENGINE, "enable_lora": True, "max_loras": 1, "max_cpu_loras": 2,
                "max_lora_rank": 8, "strict_compile": True}


def models_toml(base, adapters: dict[str, str]) -> str:
    """`tuned@1`, the base model with LoRA on; one adapter version per (version, folder)."""
    options = "\n".join(f"{k} = {json.dumps(list(v) if isinstance(v, tuple) else v)}"
                        for k, v in BASE_OPTIONS.items())
    text = f'[[models]]\nname = "tuned"\npath = "{base}"\ndtype = "float32"\n{options}\n'
    for version, folder in adapters.items():
        text += (f'\n[[models]]\nname = "tuned"\nversion = "{version}"\nbase = "tuned@1"\n'
                 f'lora_path = "{folder}"\nweight = 0\n')
    return text


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_models")
    base, folders, expected = base_and_adapters(root, PROMPT, MAX_TOKENS, seed=7)
    models = root / "models.toml"
    models.write_text(models_toml(base, {"2": folders["attn"]}))
    runtime = RuntimeLoRAUpdating((str(root),))  # the routes, to see them refuse versions
    with serving(ServerOptions(models_file=str(models), admin_api_key=ADMIN_KEY,
                               runtime_lora=runtime)) as running:
        yield running, models, folders, expected


def tokens(url: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})


def token_ids(url: str, model: str) -> list[int]:
    answer = tokens(url, model)
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == (model if "@" in model else f"{model}@1")
    return answer.json()["choices"][0]["token_ids"]


def test_adapter_versions_serve_swap_and_go(setup):
    server, models, folders, expected = setup
    assert len({tuple(t) for t in expected.values()}) == 3  # each adapter changes the tokens
    assert token_ids(server.url, "tuned@2") == expected["attn"]
    assert token_ids(server.url, "tuned") == expected[None]  # weight 0: never the adapter
    cards = {c["id"]: c for c in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert cards["tuned@2"]["root"] == str(folders["attn"])
    assert cards["tuned@2"]["base"] == "tuned@1"

    refused = httpx.post(f"{server.url}/v1/unload_lora_adapter", headers=AS_ADMIN,
                         json={"lora_name": "tuned@2"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "lora_name"

    models.write_text(models_toml(models.parent / "base", {"2": folders["everything"],
                                                          "3": folders["attn"]}))
    timeline = httpx.post(f"{server.url}/admin/reload", headers=AS_ADMIN, timeout=300)
    assert timeline.status_code == 200, timeline.text
    loads = [e["model"] for e in timeline.json()["timeline"] if e["phase"] == "load"]
    assert loads == ["tuned@2", "tuned@3"]  # the base's engine is kept
    assert token_ids(server.url, "tuned@2") == expected["everything"]
    assert token_ids(server.url, "tuned@3") == expected["attn"]

    models.write_text(models_toml(models.parent / "base", {"3": folders["attn"]}))
    reloaded = httpx.post(f"{server.url}/admin/reload", headers=AS_ADMIN, timeout=300)
    assert reloaded.status_code == 200, reloaded.text
    gone = tokens(server.url, "tuned@2")
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "model"
    assert token_ids(server.url, "tuned@3") == expected["attn"]
