"""`jaxserve bench load` on a tiny synthetic Llama: the checkpoint it writes is the one the
loader expects, and the numbers it reports (model bytes, the largest tensor, peaks,
transients) agree with ones computed here by hand from the sizes."""

import argparse
import json

import numpy as np
import pytest
from safetensors import safe_open

from jaxserve.bench import load_bench
from jaxserve.loading.weights import hf_tensor_map
from jaxserve.model.hf_config import load_config

E, M, L, V, H, KV = 128, 192, 2, 3000, 4, 2  # hidden, intermediate, layers, vocab, heads
D = E // H
SIZES = dict(hidden_size=E, intermediate_size=M, layers=L, vocab_size=V, heads=H, kv_heads=KV)


def expected_model_bytes(method: str | None) -> int:
    """Bytes of the loaded model (bfloat16 compute), by hand: quantized weights take one
    byte per element plus a float32 scale per output channel; the rest is bfloat16."""
    per_layer = [(E * H * D, H * D), (E * KV * D, KV * D), (E * KV * D, KV * D),  # q, k, v
                 (H * D * E, E),  # o
                 (E * M, M), (E * M, M), (M * E, E)]  # gate, up, down
    weights = per_layer * L + [(V * E, V), (E * V, V)]  # + embedding (per row), lm head
    elements = sum(size for size, _ in weights)
    channels = sum(out for _, out in weights)
    norms = (2 * L + 1) * E
    if method is None:
        return 2 * (elements + norms)
    return elements + 4 * channels + 2 * norms


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("synthetic")
    config = load_bench.synthetic_config(**SIZES, source_dtype="float32")
    return load_bench.write_synthetic_model(folder, config, seed=1, progress=lambda _: None)


@pytest.fixture(scope="module")
def result(model_dir):
    return load_bench.run(model_dir, progress=lambda _: None, child_progress=False)


def test_synthetic_checkpoint_is_what_the_loader_expects(model_dir):
    cfg = load_config(model_dir)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.vocab_size,
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (E, M, L, V, H, KV, D)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    expected = hf_tensor_map(cfg)
    assert set(index["weight_map"]) == set(expected)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == L + 2  # the embedding, one per layer, the final norm and lm head
    assert index["weight_map"]["model.layers.1.mlp.up_proj.weight"] == files[2]
    total = 0
    for name in files:
        with safe_open(str(model_dir / name), framework="numpy") as reader:
            for tensor in reader.keys():
                value = reader.get_tensor(tensor)
                assert value.dtype == np.float32 and value.shape == expected[tensor][2]
                assert np.isfinite(value).all() and value.std() > 0
                total += value.nbytes
    assert index["metadata"]["total_size"] == total


def test_largest_tensor_and_checkpoint_bytes(result):
    largest = result["largest_tensor"]
    assert largest["name"] == "model.embed_tokens.weight"  # [V, E]; lm_head ties, comes after
    assert largest["shape"] == [V, E] and largest["dtype"] == "F32"
    assert largest["bytes"] == V * E * 4
    assert result["source_dtypes"] == ["F32"]
    assert result["checkpoint_bytes"] == expected_model_bytes(None) * 2  # float32 = 2 x bf16
    assert result["tensors"] == 2 + 1 + 9 * L


@pytest.mark.parametrize("variant", load_bench.VARIANTS)
def test_each_variant_reports_its_model_bytes_and_sane_peaks(result, variant):
    row = next(row for row in result["variants"] if row["variant"] == variant)
    assert row["platform"] == "cpu" and row["dtype"] == "bfloat16"
    assert row["model_bytes"] == expected_model_bytes(None if variant == "none" else variant)
    assert row["largest_tensor_bytes"] == V * E * 4
    assert row["samples"] > 0  # (peak_reset is false where /proc/self/clear_refs is closed)
    assert row["peak_rss"] >= row["baseline_rss"] > 0
    assert row["peak_rss"] >= max(row["sampled_peak_rss"], row["vm_hwm"]) > 0
    assert row["peak_growth"] >= row["model_bytes"]  # the model ends up in host memory
    assert row["transient"] == row["peak_growth"] - row["model_bytes"]
    assert row["transient_x_largest"] == pytest.approx(row["transient"] / (V * E * 4))
    assert row["anon_transient"] == row["peak_anon_growth"] - row["model_bytes"]
    assert row["seconds"] > 0


def test_summarize_arithmetic():
    raw = {"quantization": "int8", "dtype": "bfloat16", "platform": "cpu",
           "model_bytes": 100, "seconds": 2.0, "samples": 7, "peak_reset": True,
           "ru_maxrss": 5000,
           "baseline": {"VmRSS": 1000, "VmHWM": 1000, "RssAnon": 600, "RssFile": 400},
           "after": {"VmRSS": 1150, "VmHWM": 1900, "RssAnon": 740, "RssFile": 410},
           "sampled_peak": {"VmRSS": 1800, "RssAnon": 1300, "RssFile": 500}}
    row = load_bench.summarize(raw, largest_bytes=200)
    assert (row["peak_growth"], row["transient"], row["transient_x_largest"]) == (900, 800, 4.0)
    sampled_higher = load_bench.summarize(
        {**raw, "sampled_peak": {**raw["sampled_peak"], "VmRSS": 2100}}, largest_bytes=200)
    assert sampled_higher["peak_growth"] == 1100  # the larger of the mark and the samples
    assert (row["peak_anon_growth"], row["anon_transient"]) == (700, 600)
    assert (row["peak_file_growth"], row["retained"]) == (100, 50)
    on_device = load_bench.summarize({**raw, "platform": "gpu"}, largest_bytes=200)
    assert on_device["transient"] == 900  # the model is not in host memory
    table = load_bench.format_table({"model": "m", "dtype": "bfloat16", "tensors": 3,
                                     "checkpoint_bytes": 2 ** 20, "source_dtypes": ["BF16"],
                                     "variants": [row],
                                     "largest_tensor": {"name": "w", "shape": [2, 3],
                                                        "dtype": "BF16", "bytes": 200}})
    assert "int8" in table and "4.00" in table


def test_cli_json_output(capsys):
    parser = argparse.ArgumentParser()
    load_bench.add_arguments(parser)
    args = parser.parse_args(["--variants", "fp8", "--json", "--source-dtype", "bfloat16",
                              "--hidden-size", "64", "--intermediate-size", "96", "--layers",
                              "1", "--vocab-size", "500", "--heads", "4", "--kv-heads", "2"])
    assert load_bench.run_from_args(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["largest_tensor"]["bytes"] == 500 * 64 * 2
    assert [row["variant"] for row in result["variants"]] == ["fp8"]
    assert result["variants"][0]["model_bytes"] > 0
