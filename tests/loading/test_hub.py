"""Hub ids as model names (`jaxserve.loading.hub`), offline against a local Hugging Face cache
laid out as `huggingface_hub` lays it out (`models--ORG--NAME/refs/REV`, `snapshots/COMMIT/`);
no test reaches the network."""

import os
import shutil
import subprocess
import sys

import pytest
from huggingface_hub import constants

from jaxserve import LLM, SamplingParams
from jaxserve.loading.hub import resolve_model
from tiny_models import SMALL_ENGINE

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(folder, tmp_path, monkeypatch):
    """A cache holding the tiny model as `acme/tiny-llama` (main and tag v1 at one commit),
    with huggingface_hub offline and pointed at it."""
    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    shutil.copytree(folder, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    for ref in ("main", "v1"):
        (repo / "refs" / ref).write_text(COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hub"


def test_a_hub_id_reads_the_local_cache_offline(hub_cache, folder):
    snapshot = hub_cache / "models--acme--tiny-llama" / "snapshots" / COMMIT
    assert resolve_model("acme/tiny-llama") == snapshot
    assert resolve_model("acme/tiny-llama@v1") == snapshot
    assert resolve_model(f"acme/tiny-llama@{COMMIT}") == snapshot
    assert resolve_model(folder) == folder  # a folder is itself
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    by_id = LLM("acme/tiny-llama", progress=False, **SMALL_ENGINE).generate("Once upon", params)
    by_path = LLM(str(folder), progress=False, **SMALL_ENGINE).generate("Once upon", params)
    assert by_id[0].outputs[0].token_ids == by_path[0].outputs[0].token_ids


@pytest.mark.parametrize("name, message", [
    ("acme/other-model", "the local Hugging Face cache (HF_HUB_OFFLINE is set) has no "
                         "acme/other-model"),
    ("acme/tiny-llama@v2", "has no acme/tiny-llama@v2"),
    ("/no/such/folder", "is not a folder (nor a Hugging Face Hub id"),
    ("not a name", "is not a folder (nor a Hugging Face Hub id"),
])
def test_a_missing_model_names_what_was_tried(hub_cache, name, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_model(name)


def test_serve_with_a_missing_hub_id_exits_2_naming_the_cache(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "jaxserve.cli", "serve", "--port", "0",
                          "--model", "acme/tiny-llama"], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 2
    assert "has no acme/tiny-llama; cache: " + str(tmp_path) in out.stderr
