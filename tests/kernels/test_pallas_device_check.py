"""`python -m pallas_kernels.device_check --quick` runs on CPU (interpret mode) and writes
its JSON: the script a device rental runs once must not fail on its first line there."""

import json

from pallas_kernels import device_check


def test_quick_device_check_writes_results(tmp_path):
    out = tmp_path / "results.json"
    assert device_check.main(["--quick", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["interpret"] and data["correctness"]
    assert all(row["ok"] for row in data["correctness"])
    kernels = {row["kernel"] for row in data["correctness"]}
    assert kernels == {"decode", "ragged"}
    assert len(data["decode"]) == 3
    goal = data["decode"][0]  # the target row first, against its goal
    assert goal["batch"] == 1 and goal["goal_us"] == 10.0
    assert goal["meets_goal"] == (goal["jaxserve"]["us"] <= 10.0)
    for row in data["decode"]:
        assert row["jaxserve"]["us"] > 0 and "error" not in row
        assert row["kv_bytes"] == 2 * row["batch"] * row["context"] * row["kv_heads"] * 128 * 2
        assert "us" in row["jax_pallas"]  # the anchor ran on the same inputs
