"""`jaxserve bench device --quick`: the command a lent accelerator runs first, rehearsed on
CPU with tiny shapes so it cannot rot. Every section must be written with its fields, the
kernels must agree with the reference, the warm start must read every program back, and the
Markdown and plot must land beside the JSON. A stage that fails is recorded with its whole
traceback, and the stages after it still run."""

import json
import subprocess
import sys
import time

import pytest

from jaxserve.bench import device_bench


@pytest.mark.slow  # minutes: engines compile (CI's slow step)
def test_quick_run_writes_every_section(tmp_path):
    out = tmp_path / "device.json"
    done = subprocess.run([sys.executable, "-m", "jaxserve.cli", "bench", "device", "--quick",
                           "--out", str(out)], capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["quick"] and data["jax"] and data["device_kind"] and data["sections"] == [
        "device", "serving", "kernels", "startup"]
    # the serving figure before the kernels: the order a rental must answer in
    assert "== serving:bf16_short\n" in done.stdout.split("== kernels\n")[0]

    (device,) = data["device"]
    assert device["copy_gbps"] > 0 and device["matmul_bf16_tflops"] > 0

    checks = [row for row in data["kernels"] if row["check"] == "correctness"]
    timings = [row for row in data["kernels"] if row["check"] == "decode"]
    assert checks and all(row["ok"] for row in checks), checks
    assert timings and all(row["gbps"] > 0 for row in timings), timings

    # each variant's memory, logged by its runner before and after its first runs
    memory = [row for row in data["serving"] if "memory_at" in row]
    serving = [row for row in data["serving"] if "memory_at" not in row]
    assert {(row["variant"], row["memory_at"]) for row in memory} == {
        (variant, moment) for variant in ("bf16_short", "bf16", "int8_fp8kv", "ngram_spec",
                                          "moe_int8", "lora", "window_int8")
        for moment in ("before the first runs", "after the first runs")}
    for row in memory:
        assert row["weights_bytes"] > 0 and row["kv_cache_bytes"] > 0
        assert row["live_bytes"] >= row["weights_bytes"] + row["kv_cache_bytes"], row
        if row["memory_at"] == "before the first runs":
            assert row["largest_temp_bytes"] == max(row["program_temp_bytes"].values()) > 0
    assert {(row["variant"], row["batch"], row.get("adapters")) for row in serving} == {
        (variant, batch, None) for variant in ("bf16_short", "bf16", "int8_fp8kv", "ngram_spec",
                                               "moe_int8", "window_int8")
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


def test_a_failing_stage_is_recorded_whole_and_the_run_goes_on(tmp_path, monkeypatch):
    """A stage that fails in its own process: a row with the error and its whole traceback
    (not a clipped message), and the parent goes on to the next stage."""
    (row,) = device_bench.run_stage("serving:no_such_variant", quick=True, seconds=60,
                                    copy_gbps=None)
    assert row["error"].startswith("ValueError: unknown serving variant 'no_such_variant'")
    assert "Traceback (most recent call last)" in row["traceback"]
    assert "measure_variant" in row["traceback"]  # the frames, not only the message

    monkeypatch.setenv("JAX_PLATFORMS", "no_such_platform")  # the backend cannot start
    (row,) = device_bench.run_stage("device", quick=True, seconds=60, copy_gbps=None)
    assert "no_such_platform" in row["error"] and "jax.devices()" in row["traceback"]


def test_a_stage_past_its_time_is_stopped_and_recorded(monkeypatch):
    """A stage that runs past its share and grace is killed, and the row says so."""
    monkeypatch.setattr(device_bench, "GRACE_S", 0.0)
    started = time.perf_counter()
    rows = device_bench.run_stage("startup", quick=False, seconds=3, copy_gbps=None)
    assert time.perf_counter() - started < 60
    assert rows[-1]["error"].startswith("stopped after 3 s"), rows
    assert rows[-1]["stage"] == "startup"
