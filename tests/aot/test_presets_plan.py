"""Every shipped TPU/GPU preset, planned with its `[plan]` reference model, compiles and fits:
`jaxserve plan --config PRESET` exits 0 for each (compiling each program kind's smallest and
largest bucket for the preset's accelerator on this CPU host).

Slow (two to three minutes a preset on 2 cores), so behind the `slow` marker: `.ci/run` runs
it as its own bounded step after the main suite.
"""

import contextlib
import io
import json
from pathlib import Path

import pytest

from jaxserve.cli.main import main

REPO = Path(__file__).resolve().parents[2]
PRESETS = sorted([*REPO.glob("tpu_configs/*.toml"), *REPO.glob("gpu_configs/*.toml")])


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_preset_plan_compiles_and_fits(preset):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["plan", "--config", str(preset), "--json"])
    plan = json.loads(out.getvalue())
    print(f"\n{preset.stem}: " + json.dumps({k: v for k, v in plan.items() if k != "programs"})
          + "\n" + json.dumps(plan["programs"]))
    assert code == 0, plan["reason"]
    assert plan["fits"] and plan["scan_layers"]
    assert {p["name"] for p in plan["programs"]} == {"step", "decode"}
    assert all(p["compiled"] and p["cache_donated"] for p in plan["programs"])
