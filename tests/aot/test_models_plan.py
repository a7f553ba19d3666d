"""`jaxserve plan --models`: the engines of a models file planned together, in file order,
each cache sized from what the engines before it left on its devices. Page counts are checked
against numbers computed here from the model shapes and the device's memory alone."""

import argparse
import contextlib
import io
import json
import re

import pytest

from jaxserve.aot import models_plan
from jaxserve.aot.models_plan import (device_usage, format_models_plan, plan_models_file,
                                      resolve_entries, run_models_plan)
from jaxserve.aot.targets import TPU_KINDS
from jaxserve.presets import CPU_PRESET
from test_plan import TINY  # the same config-only model as the single-preset plans

# The smallest ladders: one step and one decode program per engine.
PRESET = """
[hardware]
platform = "tpu"
devices = {devices}
accelerator = "{accelerator}"
[mesh]
tensor_parallel_size = {tp}
[model]
dtype = "bfloat16"
max_model_len = 256
[kv_cache]
page_size = 16
kv_cache_memory_fraction = 0.5
[batching]
max_num_seqs = 2
max_num_batched_tokens = 16
num_decode_steps = 2
token_buckets = [16]
seq_buckets = [2]
"""
HBM = TPU_KINDS["v5e"].hbm_bytes


def write_setup(folder, entries: str, presets: dict[str, tuple[str, int, int]],
                models: dict[str, dict]) -> str:
    """A models file with `entries` (TOML), presets `name → (accelerator, devices, tp)` and
    config-only model folders `name → config.json`, all in `folder`; returns the file path."""
    for name, (accelerator, devices, tp) in presets.items():
        (folder / f"{name}.toml").write_text(
            PRESET.format(accelerator=accelerator, devices=devices, tp=tp))
    for name, config in models.items():
        (folder / name).mkdir()
        (folder / name / "config.json").write_text(json.dumps(config))
    (folder / "models.toml").write_text(entries)
    return str(folder / "models.toml")


