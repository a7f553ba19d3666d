"""`jaxserve bench device`: what jaxserve does on the accelerator JAX sees (TPU or GPU), in one
command sized for one short rental (the default run: about 8 minutes on an H200).

Sections, in order (`--only device,kernels,...` runs some):
- device: chip kind and count, peak HBM GB/s from the data sheet, and two probes that are the
  roofline the rest is held to: copy GB/s (a jitted `x + 1` over 2 GiB: read plus write) and
  bfloat16 matmul TFLOP/s (8192 x 8192);
- kernels: `pallas_kernels.device_check` — the decode and ragged kernels against the jnp
  reference over the test grid (poisoned page tables), then decode timing at engine shapes
  beside JAX's own Pallas kernel; each timing row has `gbps` and `share_of_peak`;
- serving: the engine `serve` builds from the chip's preset, on an 8B Llama-shaped model with
  random bfloat16 weights generated on the device; batches of 1, 16, 64 and 256 requests of
  1,024-token prompts and 128 new tokens: `output_tok_s`, `ttft_ms`, `tpot_ms`, `mbu`; then
  the same with int8 weights and an fp8 KV cache, then n-gram speculation at batches 1 and
  16 (random weights: the cost side, with the acceptance they get; `acceptance`)
  (`jaxserve.bench.device_serving`);
- startup: `jaxserve serve` of the benchmarks' random 60M Llama with the chip's preset (and
  the serving section's `--max-num-seqs`), on an empty executable store (`cold_s`) and again
  on the store it filled (`warm_s`), launch to healthy.

Every row is written to `--out` (JSON) as it is measured, so a run cut short keeps what it
had; at the end a Markdown table per section (`.md`) and a plot of serving throughput and MBU
by batch size (`.png`, when matplotlib is installed) go beside it. Each section has a share
of `--budget-s`; rows past it are recorded as skipped. `--quick` rehearses every section on
CPU with tiny shapes (CI runs it) — a test of the command, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

SECTIONS = ("device", "kernels", "serving", "startup")
# Each section's share of the time budget (of the sections chosen, in proportion).
# The GPU memory the start-up section's server may take (XLA_PYTHON_CLIENT_MEM_FRACTION).
STARTUP_GPU_MEM_FRACTION = "0.15"
SHARES = {"device": 0.03, "kernels": 0.30, "serving": 0.52, "startup": 0.15}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("device.json"),
                        help="JSON results (default device.json); .md and .png beside it")
    parser.add_argument("--only", default=",".join(SECTIONS),
                        help=f"comma-separated sections to run (default: {','.join(SECTIONS)})")
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes, minutes on CPU: rehearses the command (CI runs it)")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="seconds the whole run may take (default 480); later rows of a "
                             "section past its share are skipped and recorded as such")


class Report:
    """The run's results, rewritten to `path` after every row."""

    def __init__(self, path: Path, header: dict[str, Any]):
        self.path = path
        self.data: dict[str, Any] = {**header, **{section: [] for section in SECTIONS}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write()

    def add(self, section: str, row: dict[str, Any]) -> None:
        self.data[section].append(row)
        print(f"[{section}] {json.dumps(row)}", flush=True)
        self._write()

    def _write(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=1))


