"""LoRA over HTTP (`--enable-lora --lora-modules`, vLLM's load/unload routes) with the
`openai` client: a request names an adapter as its `model` and gets the tokens transformers
+ peft give (read back through vLLM's `return_token_ids`); adapters are listed, loaded and
unloaded while requests run, and none of those requests is lost. Runtime updating is the
operator's choice: without it the routes are not there; with it, loads come from under the
allowed roots only, the operator's adapters stay, `max_cpu_loras` caps the adapters held,
two loads of one name at once cannot both succeed, and an adapter that could poison a step
is refused with a 400 naming the problem while the server keeps serving."""

import asyncio
import json
import shutil

import httpx
import openai
import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file

from jaxserve.lora import registry
from jaxserve.lora.runtime import RuntimeLoRAUpdating
from jaxserve.server.app import create_app
from jaxserve.server.state import ServerOptions, ServerState
from peft_adapters import base_and_adapters
from server_helpers import ADMIN_KEY, AS_ADMIN, serving
from tiny_models import SMALL_ENGINE

NAME = "base"
MAX_TOKENS = 10
PROMPT = [5 + (11 * i) % 290 for i in range(37)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return base_and_adapters(tmp_path_factory.mktemp("lora_server"), PROMPT, MAX_TOKENS)


@pytest.fixture(scope="module")
def server(models):
    base, folders, _ = models
    options = ServerOptions(model=str(base), served_model_name=[NAME], dtype="float32",
                            engine_options={**SMALL_ENGINE, "enable_lora": True,
                                            "max_loras": 1, "max_cpu_loras": 2,
                                            "max_lora_rank": 8, "strict_compile": True},
                            lora_modules=(("attn", str(folders["attn"])),),
                            admin_api_key=ADMIN_KEY,
                            runtime_lora=RuntimeLoRAUpdating((str(base.parent),)))
    with serving(options) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


def tokens_of(client, model: str) -> list[int]:
    answer = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                       temperature=0, extra_body={"return_token_ids": True,
                                                                  "ignore_eos": True})
    choice = answer.choices[0].model_dump()
    assert answer.model == model and choice["prompt_token_ids"] == PROMPT
    return choice["token_ids"]


def test_an_adapter_named_as_the_model_gives_the_peft_tokens(client, models):
    _, folders, expected = models
    cards = {card.id: card.model_dump() for card in client.models.list().data}
    assert cards["attn"]["parent"] == NAME and cards["attn"]["root"] == str(folders["attn"])
    assert tokens_of(client, "attn") == expected["attn"]
    assert tokens_of(client, NAME) == expected[None]


def test_adapters_load_and_unload_while_requests_run(server, client, models):
    _, folders, expected = models

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, headers=AS_ADMIN,
                                     timeout=120) as http:
            async def complete(model):
                answer = await http.post("/v1/completions", json={
                    "model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                    "temperature": 0, "ignore_eos": True, "return_token_ids": True})
                assert answer.status_code == 200, answer.text
                return answer.json()["choices"][0]["token_ids"]

            running = [asyncio.create_task(complete(m)) for m in ("attn", NAME, "attn")]
            loaded = await http.post("/v1/load_lora_adapter", json={
                "lora_name": "everything", "lora_path": str(folders["everything"])})
            assert loaded.status_code == 200 and "added" in loaded.text
            running.append(asyncio.create_task(complete("everything")))
            done = await asyncio.gather(*running)
            unloaded = await http.post("/v1/unload_lora_adapter",
                                       json={"lora_name": "everything"})
            assert unloaded.status_code == 200 and "removed" in unloaded.text
            return done

    done = asyncio.run(scenario())
    assert done == [expected["attn"], expected[None], expected["attn"],
                    expected["everything"]]
    with pytest.raises(openai.NotFoundError) as gone:
        tokens_of(client, "everything")
    assert gone.value.body["param"] == "model"
    metrics = httpx.get(f"{server.url}/metrics").text
    assert (f'vllm:lora_requests_info{{max_lora="1",model_name="{NAME}",'
            'running_lora_adapters="",waiting_lora_adapters=""}') in metrics


def test_bad_adapter_requests_are_named(server, models):
    base, folders, _ = models
    (base.parent / "empty").mkdir(exist_ok=True)
    with httpx.Client(base_url=server.url, headers=AS_ADMIN, timeout=60) as http:
        missing = http.post("/v1/unload_lora_adapter", json={"lora_name": "nobody"})
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "lora_name"
        empty = http.post("/v1/load_lora_adapter", json={
            "lora_name": "x", "lora_path": str(base.parent / "empty")})
        assert empty.status_code == 400
        assert empty.json()["error"]["param"] == "lora_path"
        assert "adapter_config.json" in empty.json()["error"]["message"]
        taken = http.post("/v1/load_lora_adapter", json={"lora_name": "attn",
                                                         "lora_path": str(folders["attn"])})
        assert taken.status_code == 400 and taken.json()["error"]["param"] == "lora_name"


@pytest.mark.quick
def test_the_routes_are_off_unless_the_operator_allows_runtime_updating():
    """As vLLM without VLLM_ALLOW_RUNTIME_LORA_UPDATING: the routes are not registered."""
    for runtime, status in ((None, 404), (RuntimeLoRAUpdating(allow_hub=True), 503)):
        app = create_app(ServerState(ServerOptions(model=NAME, runtime_lora=runtime,
                                                   admin_api_key=ADMIN_KEY)))
        client = TestClient(app, headers=AS_ADMIN)  # no lifespan: a route that exists says 503
        for route, body in (("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "o/x"}),
                            ("/v1/unload_lora_adapter", {"lora_name": "x"})):
            answer = client.post(route, json=body)
            assert answer.status_code == status, (route, answer.text)
            assert set(answer.json()["error"]) == {"message", "type", "param", "code"}


def post_load(http, name: str, path) -> httpx.Response:
    return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})


def test_runtime_loads_come_from_under_the_allowed_roots(server, models, tmp_path):
    base, folders, _ = models
    outside = shutil.copytree(folders["everything"], tmp_path / "outside")
    (base.parent / "way-out").symlink_to(outside)
    with httpx.Client(base_url=server.url, headers=AS_ADMIN, timeout=60) as http:
        answers = [post_load(http, "escaped", path) for path in (
            outside, tmp_path / "nothing-here", base.parent / ".." / outside.name,
            base.parent / "way-out", "org/name")]
        assert {a.status_code for a in answers} == {400}
        assert len({a.text for a in answers}) == 1  # the same whether the path exists or not
        assert answers[0].json()["error"]["param"] == "lora_path"
        assert "allowed roots" in answers[0].json()["error"]["message"]
        assert "escaped" not in {c["id"] for c in http.get("/v1/models").json()["data"]}


def test_the_operators_adapters_cannot_be_unloaded_or_replaced(server, client, models):
    _, folders, expected = models
    with httpx.Client(base_url=server.url, headers=AS_ADMIN, timeout=60) as http:
        unload = http.post("/v1/unload_lora_adapter", json={"lora_name": "attn"})
        replace = post_load(http, "attn", folders["everything"])
        for answer in (unload, replace):
            assert answer.status_code == 400 and answer.json()["error"]["param"] == "lora_name"
    assert tokens_of(client, "attn") == expected["attn"]


def test_max_cpu_loras_caps_the_adapters_held(server, models):
    _, folders, _ = models
    with httpx.Client(base_url=server.url, headers=AS_ADMIN, timeout=60) as http:
        assert post_load(http, "one", folders["everything"]).status_code == 200  # attn + 1
        refused = post_load(http, "two", folders["everything"])
        assert refused.status_code == 400 and "max_cpu_loras=2" in refused.text
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "one"}).is_success


