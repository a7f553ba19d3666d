"""What an adapter may not carry into a step it shares (`jaxserve.lora.adapter`): non-finite
config values or tensors, a scaling beyond float32, 0-d tensors, rank 0 and malformed
safetensors headers are refused with a `ValueError` naming the field or tensor (the server's
400), never an IndexError or KeyError (a 500); an oversized rank is refused from the header,
before any tensor is read; a Hub adapter's config is checked before its weights are fetched,
and nothing but its two files is fetched."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from jaxserve.loading.checkpoint import model_config
from jaxserve.lora.adapter import load_adapter
from peft_adapters import ADAPTERS, write_adapter

pytestmark = pytest.mark.quick
WEIGHTS = "adapter_model.safetensors"
B_OF_Q0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.fixture(scope="module")
def base(folder):
    return folder


@pytest.fixture(scope="module")
def attn(base, tmp_path_factory):
    out = tmp_path_factory.mktemp("attn")
    write_adapter(base, out, 0, **ADAPTERS["attn"])  # r=4, q/v/o
    return out


def copy_of(adapter: Path, to: Path, config: str | None = None, tensors=None) -> Path:
    """`adapter` copied to `to`, with `config` as its adapter_config.json text and
    `tensors` ({name: torch tensor}) as its weights if given."""
    shutil.copytree(adapter, to)
    if config is not None:
        (to / "adapter_config.json").write_text(config)
    if tensors is not None:
        save_file(tensors, to / WEIGHTS)
    return to


def config_text(adapter: Path, **raw: str) -> str:
    """adapter_config.json with fields set to `raw` JSON text (NaN, 1e400: what Python's
    json module reads, and what `json.dumps` would not write as given)."""
    config = json.loads((adapter / "adapter_config.json").read_text())
    for name in raw:
        config[name] = f"@{name}@"
    text = json.dumps(config)
    for name, value in raw.items():
        text = text.replace(f'"@{name}@"', value)
    return text


@pytest.mark.parametrize("raw, named", [
    ({"lora_alpha": "NaN"}, "lora_alpha"), ({"lora_alpha": "1e400"}, "lora_alpha"),
    ({"lora_alpha": "-Infinity"}, "lora_alpha"), ({"r": "NaN"}, "r"),
    ({"rank_pattern": '{"q_proj": Infinity}'}, "rank_pattern.q_proj"),
])
def test_non_finite_config_values_are_refused_by_name(base, attn, tmp_path, raw, named):
    folder = copy_of(attn, tmp_path / "a", config=config_text(attn, **raw))
    with pytest.raises(ValueError, match=f"{named} must be a finite number"):
        load_adapter(folder, model_config(base), 8)


def test_a_scaling_beyond_float32_is_refused(base, attn, tmp_path):
    folder = copy_of(attn, tmp_path / "a", config=config_text(attn, lora_alpha="1e300"))
    with pytest.raises(ValueError, match="lora_alpha 1e\\+300 scales .*beyond float32"):
        load_adapter(folder, model_config(base), 8)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_tensors_are_refused_by_name(base, attn, tmp_path, bad):
    tensors = load_file(attn / WEIGHTS)
    tensors[B_OF_Q0] = tensors[B_OF_Q0].clone()
    tensors[B_OF_Q0][3, 1] = bad
    folder = copy_of(attn, tmp_path / "a", tensors=tensors)
    with pytest.raises(ValueError, match=f"tensor '{B_OF_Q0}' holds non-finite values"):
        load_adapter(folder, model_config(base), 8)


def rank_zero(tensors):
    return {k: v[:0] if ".lora_A." in k else v[:, :0] for k, v in tensors.items()}


def zero_d(tensors):
    return {**tensors, B_OF_Q0: torch.tensor(1.0)}


@pytest.mark.parametrize("edit, message", [
    (rank_zero, "has rank 0"),
    (zero_d, f"tensor '{B_OF_Q0}' has shape \\[\\]; a LoRA weight is a matrix"),
])
def test_degenerate_tensors_are_refused_by_name(base, attn, tmp_path, edit, message):
    folder = copy_of(attn, tmp_path / "a", tensors=edit(load_file(attn / WEIGHTS)))
    with pytest.raises(ValueError, match=message):
        load_adapter(folder, model_config(base), 8)


def with_header(header, data: bytes = b"") -> bytes:
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


@pytest.mark.parametrize("content, message", [
    (with_header([1, 2]), "header is not a JSON object"),
    (with_header({B_OF_Q0: {"dtype": "F32", "shape": [4, 4]}}, bytes(64)),
     "malformed safetensors header: tensor .* needs a dtype, a shape and two data_offsets"),
    (with_header({B_OF_Q0: {"dtype": "F32", "shape": [4, "x"], "data_offsets": [0, 64]}},
                 bytes(64)), "malformed safetensors header"),
    (b"\xff" * 16, "is not a safetensors file"),
], ids=["not-an-object", "no-offsets", "bad-shape", "not-safetensors"])
def test_malformed_safetensors_headers_are_refused(base, attn, tmp_path, content, message):
    folder = copy_of(attn, tmp_path / "a")
    (folder / WEIGHTS).write_bytes(content)
    with pytest.raises(ValueError, match=message):
        load_adapter(folder, model_config(base), 8)


def test_an_oversized_rank_is_refused_before_any_tensor_is_read(base, attn, tmp_path):
    """A header declaring rank 4096 tensors over a file too short to hold them: the rank is
    what is refused, so nothing was read (reading first would meet the missing data)."""
    cfg = model_config(base)
    rank = 4096
    header, offset = {}, 0
    for which, shape in (("A", [rank, cfg.hidden_size]),
                         ("B", [cfg.num_heads * cfg.head_dim, rank])):
        end = offset + 4 * shape[0] * shape[1]
        header[B_OF_Q0.replace("lora_B", f"lora_{which}")] = {
            "dtype": "F32", "shape": shape, "data_offsets": [offset, end]}
        offset = end
    folder = copy_of(attn, tmp_path / "a")
    (folder / WEIGHTS).write_bytes(with_header(header, bytes(1024)))
    with pytest.raises(ValueError, match=f"rank {rank} .* exceeds max_lora_rank=8"):
        load_adapter(folder, cfg, 8)


def test_a_hub_adapter_is_checked_before_its_weights_are_fetched(base, attn, tmp_path,
                                                                 monkeypatch):
    """`huggingface_hub.hf_hub_download` stood in for by a fake Hub serving the files of
    local repositories: every file asked for is recorded."""
    import huggingface_hub

    repos = {"org/good": attn, "org/bad": copy_of(attn, tmp_path / "bad", config=config_text(
        attn, lora_alpha="NaN"))}
    asked = []

    def download(repo_id, filename, revision=None, **_):
        asked.append((repo_id, filename, revision))
        snapshot = tmp_path / "cache" / repo_id / "commit0"
        snapshot.mkdir(parents=True, exist_ok=True)
        shutil.copy(repos[repo_id] / filename, snapshot / filename)
        return str(snapshot / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: pytest.fail(
        "a whole snapshot was fetched"))
    with pytest.raises(ValueError, match="lora_alpha must be a finite number"):
        load_adapter("org/bad", model_config(base), 8)
    assert asked == [("org/bad", "adapter_config.json", None)]
    asked.clear()
    adapter = load_adapter("org/good@v1", model_config(base), 8)
    assert asked == [("org/good", "adapter_config.json", "v1"),
                     ("org/good", WEIGHTS, "commit0")]
    np.testing.assert_array_equal(adapter.stacks["q_proj"][0],
                                  load_adapter(attn, model_config(base), 8).stacks["q_proj"][0])