def probe_device(report: Report, quick: bool) -> float:
    """The device row; returns the measured copy bandwidth in GB/s."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.bench import time_call
    from pallas_kernels.device_check import peak_gbps

    device = jax.devices()[0]
    nbytes = (8 << 20) if quick else (2 << 30)
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    copy_s = time_call(jax.jit(lambda a: a + 1), (x,), 3 if quick else 20)
    copy_gbps = 2 * nbytes / copy_s / 1e9  # read once, written once
    size = 256 if quick else 8192
    a = jnp.ones((size, size), jnp.bfloat16)
    matmul_s = time_call(jax.jit(lambda p, q: p @ q), (a, a), 3 if quick else 20)
    peak = peak_gbps(device.device_kind)
    report.add("device", {"kind": device.device_kind, "platform": device.platform,
                          "count": jax.device_count(), "peak_hbm_gbps": peak,
                          "copy_gbps": round(copy_gbps, 1),
                          "copy_share_of_peak": round(copy_gbps / peak, 3) if peak else None,
                          "matmul_bf16_tflops": round(2 * size ** 3 / matmul_s / 1e12, 2)})
    return copy_gbps


class _KernelRows:
    """`device_check`'s results interface, feeding the report's kernels section: a timing
    row gets `gbps` and `share_of_peak` of jaxserve's kernel at top level."""

    def __init__(self, report: Report, peak_gbps: float | None):
        self.report, self.peak = report, peak_gbps

    def add(self, check: str, row: dict[str, Any]) -> None:
        ours = row.get("jaxserve") or {}
        if "us" in ours:
            gbps = row["kv_bytes"] / (ours["us"] * 1e3)  # bytes per microsecond / 1e3
            row = {**row, "gbps": float(f"{gbps:.4g}"),
                   "share_of_peak": round(gbps / self.peak, 3) if self.peak else None}
        self.report.add("kernels", {"check": check, **row})


def run_kernels(report: Report, quick: bool, deadline: float) -> None:
    import jax

    from pallas_kernels import device_check

    device = jax.devices()[0]
    platform = {"cuda": "gpu", "rocm": "gpu"}.get(device.platform, device.platform)
    interpret = quick or platform == "cpu"
    peak = device_check.peak_gbps(device.device_kind)
    rows = _KernelRows(report, peak)
    device_check.check_correctness(rows, interpret, quick)
    started = time.perf_counter()
    device_check.bench_decode(rows, platform, peak, quick, interpret,
                              max(0.0, deadline - started), started, 2 if quick else 20)


def run_startup(report: Report, quick: bool, deadline: float) -> None:
    """Cold, then warm, start of `jaxserve serve` (the random bench model, the chip's
    preset) on one new executable store."""
    import jax

    from jaxserve.bench import startup_bench
    from jaxserve.bench.device_serving import (FULL, QUICK, QUICK_CONFIG, QUICK_LADDER,
                                               preset_for)
    from jaxserve.bench.random_model import CONFIG, build_random_model
    from pallas_kernels.device_check import error_text

    with tempfile.TemporaryDirectory(prefix="jaxserve-device-startup-") as scratch:
        folder = Path(scratch) / "model"
        config = {**QUICK_CONFIG, "torch_dtype": "float32"} if quick else CONFIG
        build_random_model(folder, config=config)
        args = argparse.Namespace(model=str(folder), config=preset_for(jax.devices()[0]),
                                  timeout=max(60.0, deadline - time.perf_counter()))
        env = {**os.environ, "JAXSERVE_CACHE_DIR": str(Path(scratch) / "cache")}
        if jax.devices()[0].platform == "gpu":
            # This process's allocator already holds 75% of the card (the sections before):
            # the server gets a share of the rest, plenty for the 60M model.
            env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = STARTUP_GPU_MEM_FRACTION
        # The serving section's batch limit: the same ladder of programs.
        flags = ["--max-num-seqs", str(max((QUICK if quick else FULL).batches))]
        if quick:  # the serving section's ladder too
            for name, value in QUICK_LADDER.items():
                flags += [f"--{name.replace('_', '-')}",
                          *map(str, value if isinstance(value, tuple) else (value,))]
        row: dict[str, Any] = {"model": "random llama " + ("tiny" if quick else "60M"),
                               "preset": args.config, "flags": " ".join(flags),
                               **({"gpu_mem_fraction": STARTUP_GPU_MEM_FRACTION}
                                  if "XLA_PYTHON_CLIENT_MEM_FRACTION" in env else {})}
        try:
            for name in ("cold", "warm"):
                start = startup_bench.one_start(args, env, flags)
                row.update({f"{name}_s": round(start["healthy_s"], 2),
                            f"{name}_programs_from_cache": start["programs_from_cache"],
                            f"{name}_phases": start["phases"]})
        except Exception as err:  # noqa: BLE001 - recorded, the run goes on
            row["error"] = error_text(err)
        report.add("startup", row)


