"""Deployment presets: TOML files that fix a mesh, dtype, KV-cache and batching settings for
one kind of hardware (`tpu_configs/`, `gpu_configs/` at the repository root, which ship in
the package through the links of the same names here; `cpu.toml` here, used by default on
CPU). A preset is named by its file's stem (`--config v6e-8`, `jaxserve plan --list`) or
given as a path.

    [hardware]  platform = "tpu" | "gpu" | "cpu", devices = chips the preset expects,
                accelerator = the chip kind ("v5e", "v6e", "v5p", "h100", "h200", "a100-80g")
    [plan]      model = the reference model shape the preset's numbers were planned with
                (a folder name under `reference_models/`, or a path to a model folder)
    [model]     dtype, and the engine options of that section
    [mesh] [kv_cache] [batching] [compile]
                the engine options, each in the section `EngineConfig` gives it (the
                README's option table lists them)
    [speculative]
                `speculative_config`'s keys (method, num_speculative_tokens, ...): the
                section is the option's table (`TABLES`)

The header comment's numbers (KV GiB, tokens, compile times) come from
`jaxserve plan --config PRESET` with the `[plan]` model, not from arithmetic by hand.

`engine_settings` is how `LLM` and the command line apply a preset: cpu.toml on CPU when none
is named, flags and keyword arguments on top; a preset for another platform than the
devices present is refused (`jaxserve plan` compiles for it without the hardware). An
override of `max_num_seqs` or `max_num_batched_tokens` re-derives the preset's ladder for it
(its rungs below the new limit, then the limit), so a flag never fails against the preset's
ladders.

Every field is checked when the file is read: an unknown section or field, a wrong type, or
a mesh that does not fit the declared devices is a `ValueError` naming it.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

from jaxserve.config.engine import SECTIONS, option_specs
from jaxserve.platforms import PLATFORMS
from jaxserve.platforms import platform as platform_traits

CPU_PRESET = PLATFORMS["cpu"].default_preset
REFERENCE_MODELS = Path(__file__).with_name("reference_models")
PRESET_FOLDERS = [Path(__file__).with_name(name) for name in ("tpu_configs", "gpu_configs")]


def shipped_presets() -> dict[str, Path]:
    """name → file of every preset that ships with jaxserve."""
    found = {path.stem: path for folder in PRESET_FOLDERS
             for path in sorted(folder.glob("*.toml"))}
    return {**found, CPU_PRESET.stem: CPU_PRESET}


def preset_path(name_or_path: str | Path) -> Path:
    """The file of a preset given by path, or by the name of a shipped one (`v6e-8`)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = shipped_presets()
    if str(name_or_path) in shipped:
        return shipped[str(name_or_path)]
    raise ValueError(f"config {str(name_or_path)!r} is neither a preset file nor a shipped "
                     f"preset's name; shipped: {', '.join(shipped)} (`jaxserve plan --list`)")

# an engine option's kind → the TOML value types it accepts
TOML_TYPES = {"int": int, "float": (float, int), "bool": bool, "str": str, "ints": list}
# section → the engine option whose value is that whole table ([speculative]: its keys are
# checked by the option itself, e.g. `SpeculativeConfig.from_dict`)
TABLES = {spec.section: spec.name for spec in option_specs() if spec.kind == "table"}


def _schema() -> dict[str, dict[str, type | tuple[type, ...]]]:
    """section → field → accepted type(s): [hardware], [plan], the model's dtype, and every
    engine option in its section (derived from `EngineConfig`)."""
    schema = {"hardware": {"platform": str, "devices": int, "accelerator": str},
              "plan": {"model": str}, **{section: {} for section in SECTIONS}}
    schema["model"]["dtype"] = str
    for spec in option_specs():
        if spec.kind != "table":
            schema[spec.section][spec.name] = TOML_TYPES[spec.kind]
    return schema


SCHEMA = _schema()