def test_two_loads_of_one_name_at_once_one_succeeds(server, models, monkeypatch):
    _, folders, _ = models
    load = registry.load_adapter

    def slow_load(*args):  # both requests arrive while the first is reading its folder
        import time

        time.sleep(1.0)
        return load(*args)

    monkeypatch.setattr(registry, "load_adapter", slow_load)

    async def both():
        async with httpx.AsyncClient(base_url=server.url, headers=AS_ADMIN, timeout=60) as http:
            return await asyncio.gather(*(post_load(http, "racy", folders[name])
                                          for name in ("attn", "everything")))

    answers = asyncio.run(both())
    assert sorted(a.status_code for a in answers) == [200, 409], [a.text for a in answers]
    assert next(a for a in answers if a.status_code == 409).json()["error"]["param"] \
        == "lora_name"
    assert httpx.post(f"{server.url}/v1/unload_lora_adapter", headers=AS_ADMIN,
                      json={"lora_name": "racy"}).is_success


def test_poisonous_adapters_are_refused_naming_the_problem(server, client, models):
    """What used to be a 500 or a load that NaN'd every row of a step."""
    base, folders, expected = models
    b_q0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    tensors = load_file(folders["attn"] / "adapter_model.safetensors")
    config = json.loads((folders["attn"] / "adapter_config.json").read_text())
    cases = {"alpha_nan": ({**config, "lora_alpha": float("nan")}, None,
                           "lora_alpha must be a finite number"),
             "tensor_nan": (config, {**tensors, b_q0: torch.full_like(tensors[b_q0], torch.nan)},
                            "holds non-finite values"),
             "zero_d": (config, {**tensors, b_q0: torch.tensor(1.0)}, "is a matrix (2-d)"),
             "rank_zero": (config, {k: v[:0] if ".lora_A." in k else v[:, :0]
                                    for k, v in tensors.items()}, "has rank 0"),
             "header": (config, b"\x08\x00\x00\x00\x00\x00\x00\x00[1, 2.0]",
                        "header is not a JSON object")}
    with httpx.Client(base_url=server.url, headers=AS_ADMIN, timeout=60) as http:
        for name, (adapter_config, weights, message) in cases.items():
            folder = base.parent / f"poison-{name}"
            folder.mkdir(exist_ok=True)
            (folder / "adapter_config.json").write_text(json.dumps(adapter_config))
            if isinstance(weights, bytes):
                (folder / "adapter_model.safetensors").write_bytes(weights)
            else:
                save_file(weights or tensors, folder / "adapter_model.safetensors")
            answer = post_load(http, name, folder)
            assert answer.status_code == 400, (name, answer.text)
            assert answer.json()["error"]["param"] == "lora_path"
            assert message in answer.json()["error"]["message"], name
    assert tokens_of(client, NAME) == expected[None]
