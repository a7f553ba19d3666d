"""Deployment presets and the command line."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.cli.main import build_parser, resolve_model_settings
from jaxserve.config.engine import EngineConfig
from jaxserve.platforms import host_jax_platforms
from jaxserve.presets import CPU_PRESET, engine_settings, load_preset, shipped_presets

pytestmark = pytest.mark.quick  # seconds, no engine: `pytest -m quick`

ROOT = Path(__file__).resolve().parents[2]
PRESETS = sorted((ROOT / "tpu_configs").glob("*.toml")) + sorted(
    (ROOT / "gpu_configs").glob("*.toml")) + [CPU_PRESET]
EXPECTED = {"v5e-1", "v5e-4", "v5e-8", "v6e-1", "v6e-8", "v6e-8-moe", "v5p-8", "v5p-8-moe",
            "v6e-8-gemma3", "h100-1", "h100-8", "h200-1-gpt-oss", "h100-8-moe", "h200-1",
            "a100-80g-1", "cpu"}


def test_every_expected_preset_exists():
    assert {p.stem for p in PRESETS} == EXPECTED


def test_presets_ship_in_the_package_and_are_named():
    """The package reaches the repository's preset folders through links (so a wheel holds
    them: pyproject's package-data), and a preset is named by its file's stem."""
    shipped = shipped_presets()
    assert set(shipped) == EXPECTED
    assert {p.resolve() for p in shipped.values()} == {p.resolve() for p in PRESETS}
    assert load_preset("v6e-8").engine_options == load_preset(
        ROOT / "tpu_configs" / "v6e-8.toml").engine_options
    with pytest.raises(ValueError, match="shipped: v5e-1, .*h200-1"):
        load_preset("v6e-9")
    out = subprocess.run([sys.executable, "-m", "jaxserve.cli", "plan", "--list"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    rows = {line.split()[0]: line.split()[1] for line in out.stdout.splitlines()[1:]}
    assert rows == {name: load_preset(path).platform for name, path in shipped.items()}


def test_a_preset_for_other_hardware_is_refused_before_anything_loads():
    """`serve --config h200-1` on CPU: exit 2 naming the platforms before the weights are
    read, and no line from probing libtpu or CUDA (the command line points JAX at the
    platforms whose device files this host has)."""
    with pytest.raises(ValueError, match="preset h200-1 is for gpu; this machine has cpu"):
        engine_settings("h200-1", "cpu", {})
    if host_jax_platforms() != "cpu":
        pytest.skip("this host has an accelerator")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    out = subprocess.run([sys.executable, "-m", "jaxserve.cli", "serve", "--config", "h200-1"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "jaxserve: error: preset h200-1 is for gpu; this machine has cpu devices — leave out "
        "--config, or use `jaxserve plan --config h200-1` to compile for it without the "
        "hardware"]


def test_the_host_platforms_come_from_its_device_files(tmp_path, monkeypatch):
    import jaxserve.platforms as platforms

    monkeypatch.setattr(platforms, "DEVICE_FILES", (
        ("tpu", (str(tmp_path / "accel[0-9]*"),)), ("cuda", (str(tmp_path / "nvidia[0-9]*"),))))
    assert host_jax_platforms() == "cpu"
    (tmp_path / "nvidia0").touch()
    assert host_jax_platforms() == "cuda,cpu"
    (tmp_path / "accel0").touch()
    assert host_jax_platforms() == "tpu,cpu"


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_preset_is_valid_for_its_hardware(path):
    preset = load_preset(path)
    options = preset.engine_options
    mesh = options["tensor_parallel_size"] * options["data_parallel_size"]
    assert preset.devices % mesh == 0
    assert preset.platform == {"tpu_configs": "tpu", "gpu_configs": "gpu"}.get(
        path.parent.name, "cpu")
    assert preset.dtype in ("bfloat16", "float32")
    EngineConfig(**options)  # every value is one the engine accepts
    assert path.read_text().lstrip().startswith("#"), "say why these values"


@pytest.mark.parametrize("text, message", [
    ("[hardware]\nplatform = 'tpu'\ndevices = 8\n[mesh]\ntensor_parallel_size = 3\n",
     "does not divide"),
    ("[hardware]\nplatform = 'tpu'\ndevices = 8\n[batching]\nmax_num_seq = 3\n",
     "unknown field batching.max_num_seq"),
    ("[hardware]\nplatform = 'tpu'\ndevices = 8\n[gpu]\nx = 1\n", "unknown section"),
    ("[hardware]\nplatform = 'npu'\ndevices = 8\n", "hardware.platform"),
    ("[hardware]\nplatform = 'tpu'\ndevices = 8\n[kv_cache]\npage_size = '16'\n",
     "kv_cache.page_size has the wrong type"),
    ("[hardware\n", "invalid TOML"),
])
def test_bad_preset_is_a_clear_error(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_preset(path)


def test_flags_override_the_preset_and_re_derive_its_ladders(tmp_path):
    preset = ROOT / "gpu_configs" / "h200-1.toml"
    args = build_parser().parse_args(["serve", "--model", str(tmp_path), "--config", str(preset),
                                      "--max-num-seqs", "7", "--dtype", "float32"])
    model, dtype, flags = resolve_model_settings(args)
    assert (model, dtype, flags) == (str(tmp_path), "float32", {"max_num_seqs": 7})
    preset_dtype, options = engine_settings(args.config, "gpu", flags)
    ladder = load_preset(preset).engine_options["seq_buckets"]
    assert options["max_num_seqs"] == 7 and options["page_size"] == 32
    assert options["seq_buckets"] == tuple(r for r in ladder if r < 7) + (7,)
    EngineConfig(**options)  # the re-derived ladders are valid


def test_llm_defaults_to_the_cpu_preset_and_flags_re_derive_its_ladders():
    """On CPU `LLM(model)` takes cpu.toml; a smaller max_num_seqs re-derives seq_buckets."""
    dtype, options = engine_settings(None, "cpu", {})
    assert dtype == "float32" and options == load_preset(CPU_PRESET).engine_options
    _, options = engine_settings(None, "cpu", {"max_num_seqs": 4, "max_num_batched_tokens": 64})
    assert options["seq_buckets"] == (1, 4) and options["token_buckets"] == (32, 64)
    assert engine_settings(None, "tpu", {"max_num_seqs": 4}) == (None, {"max_num_seqs": 4})


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["generate", "--help"],
                                  ["convert", "--help"], ["bench", "serve", "--help"],
                                  ["bench", "offline", "--help"]])
def test_help_everywhere(argv):
    out = subprocess.run([sys.executable, "-m", "jaxserve.cli", *argv], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "usage: jaxserve" in out.stdout


def test_version():
    out = subprocess.run([sys.executable, "-m", "jaxserve.cli", "--version"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("jaxserve ")


def test_a_missing_optional_package_is_one_line_naming_the_extra():
    """`bench offline` without torch: exit 2 and one line naming the `bench` extra (or
    `--no-hf`), before anything runs; the same helper guards the aot compilers."""
    code = ("import sys\nsys.modules['torch'] = sys.modules['transformers'] = None  # absent\n"
            "from jaxserve.cli.main import main\nraise SystemExit(main(['bench', 'offline']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "jaxserve: error: the transformers baseline (or leave it out: --no-hf) needs torch, "
        "transformers: pip install 'jaxserve[bench]'"]
    for module, preset, chip in (("libtpu", "v6e-8", "v6e"),
                                 ("jax_plugins.xla_cuda13", "h200-1", "h200")):
        code = (f"import sys\nsys.modules[{module!r}] = None\nfrom jaxserve.cli.main import "
                f"main\nraise SystemExit(main(['plan', '--config', {preset!r}]))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 2
        assert out.stderr.strip().splitlines() == [
            f"jaxserve: error: compiling for {chip} without the hardware needs {module}: "
            "pip install 'jaxserve[aot]'"]


def test_the_benchmarks_random_model_is_the_llama_transformers_builds():
    """The numpy-built bench model: transformers loads it with no key missing or unexpected,
    weights at transformers' initial scale (std 0.02, norms 1)."""
    import tempfile

    import numpy as np
    from transformers import AutoModelForCausalLM

    from jaxserve.bench.random_model import build_random_model

    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "m"
        build_random_model(folder)
        model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info
    assert 55e6 < sum(p.numel() for p in model.parameters()) < 65e6
    q = model.model.layers[3].self_attn.q_proj.weight.detach().numpy()
    assert q.shape == (512, 512) and abs(np.std(q) - 0.02) < 1e-3
    assert (model.model.layers[0].input_layernorm.weight.detach().numpy() == 1).all()