@dataclasses.dataclass
class Preset:
    """A validated preset: what to run on, the dtype, and the engine options."""

    path: Path
    platform: str
    devices: int
    dtype: str | None
    engine_options: dict[str, Any]
    accelerator: str | None = None
    plan_model: str | None = None

    def plan_model_dir(self) -> Path:
        """The folder of the `[plan]` model: a reference shape's name or a path."""
        if self.plan_model is None:
            raise ValueError(f"{self.path.name} names no [plan] model; pass --model")
        return reference_model_dir(self.plan_model)


# ladder → the limit it must end at
LADDER_LIMITS = {"token_buckets": "max_num_batched_tokens", "seq_buckets": "max_num_seqs"}


def engine_settings(config: str | Path | None, platform: str,
                    overrides: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """(dtype or None, engine options) of preset `config` (default: cpu.toml on CPU, none
    elsewhere) with `overrides` (the user's options) on top."""
    path = config if config is not None else platform_traits(platform).default_preset
    if path is None:
        return None, dict(overrides)
    preset = load_preset(path)
    if preset.platform != platform:
        name = preset.path.stem
        raise ValueError(f"preset {name} is for {preset.platform}; this machine has {platform} "
                         f"devices — leave out --config, or use `jaxserve plan --config {name}` "
                         "to compile for it without the hardware")
    options = {**preset.engine_options, **overrides}
    for ladder, limit in LADDER_LIMITS.items():
        if ladder in preset.engine_options and ladder not in overrides and limit in overrides:
            top = overrides[limit]
            options[ladder] = tuple(r for r in preset.engine_options[ladder] if r < top) + (top,)
    return preset.dtype, options


def reference_model_dir(name_or_path: str) -> Path:
    """A shipped reference shape by name (`reference_models/<name>/config.json`), else the
    folder or Hub id's config (`jaxserve.loading.hub`)."""
    from jaxserve.loading.hub import resolve_model

    shipped = REFERENCE_MODELS / name_or_path
    if (shipped / "config.json").is_file():
        return shipped
    return resolve_model(name_or_path, config_only=True)


def read_toml(path: Path, what: str) -> dict[str, Any]:
    """The parsed TOML file at `path`; `ValueError` calling it `what` when it is missing or
    not TOML."""
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{what} {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{what} {path.name}: invalid TOML: {err}") from None


def load_preset(path: str | Path) -> Preset:
    """Read and validate one preset, given by file or shipped name."""
    path = preset_path(path)
    data = read_toml(path, "config file")
    values: dict[str, dict[str, Any]] = {section: {} for section in SCHEMA}
    for section, fields in data.items():
        if section not in SCHEMA:
            raise ValueError(f"{path.name}: unknown section [{section}]; known: {list(SCHEMA)}")
        if section in TABLES:
            values[section][TABLES[section]] = dict(fields)
            continue
        for name, value in fields.items():
            expected = SCHEMA[section].get(name)
            if expected is None:
                raise ValueError(f"{path.name}: unknown field {section}.{name}")
            if isinstance(value, bool) and expected is not bool:
                raise ValueError(f"{path.name}: {section}.{name} must not be a boolean")
            if not isinstance(value, expected):
                raise ValueError(f"{path.name}: {section}.{name} has the wrong type "
                                 f"({type(value).__name__})")
            values[section][name] = tuple(value) if isinstance(value, list) else value
    hardware, plan = values.pop("hardware"), values.pop("plan")
    platform, devices = hardware.get("platform"), hardware.get("devices")
    if platform not in PLATFORMS:
        raise ValueError(f"{path.name}: hardware.platform must be one of {list(PLATFORMS)}")
    if devices is None or devices < 1:
        raise ValueError(f"{path.name}: hardware.devices must be a positive integer")
    dtype = values["model"].pop("dtype", None)
    engine = {name: value for fields in values.values() for name, value in fields.items()}
    mesh = engine.get("tensor_parallel_size", 1) * engine.get("data_parallel_size", 1)
    if devices % mesh:
        raise ValueError(f"{path.name}: mesh tensor_parallel_size x data_parallel_size = {mesh} "
                         f"does not divide the {devices} declared devices")
    return Preset(path, platform, devices, dtype, engine, hardware.get("accelerator"),
                  plan.get("model"))