def weight_bytes(config: dict, tp: int = 1) -> int:
    """bfloat16 bytes per device: every matrix split over `tp` devices (heads, kv heads, MLP
    hidden and vocabulary all divide here), the norms whole on each."""
    e, i, v, hq, hkv, d, layers = (config[k] for k in (
        "hidden_size", "intermediate_size", "vocab_size", "num_attention_heads",
        "num_key_value_heads", "head_dim", "num_hidden_layers"))
    matrices = 2 * v * e + layers * (2 * e * hq * d + 2 * e * hkv * d + 3 * e * i)
    norms = e + layers * 2 * e
    return 2 * (matrices // tp + norms)


def page_bytes(config: dict, tp: int = 1) -> int:
    """Keys and values of 16 tokens, every layer, this device's kv heads, bfloat16."""
    return 2 * config["num_hidden_layers"] * 16 * config["num_key_value_heads"] * 128 * 2 // tp


def test_bad_entries_fail_before_any_compile(tmp_path, monkeypatch):
    monkeypatch.setattr(models_plan, "build_plan", lambda *a, **k: pytest.fail("compiled"))
    path = write_setup(tmp_path, "", {"v5e": ("v5e", 1, 1), "v6e": ("v6e", 1, 1)},
                       {"tiny": TINY})
    cases = {  # the entries → what the error says
        '[[models]]\nname = "a"\npath = "tiny"\n': "a@1: config: planning needs a TPU/GPU",
        '[[models]]\nname = "a"\npath = "tiny"\nconfig = "v5e.toml"\n'
        '[[models]]\nname = "b"\npath = "tiny"\nconfig = "v6e.toml"\n':
            "b@1: config: its preset is for tpu v6e, but a@1's is for tpu v5e",
        '[[models]]\nname = "a"\npath = "missing"\nconfig = "v5e.toml"\n':
            "a@1: path: ",
        '[[models]]\nname = "a"\npath = "tiny"\nconfig = "v5e.toml"\ndevices = [1]\n':
            "a@1: devices [1] are out of range",
        '[[models]]\nname = "a"\npath = "tiny"\nconfig = "v5e.toml"\nmax_model_len = 4096\n':
            "a@1: max_model_len (4096) exceeds",
    }
    for entries, message in cases.items():
        (tmp_path / "models.toml").write_text(entries)
        with pytest.raises(ValueError, match=re.escape(message)):
            plan_models_file(path)
    cpu = '[[models]]\nname = "a"\npath = "tiny"\nconfig = "{}"\n'
    (tmp_path / "models.toml").write_text(cpu.format(CPU_PRESET))
    with pytest.raises(ValueError, match="a@1: cpu.toml: plans are for tpu and gpu presets"):
        plan_models_file(path)


def test_a_reference_shape_name_stands_for_a_model_folder(tmp_path):
    path = write_setup(tmp_path, '[[models]]\nname = "a"\npath = "llama-3.2-3b"\n'
                       'config = "v5e.toml"\n', {"v5e": ("v5e", 1, 1)}, {})
    target, (entry,) = resolve_entries(path)
    assert entry.model_dir.name == "llama-3.2-3b" and (entry.model_dir / "config.json").is_file()
    assert target.devices == 1 and entry.devices == (0,)


def test_a_later_engine_can_crowd_an_earlier_engines_programs():
    """Bytes per device, made up: once b is loaded beside a, a's largest program (14 of it,
    10 resident) has only 18 - 5 = 13 left."""
    def engine(name, devices, resident, peaks):
        programs = [{"name": "step", "tokens": 16, "seqs": 2, "compiled": True,
                     "peak_bytes": p} for p in peaks]
        return {"pinned_id": name, "devices": devices, "resident_bytes_per_device": resident,
                "fits": True, "plan": {"programs": programs, "reason": None}}

    engines = [engine("a@1", [0], 10, [12, 14]), engine("b@1", [0, 1], 5, [6])]
    usage = device_usage(engines, 3, hbm=18)
    assert [(d["engines"], d["resident_bytes"], d["peak_bytes"], d["fits"]) for d in usage] == [
        (["a@1", "b@1"], 15, 19, False), (["b@1"], 5, 6, True), ([], 0, 0, True)]
    fits, reason = models_plan._verdict(engines, usage, hbm=18)
    assert not fits and reason.startswith("device 0: a@1 step (16, 2) needs")


@pytest.mark.slow
def test_two_engines_on_one_device_share_what_is_free(tmp_path):
    wide = {**TINY, "vocab_size": 4096}
    path = write_setup(tmp_path, """
[[models]]
name = "first"
path = "tiny"
config = "v5e.toml"
[[models]]
name = "second"
path = "wide"
config = "v5e.toml"
kv_cache_memory_fraction = 0.4
""", {"v5e": ("v5e", 1, 1)}, {"tiny": TINY, "wide": wide})
    out = io.StringIO()
    args = argparse.Namespace(models=path, json=True, buckets="ends", verbose=False,
                              dtype=None)
    with contextlib.redirect_stdout(out):
        code = run_models_plan(args)
    result = json.loads(out.getvalue())
    assert code == 0 and result["fits"], result["reason"]
    assert (result["target"], result["devices"], result["hbm_bytes_per_device"]) == (
        "v5e:1x1", 1, HBM)
    first, second = result["engines"]
    page = page_bytes(TINY)  # the same cache shape for both
    first_pages = int((HBM - weight_bytes(TINY)) * 0.5) // page
    first_resident = weight_bytes(TINY) + first_pages * page
    second_pages = int((HBM - first_resident - weight_bytes(wide)) * 0.4) // page
    assert (first["weights_bytes_per_device"], first["num_pages"]) == (
        weight_bytes(TINY), first_pages)
    assert (second["weights_bytes_per_device"], second["num_pages"]) == (
        weight_bytes(wide), second_pages)
    assert (first["in_use_bytes_before"], second["in_use_bytes_before"]) == (0, first_resident)
    assert second["kv_cache_bytes_per_device"] == second_pages * page
    (device,) = result["device_usage"]
    assert device["engines"] == ["first@1", "second@1"]
    assert device["resident_bytes"] == first_resident + weight_bytes(wide) + second_pages * page
    # the largest peak: a program of one engine beside the other's weights and cache
    assert device["peak_bytes"] == max(
        device["resident_bytes"] - e["resident_bytes_per_device"] + p["peak_bytes"]
        for e in (first, second) for p in e["plan"]["programs"])
    assert device["resident_bytes"] < device["peak_bytes"] <= HBM
    assert all(p["compiled"] and p["cache_donated"]
               for e in (first, second) for p in e["plan"]["programs"])
    table = format_models_plan(result)
    assert "fits: yes" in table and "second@1 (wide, v5e.toml) on devices [0]" in table


@pytest.mark.slow
def test_engines_on_disjoint_devices_each_get_a_whole_device(tmp_path):
    path = write_setup(tmp_path, """
[[models]]
name = "left"
path = "tiny"
config = "v5e-4.toml"
devices = [0, 1]
[[models]]
name = "right"
path = "tiny"
config = "v5e-4.toml"
devices = [2, 3]
""", {"v5e-4": ("v5e", 4, 2)}, {"tiny": TINY})
    result = plan_models_file(path, progress=False)
    assert result["fits"], result["reason"]
    assert (result["target"], result["devices"]) == ("v5e:2x2", 4)
    weights, page = weight_bytes(TINY, tp=2), page_bytes(TINY, tp=2)
    pages = int((HBM - weights) * 0.5) // page  # as if each engine were alone
    for engine, devices in zip(result["engines"], ([0, 1], [2, 3])):
        assert engine["devices"] == devices and engine["in_use_bytes_before"] == 0
        assert (engine["weights_bytes_per_device"], engine["num_pages"]) == (weights, pages)
    assert [d["engines"] for d in result["device_usage"]] == [
        ["left@1"], ["left@1"], ["right@1"], ["right@1"]]
    assert {d["resident_bytes"] for d in result["device_usage"]} == {weights + pages * page}


@pytest.mark.slow
def test_engines_that_cannot_fit_together_fail_naming_the_entry(tmp_path):
    """The first takes 0.95 of the device; the second's weights (a 512k vocabulary: 0.5 GiB
    of embedding and as much of head) do not fit in the rest."""
    path = write_setup(tmp_path, """
[[models]]
name = "greedy"
path = "tiny"
config = "v5e.toml"
kv_cache_memory_fraction = 0.95
[[models]]
name = "late"
path = "big"
config = "v5e.toml"
kv_cache_memory_fraction = 0.95
""", {"v5e": ("v5e", 1, 1)}, {"tiny": TINY, "big": {**TINY, "vocab_size": 1 << 19}})
    result = plan_models_file(path, progress=False)
    greedy, late = result["engines"]
    assert greedy["fits"] and not late["fits"] and not result["fits"]
    assert result["reason"].startswith("late@1: weights take ")
    assert "in use by other engines" in result["reason"]
    assert late["num_pages"] == 0 and late["plan"]["programs"] == []  # nothing compiled
    assert weight_bytes(TINY) + greedy["kv_cache_bytes_per_device"] + weight_bytes(
        {**TINY, "vocab_size": 1 << 19}) > HBM
