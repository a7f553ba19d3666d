"""The pooling routes of a `--runner pooling` server, through the `openai` client
(`embeddings.create`, float and base64, `dimensions`) and plain HTTP (`/pooling`, `/score`,
`/rerank`), against the same model's `LLM.embed` run in the test (an independent path: no
HTTP, no batching across requests) and numpy."""

from __future__ import annotations

import concurrent.futures
import json
import sys
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from jaxserve import LLM
from jaxserve.server.state import ServerOptions, ready_line
from server_helpers import serving
from tiny_models import SMALL_ENGINE

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pooling"))
from pooling_models import TEXTS, build_decoder  # noqa: E402

NAME = "tiny-embed"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("embed")
    build_decoder(folder, "qwen3", "LAST", normalize=True)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    return folder


@pytest.fixture(scope="module")
def reference(model_dir):
    """Each text's embedding from `LLM.embed`, unnormalized (to cut for `dimensions`)."""
    llm = LLM(str(model_dir), dtype="float32", runner="pooling",
              pooler_config={"normalize": False}, **SMALL_ENGINE)
    return np.array([o.outputs.embedding for o in llm.embed(TEXTS)])


@pytest.fixture(scope="module")
def server(model_dir):
    options = ServerOptions(model=str(model_dir), served_model_name=[NAME], dtype="float32",
                            engine_options={**SMALL_ENGINE, "runner": "pooling"})
    with serving(options) as running:
        yield running
    served = running.state.fleet.table.served[0]
    served.close()  # as a reload retiring it would: the pooling thread stops
    assert not served.llm.pooler.engine.running


def unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def test_openai_embeddings_float_base64_and_dimensions(server, reference):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    floats = client.embeddings.create(model=NAME, input=TEXTS, encoding_format="float")
    got = np.array([d.embedding for d in floats.data])
    np.testing.assert_allclose(got, unit(reference), atol=1e-5)
    assert [d.index for d in floats.data] == list(range(len(TEXTS)))
    assert floats.usage.prompt_tokens > len(TEXTS)
    encoded = client.embeddings.create(model=NAME, input=TEXTS[0])  # base64 by default
    np.testing.assert_allclose(encoded.data[0].embedding, unit(reference[0]), atol=1e-5)
    cut = client.embeddings.create(model=NAME, input=TEXTS[:2], dimensions=16,
                                   encoding_format="float")
    np.testing.assert_allclose(np.array([d.embedding for d in cut.data]),
                               unit(reference[:2, :16]), atol=1e-5)


def test_concurrent_requests_each_get_their_own_rows(server, reference):
    """Requests sent at once share the pooling engine's batches; each still gets its rows."""
    def one(index):
        reply = httpx.post(f"{server.url}/v1/embeddings", json={"input": [TEXTS[index]] * 2},
                           timeout=60)
        return index, [d["embedding"] for d in reply.json()["data"]]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, [i % len(TEXTS) for i in range(12)]))
    for index, rows in answers:
        np.testing.assert_allclose(rows, [unit(reference[index])] * 2, atol=1e-5)


def test_token_id_inputs_match_text(server, model_dir):
    from jaxserve.loading.tokenizer import Tokenizer
    ids = Tokenizer(model_dir).encode(TEXTS[1])
    reply = httpx.post(f"{server.url}/v1/embeddings", json={"model": NAME, "input": [ids]})
    by_text = httpx.post(f"{server.url}/v1/embeddings", json={"input": TEXTS[1]})
    np.testing.assert_allclose(reply.json()["data"][0]["embedding"],
                               by_text.json()["data"][0]["embedding"], atol=1e-6)


def test_truncate_prompt_tokens_keeps_the_last_tokens(server, model_dir):
    from jaxserve.loading.tokenizer import Tokenizer
    ids = Tokenizer(model_dir).encode(TEXTS[0])
    cut = httpx.post(f"{server.url}/v1/embeddings", json={
        "input": TEXTS[0], "truncate_prompt_tokens": 3}).json()["data"][0]["embedding"]
    tail = httpx.post(f"{server.url}/v1/embeddings", json={
        "input": ids[-3:]}).json()["data"][0]["embedding"]
    whole = httpx.post(f"{server.url}/v1/embeddings", json={
        "input": TEXTS[0]}).json()["data"][0]["embedding"]
    np.testing.assert_allclose(cut, tail, atol=1e-6)
    assert np.abs(np.array(cut) - whole).max() > 1e-3


def test_pooling_route(server, reference):
    reply = httpx.post(f"{server.url}/pooling", json={"model": NAME, "input": TEXTS[:3]})
    assert reply.status_code == 200, reply.text
    data = reply.json()["data"]
    assert [d["object"] for d in data] == ["pooling"] * 3
    np.testing.assert_allclose([d["data"] for d in data], unit(reference[:3]), atol=1e-5)


def test_score_is_cosine_one_to_many_and_pairwise(server, reference):
    reply = httpx.post(f"{server.url}/score", json={"model": NAME, "text_1": TEXTS[0],
                                                    "text_2": TEXTS[1:4]})
    assert reply.status_code == 200, reply.text
    want = unit(reference[1:4]) @ unit(reference[0])
    np.testing.assert_allclose([d["score"] for d in reply.json()["data"]], want, atol=1e-5)
    pairwise = httpx.post(f"{server.url}/v1/score", json={
        "queries": TEXTS[:2], "documents": TEXTS[2:4]}).json()["data"]
    want = np.sum(unit(reference[:2]) * unit(reference[2:4]), axis=-1)
    np.testing.assert_allclose([d["score"] for d in pairwise], want, atol=1e-5)


def test_rerank_orders_documents(server, reference):
    documents = TEXTS[1:]
    reply = httpx.post(f"{server.url}/rerank", json={"model": NAME, "query": TEXTS[0],
                                                     "documents": documents, "top_n": 2})
    assert reply.status_code == 200, reply.text
    scores = unit(reference[1:]) @ unit(reference[0])
    order = np.argsort(-scores)[:2]
    results = reply.json()["results"]
    assert [r["index"] for r in results] == order.tolist()
    assert [r["document"]["text"] for r in results] == [documents[i] for i in order]
    np.testing.assert_allclose([r["relevance_score"] for r in results], scores[order],
                               atol=1e-5)


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, "model"),
    ("/v1/embeddings", {"input": "hi", "dimensions": 999}, "dimensions"),
    ("/v1/embeddings", {"input": ""}, "input"),
    ("/v1/embeddings", {"input": "x" * 400}, "input"),
    ("/v1/embeddings", {"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/score", {"text_1": "a"}, "text_2"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
    ("/rerank", {"query": "a", "documents": ["b"], "top_n": 0}, "top_n"),
])
def test_bad_requests_name_the_field_and_the_server_carries_on(server, path, body, field):
    reply = httpx.post(f"{server.url}{path}", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == field
    assert httpx.post(f"{server.url}/v1/embeddings", json={"input": "a"}).status_code == 200


def test_ready_line_suggests_an_embedding():
    line = ready_line("http://127.0.0.1:8000", NAME, api_key=False, pooling=True)
    assert "curl http://127.0.0.1:8000/v1/embeddings" in line and '"input"' in line
    assert "/v1/completions" in ready_line("http://127.0.0.1:8000", NAME, api_key=False)
