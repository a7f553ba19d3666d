"""Safetensors loading: sharded folders, and a clear error for every kind of bad folder."""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from jaxserve.model.config import load_config
from jaxserve.loading.weights import load_weights
from tiny_models import build_model


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    build_model("llama", folder)
    return folder


def _copy_without_weights(src, dst):
    dst.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    return load_config(src)


def test_sharded_index_folder_loads_the_same_weights(tmp_path, model_folder):
    hf_model = build_model("llama", tmp_path / "src")
    sharded = tmp_path / "sharded"
    hf_model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    cfg = load_config(sharded)
    single = load_weights(tmp_path / "src", cfg, progress=False)
    split = load_weights(sharded, cfg, progress=False)
    assert np.array_equal(single.layers[1].attn.q_proj[...], split.layers[1].attn.q_proj[...])
    expected = hf_model.model.layers[1].self_attn.q_proj.weight.detach().numpy()  # [Hq*D, E]
    assert np.array_equal(np.asarray(split.layers[1].attn.q_proj[...]).reshape(64, -1).T,
                          expected)


def _rewrite(model_folder, dst, edit):
    cfg = _copy_without_weights(model_folder, dst)
    tensors = load_file(model_folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return cfg


def test_missing_tensor_is_named(tmp_path, model_folder):
    cfg = _rewrite(model_folder, tmp_path / "m",
                   lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match="missing tensor.*model.layers.1.mlp.up_proj.weight"):
        load_weights(tmp_path / "m", cfg, progress=False)


def test_unexpected_tensor_is_named(tmp_path, model_folder):
    cfg = _rewrite(model_folder, tmp_path / "m",
                   lambda t: t.update({"model.layers.9.extra": np.zeros(3, np.float32)}))
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.9.extra'"):
        load_weights(tmp_path / "m", cfg, progress=False)


def test_wrong_shape_is_named(tmp_path, model_folder):
    def shrink(t):
        t["model.norm.weight"] = t["model.norm.weight"][:10]
    cfg = _rewrite(model_folder, tmp_path / "m", shrink)
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(10,\)"):
        load_weights(tmp_path / "m", cfg, progress=False)


def test_pickle_weights_are_refused(tmp_path, model_folder):
    cfg = _copy_without_weights(model_folder, tmp_path / "m")
    torch.save({"x": torch.zeros(1)}, tmp_path / "m" / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickle"):
        load_weights(tmp_path / "m", cfg, progress=False)


def test_empty_folder_and_broken_index(tmp_path, model_folder):
    cfg = _copy_without_weights(model_folder, tmp_path / "m")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_weights(tmp_path / "m", cfg, progress=False)
    (tmp_path / "m" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(ValueError, match="missing file"):
        load_weights(tmp_path / "m", cfg, progress=False)
