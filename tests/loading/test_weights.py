"""Safetensors loading: sharded folders, and a clear error for every kind of bad folder."""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import load_file, save_file
from safetensors.torch import save_file as save_torch_file

from jaxserve.model.hf_config import load_config
from jaxserve.loading.weights import load_weights, mapped_tensors
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


def test_mapped_tensors_equal_safetensors_own_reader(tmp_path):
    """Every dtype the loader reads, a zero-element and a 0-d tensor, against safetensors'
    reader (torch, which knows bfloat16 and float8), in file order, as read-only views."""
    tensors = {"f32": torch.randn(3, 5), "bf16": torch.randn(4, 2).to(torch.bfloat16),
               "f16": torch.randn(7).to(torch.float16),
               "f8": (torch.randn(2, 3) * 8).to(torch.float8_e4m3fn),
               "i8": torch.arange(-6, 6, dtype=torch.int8).reshape(3, 4),
               "empty": torch.zeros(0, 4), "scalar": torch.tensor(2.5)}
    file = tmp_path / "all.safetensors"
    save_torch_file(tensors, str(file))
    with safe_open(str(file), framework="pt") as reader:
        want = {name: reader.get_tensor(name) for name in reader.keys()}
    got = dict(mapped_tensors(file))
    assert set(got) == set(want)
    for name, array in got.items():
        reference = want[name]
        assert array.shape == tuple(reference.shape), name
        assert array.dtype.itemsize == reference.element_size(), name
        np.testing.assert_array_equal(array.astype(np.float32),
                                      reference.to(torch.float32).numpy(), err_msg=name)
        assert array.size == 0 or not array.flags.writeable, name


def test_broken_safetensors_files_are_named(tmp_path):
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty.safetensors is not a safetensors file"):
        list(mapped_tensors(empty))
    good = tmp_path / "good.safetensors"
    save_file({"w": np.ones((4, 4), np.float32)}, str(good))
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:-8])
    with pytest.raises(ValueError, match="truncated.safetensors: tensor 'w'.*data_offsets"):
        list(mapped_tensors(truncated))
    garbled = tmp_path / "garbled.safetensors"
    raw = good.read_bytes()
    garbled.write_bytes(raw[:8] + b"{" * (len(raw) - 8))
    with pytest.raises(ValueError, match="garbled.safetensors: safetensors header"):
        list(mapped_tensors(garbled))
