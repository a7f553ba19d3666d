"""`jaxserve bench device --quick`: the command a lent accelerator runs first, rehearsed on
CPU with tiny shapes so it cannot rot. Every section must be written with its fields, the
kernels must agree with the reference, the warm start must read every program back, and the
Markdown and plot must land beside the JSON."""

import json
import subprocess
import sys

import pytest


@pytest.mark.slow  # minutes: engines compile (CI's slow step)
def test_quick_run_writes_every_section(tmp_path):
    out = tmp_path / "device.json"
    done = subprocess.run([sys.executable, "-m", "jaxserve.cli", "bench", "device", "--quick",
                           "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["quick"] and data["jax"] and data["sections"] == [
        "device", "kernels", "serving", "startup"]

    (device,) = data["device"]
    assert device["copy_gbps"] > 0 and device["matmul_bf16_tflops"] > 0

    checks = [row for row in data["kernels"] if row["check"] == "correctness"]
    timings = [row for row in data["kernels"] if row["check"] == "decode"]
    assert checks and all(row["ok"] for row in checks), checks
    assert timings and all(row["gbps"] > 0 for row in timings), timings

    serving = data["serving"]
    assert {(row["variant"], row["batch"], row.get("adapters")) for row in serving} == {
        (variant, batch, None) for variant in ("bf16", "int8_fp8kv", "ngram_spec", "moe_int8",
                                               "window_int8")
        for batch in (1, 4)} | {("lora", 4, count) for count in (0, 1, 4)}
    assert {row["model"] for row in serving if row["variant"] == "moe_int8"} == {"qwen3_moe"}
    assert {row["model"] for row in serving if row["variant"] == "window_int8"} == {
        "gemma3_text"}
    assert all(0 <= row["acceptance"] <= 1 for row in serving if row["variant"] == "ngram_spec")
    for row in serving:
        assert row["output_tok_s"] > 0 and row["ttft_ms"] > 0 and row["tpot_ms"] > 0
        assert 0 < row["mbu"], row
    int8 = next(r for r in serving if r["variant"] == "int8_fp8kv")
    bf16 = next(r for r in serving if r["variant"] == "bf16")
    assert int8["weight_bytes"] < bf16["weight_bytes"] / 2  # int8 codes beside float32

    (startup,) = data["startup"]
    assert startup["cold_s"] > startup["warm_s"] > 0
    assert startup["cold_programs_from_cache"] == 0 and startup["warm_programs_from_cache"] > 0

    table = out.with_suffix(".md").read_text()
    assert all(f"## {section}" in table for section in data["sections"])
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_sections_are_refused():
    done = subprocess.run([sys.executable, "-m", "jaxserve.cli", "bench", "device", "--only",
                           "kernels,tokens"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--only: unknown section(s) ['tokens']" in done.stderr
