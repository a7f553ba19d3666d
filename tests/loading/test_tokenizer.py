"""Tokenizer wrapper, sandboxed chat templates and UTF-8-safe streaming detokenization."""

import json

import pytest
from jinja2.exceptions import SecurityError, TemplateError

from jaxserve.errors import InvalidRequestError
from jaxserve.loading.tokenizer import IncrementalDetokenizer, Tokenizer
from tiny_models import build_tokenizer

pytestmark = pytest.mark.quick  # seconds, no engine: `pytest -m quick`

TEXT = "Héllo wörld 🦊🌲 日本語 and ∑ √ done."


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    build_tokenizer(folder)
    return Tokenizer(folder)


def test_special_tokens_and_round_trip(tokenizer):
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<s>", "</s>")
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1)
    assert tokenizer.decode(tokenizer.encode(TEXT)) == TEXT


def test_streaming_never_splits_a_character(tokenizer):
    ids = tokenizer.encode(TEXT)
    # Byte-level BPE must split some of these characters across tokens for this to test much.
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add([t]) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == TEXT == detok.text


def test_streaming_in_uneven_chunks(tokenizer):
    ids = tokenizer.encode(TEXT)
    detok = IncrementalDetokenizer(tokenizer)
    chunks = [ids[i:i + 3] for i in range(0, len(ids), 3)]
    assert "".join(detok.add(c) for c in chunks) == TEXT


def test_chat_template_renders_with_special_tokens(tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    rendered = tokenizer.apply_chat_template(messages)
    assert rendered == "<s><|user|>Hi</s><|assistant|>"
    ids = tokenizer.encode_chat(messages)
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1


def test_chat_template_is_sandboxed(tmp_path):
    build_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidRequestError, match="refused by the sandbox") as refused:
        Tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])
    assert isinstance(refused.value.__context__, SecurityError)
    assert refused.value.field == "messages"
    config["chat_template"] = "{{ raise_exception('no system role') }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidRequestError, match="no system role") as failed:
        Tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])
    assert isinstance(failed.value.__context__, TemplateError)


def test_bad_messages_and_missing_files(tokenizer, tmp_path):
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        tokenizer.apply_chat_template([{"content": "no role"}])
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer(tmp_path)
