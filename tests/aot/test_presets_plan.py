"""Every shipped TPU/GPU preset, planned with its `[plan]` reference model, compiles and fits:
`jaxserve plan --config PRESET --buckets largest` exits 0 for each (compiling each program
kind's largest bucket, the one whose peak decides the fit, for the preset's accelerator on this
CPU host; the default `--buckets ends` adds the smallest, `all` every bucket).

Slow (over a minute a preset on 2 cores), so behind the `slow` marker: `.ci/run` runs it as
its own bounded step after the main suite.
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
        code = main(["plan", "--config", str(preset), "--json", "--buckets", "largest"])
    plan = json.loads(out.getvalue())
    print(f"\n{preset.stem}: " + json.dumps({k: v for k, v in plan.items() if k != "programs"})
          + "\n" + json.dumps(plan["programs"]))
    assert code == 0, plan["reason"]
    # stacked layers everywhere: gpt-oss's and Gemma 3's sliding and full layers by period
    assert plan["fits"] and plan["scan_layers"]
    assert sorted(p["name"] for p in plan["programs"]) == ["decode", "step"]  # largest only
    assert all(p["compiled"] and p["cache_donated"] for p in plan["programs"])
