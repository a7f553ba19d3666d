"""LoRA over HTTP (`--enable-lora --lora-modules`, vLLM's load/unload routes) with the
`openai` client: a request names an adapter as its `model` and gets the tokens transformers
+ peft give (read back through vLLM's `return_token_ids`); adapters are listed, loaded and
unloaded while requests run, and none of those requests is lost."""

import asyncio

import httpx
import openai
import pytest

from jaxserve.server.state import ServerOptions
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
                                            "max_loras": 1, "max_lora_rank": 8,
                                            "strict_compile": True},
                            lora_modules=(("attn", str(folders["attn"])),),
                            admin_api_key=ADMIN_KEY)
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


def test_bad_adapter_requests_are_named(server, models, tmp_path):
    _, folders, _ = models
    with httpx.Client(base_url=server.url, headers=AS_ADMIN, timeout=60) as http:
        missing = http.post("/v1/unload_lora_adapter", json={"lora_name": "nobody"})
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "lora_name"
        empty = http.post("/v1/load_lora_adapter", json={"lora_name": "x",
                                                         "lora_path": str(tmp_path)})
        assert empty.status_code == 400
        assert empty.json()["error"]["param"] == "lora_path"
        assert "adapter_config.json" in empty.json()["error"]["message"]
        taken = http.post("/v1/load_lora_adapter", json={"lora_name": "attn",
                                                         "lora_path": str(folders["attn"])})
        assert taken.status_code == 400 and taken.json()["error"]["param"] == "lora_name"
