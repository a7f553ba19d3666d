"""vLLM's tokenizer routes (`/tokenize`, `/detokenize`, `/tokenizer_info`) on a live server of
the shipped model, checked against `transformers`' tokenizer of the same folder: the ids of a
prompt and of chat messages, the text of ids, and the errors naming the bad field."""

from collections.abc import Mapping

import httpx
import pytest
import transformers
from lm_eval import utils as lm_eval_utils

from jaxserve.default_model import DEFAULT_MODEL_DIR
from jaxserve.server.state import ServerOptions, ServerState
from jaxserve.server.tokenizer_routes import add_tokenizer_routes
from server_helpers import ThreadedServer
from tiny_models import SMALL_ENGINE

NAME = "austen"
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Héllo there, Mr. Darcy! 🦊"}]


@pytest.fixture(scope="module")
def server():
    """The shipped model served with the tokenizer routes (added here until `create_app`
    registers them itself)."""
    state = ServerState(ServerOptions(model=str(DEFAULT_MODEL_DIR), served_model_name=[NAME],
                                      dtype="float32", engine_options=SMALL_ENGINE))
    running = ThreadedServer(state)
    app = running.server.config.app
    if not any(getattr(route, "path", None) == "/tokenize" for route in app.routes):
        add_tokenizer_routes(app, state, [])
    running.start()
    try:
        running.wait_ready()
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def hf_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)


def post(server, path, body):
    """POST `body` as JSON; bytes are sent as they are (JSON that Python cannot write)."""
    if isinstance(body, bytes):
        return httpx.post(f"{server.url}{path}", content=body, timeout=60,
                          headers={"content-type": "application/json"})
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def chat_ids(hf_tokenizer, messages, add_generation_prompt=True):
    out = hf_tokenizer.apply_chat_template(messages, tokenize=True,
                                           add_generation_prompt=add_generation_prompt)
    return list(out["input_ids"] if isinstance(out, Mapping) else out)


@pytest.mark.parametrize("text", ["Once upon a time", "  two  spaces\nand a line ", "日本語 ∑",
                                  ""])
def test_tokenize_prompt_equals_transformers(server, hf_tokenizer, text):
    body = post(server, "/tokenize", {"model": NAME, "prompt": text}).json()
    expected = hf_tokenizer(text).input_ids
    assert body["tokens"] == expected and body["count"] == len(expected)
    assert body["max_model_len"] == SMALL_ENGINE["max_model_len"]
    plain = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == hf_tokenizer(text, add_special_tokens=False).input_ids


def test_tokenize_chat_equals_apply_chat_template(server, hf_tokenizer):
    body = post(server, "/tokenize", {"messages": MESSAGES}).json()
    assert body["tokens"] == chat_ids(hf_tokenizer, MESSAGES)
    assert body["count"] == len(body["tokens"])
    bare = post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert bare.json()["tokens"] == chat_ids(hf_tokenizer, MESSAGES, False)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello "},
                                          {"type": "text", "text": "there"}]}]
    joined = post(server, "/tokenize", {"messages": parts}).json()["tokens"]
    assert joined == chat_ids(hf_tokenizer, [{"role": "user", "content": "Hello there"}])


def test_token_strs_only_when_asked(server, hf_tokenizer):
    assert "token_strs" not in post(server, "/tokenize", {"prompt": "Emma"}).json()
    body = post(server, "/tokenize", {"prompt": "Emma Woodhouse", "return_token_strs": True})
    tokens, strs = body.json()["tokens"], body.json()["token_strs"]
    assert strs == hf_tokenizer.convert_ids_to_tokens(tokens) and strs[0] == "<s>"


def test_detokenize_equals_transformers_decode(server, hf_tokenizer):
    ids = hf_tokenizer("It is a truth universally acknowledged, that a single man").input_ids
    ids = ids + [1, 300, 4095]
    body = post(server, "/detokenize", {"model": NAME, "tokens": ids}).json()
    assert body == {"prompt": hf_tokenizer.decode(ids)}
    assert post(server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


def test_tokenizer_info_has_what_clients_read(server, hf_tokenizer):
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (info["bos_token"], info["eos_token"]) == (hf_tokenizer.bos_token,
                                                      hf_tokenizer.eos_token)
    assert info["pad_token"] == hf_tokenizer.pad_token
    assert info["model_max_length"] == hf_tokenizer.model_max_length
    assert info["max_model_len"] == SMALL_ENGINE["max_model_len"]
    assert info["chat_template"] == hf_tokenizer.chat_template
    assert str(DEFAULT_MODEL_DIR) not in str(info)


def test_lm_eval_remote_tokenizer_works_against_these_routes(server, hf_tokenizer):
    """lm-eval's `local-completions` tokenizes on the server when these routes answer as
    vLLM's do (`tokenizer_backend=auto` probes them; `remote` uses them)."""
    base_url = f"{server.url}/v1/completions"
    assert lm_eval_utils.check_remote_tokenizer_support(base_url)
    remote = lm_eval_utils.RemoteTokenizer(base_url)
    text = "Emma Woodhouse, handsome, clever, and rich"
    ids = remote.encode(text)
    assert ids == hf_tokenizer(text, add_special_tokens=False).input_ids
    assert remote.decode(ids) == text
    assert (remote.eos_token_id, remote.bos_token_id) == (hf_tokenizer.eos_token_id,
                                                          hf_tokenizer.bos_token_id)


BAD_INPUTS = [
    # (path, body, status, param)
    ("/tokenize", {}, 400, None),  # neither prompt nor messages: no one field to blame
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, 400, "messages"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", b'{"prompt": "\\ud800"}', 400, "prompt"),  # a lone surrogate
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "maybe"}, 400, "add_special_tokens"),
    ("/tokenize", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("/detokenize", {"tokens": [5, 4096]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [2**70]}, 400, "tokens"),
    ("/detokenize", {"tokens": "5 6"}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"model": "gpt-9", "tokens": [5]}, 404, "model"),
]


@pytest.mark.parametrize("path, body, status, param", BAD_INPUTS)
def test_bad_input_gets_openai_error_naming_the_field(server, path, body, status, param):
    response = post(server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]


def test_503_while_not_ready_and_400_without_a_tokenizer(server, monkeypatch):
    monkeypatch.setattr(server.state, "ready", False)
    for path, body in [("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [5]})]:
        response = post(server, path, body)
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "service_unavailable"
    assert httpx.get(f"{server.url}/tokenizer_info").status_code == 503
    monkeypatch.setattr(server.state, "ready", True)
    monkeypatch.setattr(server.state.llm, "tokenizer", None)
    for path, body, param in [("/tokenize", {"prompt": "x"}, "prompt"),
                              ("/tokenize", {"messages": MESSAGES}, "messages"),
                              ("/detokenize", {"tokens": [5]}, "tokens")]:
        response = post(server, path, body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param
    assert httpx.get(f"{server.url}/tokenizer_info").status_code == 400
