"""Structured output and prompt log-probabilities over HTTP, with the `openai` client, on
the shipped model.

References: `jsonschema` and `re` for constrained outputs; `transformers`' float32
`log_softmax` on the same folder for echoed and vLLM-style prompt log-probabilities; each
prompt of a batch served alone for batched prompts. The server never compiles after
warm-up (`strict_compile`); one rung of each ladder keeps its start-up to two programs
(chunked prefill runs the longer prompts on it).
"""

import json
import re
from pathlib import Path

import httpx
import jsonschema
import numpy as np
import openai
import pytest
import torch
import transformers

from jaxserve.server.state import ServerOptions
from server_helpers import serving

MODEL = Path(__file__).resolve().parents[2] / "jaxserve" / "default_model"
NAME = "austen"
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "year": {"type": "integer", "minimum": 1700, "maximum": 1900},
                         "tone": {"enum": ["warm", "cold"]},
                         "words": {"type": "array", "items": {"type": "string",
                                                             "maxLength": 6},
                                   "maxItems": 2}},
          "required": ["name", "year", "tone", "words"], "additionalProperties": False}
ONE_RUNG = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "token_buckets": [64],
            "seq_buckets": [8]}
RESPONSE_FORMAT = {"type": "json_schema",
                   "json_schema": {"name": "letter", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def server():
    options = ServerOptions(model=str(MODEL), served_model_name=[NAME],
                            engine_options={"strict_compile": True, **ONE_RUNG})
    with serving(options) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


@pytest.fixture(scope="module")
def hf_model():
    return transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)


def reference_logprobs(hf_model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()  # [L, V]


def test_response_format_json_schema_on_completions_and_chat(client):
    texts = []
    for seed in range(3):
        out = client.completions.create(model=NAME, prompt="My dear Emma,", max_tokens=96,
                                        temperature=1.0, seed=seed,
                                        extra_body={"response_format": RESPONSE_FORMAT})
        texts.append(out.choices[0].text)
        chat = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "Write a letter"}],
            max_tokens=96, seed=seed, response_format=RESPONSE_FORMAT)
        texts.append(chat.choices[0].message.content)
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_streamed_constrained_text_equals_the_whole(client):
    kwargs = dict(model=NAME, prompt="In the morning", max_tokens=96, temperature=0.8, seed=7,
                  extra_body={"response_format": RESPONSE_FORMAT})
    whole = client.completions.create(**kwargs).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs,
                                                                           stream=True))
    assert streamed == whole
    jsonschema.validate(json.loads(whole), SCHEMA)


@pytest.mark.parametrize("extra", [
    {"structured_outputs": {"choice": ["Bath", "London", "Highbury"]}},
    {"guided_choice": ["Bath", "London", "Highbury"]},
])
def test_choice_under_both_names(client, extra):
    for seed in range(3):
        out = client.completions.create(model=NAME, prompt="They went to", max_tokens=10,
                                        temperature=1.0, seed=seed, extra_body=extra)
        assert out.choices[0].text in ("Bath", "London", "Highbury")


def test_regex_and_json_object(client):
    date = r"1[78]\d{2}-(0[1-9]|1[0-2])-[0-2]\d"
    for extra in ({"structured_outputs": {"regex": date}}, {"guided_regex": date}):
        out = client.completions.create(model=NAME, prompt="Dated", max_tokens=12,
                                        temperature=1.0, seed=3, extra_body=extra)
        assert re.fullmatch(date, out.choices[0].text, re.ASCII)
    out = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Answer"}], max_tokens=200, seed=1,
        temperature=0.7, response_format={"type": "json_object"})
    if out.choices[0].finish_reason == "stop":  # else it ran out of tokens inside a string
        assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_echo_returns_prompt_log_probabilities_like_transformers(client, hf_model):
    ids = [0, 1026, 377, 1500, 92, 4000, 12]
    out = client.completions.create(model=NAME, prompt=[ids], max_tokens=1, logprobs=2,
                                    echo=True, temperature=0)
    logprobs = out.choices[0].logprobs
    assert len(logprobs.token_logprobs) == len(ids) + 1
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = reference_logprobs(hf_model, ids)
    for p in range(1, len(ids)):
        assert logprobs.token_logprobs[p] == pytest.approx(expected[p - 1, ids[p]], abs=1e-4)
        assert max(logprobs.top_logprobs[p].values()) == pytest.approx(
            expected[p - 1].max(), abs=1e-4)
    generated = int(expected[-1].argmax())
    assert logprobs.token_logprobs[-1] == pytest.approx(expected[-1, generated], abs=1e-4)
    assert out.choices[0].text == "".join(logprobs.tokens)  # the prompt's, then the new
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i]))
                                    for i in range(len(logprobs.tokens))]