def markdown(data: dict[str, Any]) -> str:
    """A table per section: one row per result, one column per scalar field."""
    lines = [f"# jaxserve bench device: {data.get('device_kind')}", "",
             f"jax {data.get('jax')}, commit {data.get('commit')}, {data.get('date')}", ""]
    for section in SECTIONS:
        rows = [{k: v for k, v in row.items() if not isinstance(v, (dict, list))}
                for row in data.get(section, [])]
        if not rows:
            continue
        columns = list(dict.fromkeys(k for row in rows for k in row))
        lines += [f"## {section}", "", "| " + " | ".join(columns) + " |",
                  "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(str(row.get(c, "")) for c in columns) + " |" for row in rows]
        lines.append("")
    return "\n".join(lines)


def plot(data: dict[str, Any], path: Path) -> bool:
    """Serving throughput and MBU by batch size, one line per variant; False without
    matplotlib (the JSON and Markdown hold the same numbers)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in data.get("serving", []) if "output_tok_s" in r]
    if not rows:
        return False
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for variant in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == variant]
        left.plot([r["batch"] for r in mine], [r["output_tok_s"] for r in mine], "o-",
                  label=variant)
        right.plot([r["batch"] for r in mine], [r["mbu"] for r in mine], "o-", label=variant)
    for axis, title in ((left, "output tokens/s"), (right, "MBU")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("batch (requests at once)")
        axis.set_title(title)
        axis.legend()
    figure.suptitle(f"jaxserve on {data.get('device_kind')}")
    figure.tight_layout()
    figure.savefig(path)
    return True


def _commit() -> str | None:
    import subprocess

    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, cwd=Path(__file__).parent)
        return done.stdout.strip() or None
    except OSError:
        return None


def run_from_args(args: argparse.Namespace) -> int:
    import jax

    from jaxserve.bench.device_serving import measure_serving

    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise ValueError(f"--only: unknown section(s) {unknown}; sections: {list(SECTIONS)}")
    started = time.perf_counter()
    device = jax.devices()[0]
    report = Report(args.out, {"device_kind": device.device_kind, "jax": jax.__version__,
                               "commit": _commit(), "date": time.strftime("%Y-%m-%d"),
                               "quick": args.quick, "sections": sections})
    print(f"jaxserve bench device on {device.device_kind} x{jax.device_count()}: "
          f"{', '.join(sections)} (budget {args.budget_s:.0f} s)", flush=True)
    chosen = [section for section in SECTIONS if section in sections]
    total_share, share = sum(SHARES[section] for section in chosen), 0.0
    copy_gbps = None
    for section in chosen:
        share += SHARES[section]  # each section ends at its cumulative share of the budget
        deadline = started + args.budget_s * share / total_share
        print(f"== {section}", flush=True)
        if section == "device" or (section == "serving" and copy_gbps is None):
            copy_gbps = probe_device(report, args.quick)  # serving's MBU is held to it
        if section == "kernels":
            run_kernels(report, args.quick, deadline)
        elif section == "serving":
            measure_serving(lambda row: report.add("serving", row), copy_gbps, args.quick,
                            deadline, progress=True)
        elif section == "startup":
            run_startup(report, args.quick, deadline)
    args.out.with_suffix(".md").write_text(markdown(report.data))
    drew = plot(report.data, args.out.with_suffix(".png"))
    print(f"wrote {args.out}, {args.out.with_suffix('.md')}"
          + (f", {args.out.with_suffix('.png')}" if drew else " (no plot: matplotlib missing)")
          + f" in {time.perf_counter() - started:.0f} s", flush=True)
    failed = [r for r in report.data.get("kernels", []) if r.get("ok") is False]
    return 1 if failed else 0
