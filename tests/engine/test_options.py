"""One source for engine options: every `EngineConfig` field is a flag of `serve`,
`generate` and `plan`, a field of the presets (in its section) and a row of the README's
table, and each carries a value through to the engine options unchanged."""

import dataclasses
import json
from pathlib import Path

import pytest

from jaxserve.cli.main import build_parser, flag_options
from jaxserve.config.engine import EngineConfig, option_specs, options_table
from jaxserve.presets import load_preset

pytestmark = pytest.mark.quick  # seconds, no engine: `pytest -m quick`

README = Path(__file__).resolve().parents[2] / "README.md"
SPECS = option_specs()


def other_value(spec):
    """A value of the option's kind that is not its default."""
    if spec.choices:
        return next(c for c in reversed(spec.choices) if c != spec.default)
    return {"int": 4, "float": 0.25, "str": "elsewhere", "ints": (16, 32),
            "bool": not spec.default,
            "table": {"method": "ngram", "num_speculative_tokens": 2}}[spec.kind]


def test_every_field_has_a_spec():
    assert [s.name for s in SPECS] == [f.name for f in dataclasses.fields(EngineConfig)]


@pytest.mark.parametrize("command", ["serve", "generate", "plan"])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_flag_carries_the_option(command, spec):
    value = other_value(spec)
    if spec.kind == "bool":
        argv = [spec.flag if value else "--no-" + spec.flag[2:]]
    elif spec.kind == "table":
        argv = [spec.flag, json.dumps(value)]
    else:
        argv = [spec.flag, *map(str, value if spec.kind == "ints" else [value])]
    prefix = ["generate", "hi"] if command == "generate" else [command]
    args = build_parser().parse_args(prefix + argv)
    assert flag_options(args) == {spec.name: value}
    assert flag_options(build_parser().parse_args(prefix)) == {}  # unset flags override nothing


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_preset_field_carries_the_option(spec, tmp_path):
    value = other_value(spec)
    toml = (str(value).lower() if spec.kind == "bool" else list(value) if spec.kind == "ints"
            else f'"{value}"' if spec.kind == "str" else value)
    if spec.kind == "table":  # the section is the option's table
        fields = "\n".join(f"{key} = {json.dumps(v)}" for key, v in value.items())
    else:
        fields = f"{spec.name} = {toml}"
    path = tmp_path / "preset.toml"
    path.write_text(f'[hardware]\nplatform = "cpu"\ndevices = 8\n[{spec.section}]\n{fields}\n')
    assert load_preset(path).engine_options == {spec.name: value}


def test_readme_table_is_the_generated_one():
    assert options_table() in README.read_text(), (
        "README's engine option table differs from EngineConfig; regenerate it with "
        "jaxserve.config.engine.options_table()")
    assert options_table().count("\n") == len(SPECS) + 1