def test_echo_max_tokens_zero_and_prompt_logprobs_extra(server, hf_model):
    text = "It is a truth universally acknowledged"
    body = {"model": NAME, "prompt": text, "max_tokens": 0, "echo": True, "logprobs": 0,
            "prompt_logprobs": 1}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    choice = answer["choices"][0]
    assert choice["text"] == text and answer["usage"]["completion_tokens"] == 0
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": text}).json()["tokens"]
    expected = reference_logprobs(hf_model, ids)
    assert len(choice["logprobs"]["token_logprobs"]) == len(ids)
    assert choice["prompt_logprobs"][0] is None
    for p in range(1, len(ids)):
        entry = choice["prompt_logprobs"][p]
        assert entry[str(ids[p])]["logprob"] == pytest.approx(expected[p - 1, ids[p]],
                                                              abs=1e-4)
        best = str(int(expected[p - 1].argmax()))
        assert entry[best]["rank"] == 1
        assert choice["logprobs"]["token_logprobs"][p] == pytest.approx(
            expected[p - 1, ids[p]], abs=1e-4)


def test_batched_token_prompts_come_back_in_order(client):
    prompts = [[0, 1026, 377], [0, 92, 4000, 12], [0, 55]]
    batch = client.completions.create(model=NAME, prompt=prompts, max_tokens=6,
                                      temperature=0, logprobs=1, echo=True)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    for prompt, choice in zip(prompts, batch.choices):
        alone = client.completions.create(model=NAME, prompt=[prompt], max_tokens=6,
                                          temperature=0, logprobs=1, echo=True).choices[0]
        assert choice.text == alone.text
        assert choice.logprobs.tokens == alone.logprobs.tokens
        assert choice.logprobs.token_logprobs[0] is None
        np.testing.assert_allclose(choice.logprobs.token_logprobs[1:],
                                   alone.logprobs.token_logprobs[1:], atol=1e-4)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"guided_regex": "("}, "guided_regex"),
    ({"structured_outputs": {"grammar": "start: ((("}}, "structured_outputs"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_regex"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"stop": ["s"] * 33}, "stop"),  # the default caps (jaxserve.server.limits)
    ({"stop": "s" * 257}, "stop"),
    ({"guided_choice": ["c" * 1000] * 66}, "guided_choice"),  # 66 KB as JSON, past 64 KiB
])
def test_bad_fields_are_named(server, body, param):
    answer = httpx.post(f"{server.url}/v1/completions",
                        json={"model": NAME, "prompt": "x", "max_tokens": 4, **body})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


def test_nothing_compiled_after_warm_up(server, client):
    client.completions.create(model=NAME, prompt="Last", max_tokens=4,
                              extra_body={"guided_choice": ["yes", "no"]})
    assert server.state.engine.engine.stats().compiles_after_warmup == 0


def test_streamed_echo_adds_up_to_the_whole(client):
    kwargs = dict(model=NAME, prompt="She smiled", max_tokens=5, temperature=0, echo=True,
                  logprobs=1)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True)
              if c.choices]
    assert "".join(c.text for c in chunks) == whole.text
    streamed = [lp for c in chunks if c.logprobs for lp in c.logprobs.token_logprobs]
    assert streamed[0] is None and len(streamed) == len(whole.logprobs.token_logprobs)
    np.testing.assert_allclose(streamed[1:], whole.logprobs.token_logprobs[1:], atol=1e-5)
