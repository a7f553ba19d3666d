"""`jaxserve bench device`: what jaxserve does on the accelerator JAX sees (TPU or GPU), in one
command sized for one short rental (`--budget-s`, default 480 s: 8 minutes on an H100 leaves
a second call room within 15).

Ordered by what a rental must answer first:
1. device: chip kind and count, peak HBM GB/s, copy GB/s and bfloat16 matmul TFLOP/s (the
   roofline; serving's MBU is held to the copy figure);
2. serving, first figure: the 8B Llama shape in bfloat16 at batch 1 and 64 on short prompts
   (`device_serving.SHORT`);
3. kernels: `pallas_kernels.device_check`, correctness, then decode timing at engine shapes;
4. serving, the rest: each variant of `device_serving.VARIANTS` (1,024-token prompts);
5. startup: `jaxserve serve` of a random 60M Llama, cold then warm.

Every stage runs in a process of its own (`jaxserve.bench.device_stages`), and this one never
touches the device: a stage that runs out of memory, crashes or hangs leaves the next a clean
device, and each serving stage is given its memory share (`SERVING_GPU_MEM_FRACTION`,
recorded in its rows). Each stage ends at its cumulative share of `--budget-s` (rows past it
are recorded as skipped) and is stopped `GRACE_S` later; a crash or a stop is recorded as a
row with the end of the stage's output. Every row is written to `--out` (JSON) as soon as its
stage ends, so a run cut short keeps what it had; at the end a Markdown table per section
(`.md`) and a plot of serving throughput and MBU by batch size (`.png`, with matplotlib) go
beside it. `--quick` rehearses every stage on CPU with tiny shapes and no budget (CI runs
it): a test of the command, not a measurement.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

SECTIONS = ("device", "serving", "kernels", "startup")
# (section, stage, share of the budget), in the order they run.
STAGES = (("device", "device", 0.03), ("serving", "serving:bf16_short", 0.17),
          ("kernels", "kernels", 0.20), ("serving", "serving:bf16", 0.14),
          ("serving", "serving:int8_fp8kv", 0.10), ("serving", "serving:ngram_spec", 0.07),
          ("serving", "serving:moe_int8", 0.08), ("serving", "serving:lora", 0.07),
          ("serving", "serving:window_int8", 0.06), ("startup", "startup", 0.08))
# The share of the GPU a serving stage's process may take (XLA_PYTHON_CLIENT_MEM_FRACTION):
# it is alone on the device.
SERVING_GPU_MEM_FRACTION = "0.90"
GRACE_S = 90.0  # past its share of the budget a stage may finish the compile or row it is in
QUICK_STAGE_LIMIT_S = 900.0  # --quick has no budget; a stage that hangs is stopped after this
LONG_TEXT = ("traceback", "output_tail")  # in the JSON, not in the Markdown tables


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("device.json"),
                        help="JSON results (default device.json); .md and .png beside it")
    parser.add_argument("--only", default=",".join(SECTIONS),
                        help=f"comma-separated sections to run (default: {','.join(SECTIONS)})")
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes, minutes on CPU, no budget: rehearses the command "
                             "(CI runs it)")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="seconds the whole run may take (default 480); each stage ends "
                             "at its share, later rows recorded as skipped")


class Report:
    """The run's results, rewritten to `path` after every row."""

    def __init__(self, path: Path, header: dict[str, Any]):
        self.path = path
        self.data: dict[str, Any] = {**header, **{section: [] for section in SECTIONS}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write()

    def add(self, section: str, row: dict[str, Any]) -> None:
        self.data[section].append(row)
        self._write()

    def _write(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=1))


def _echo(stream, tail: collections.deque) -> None:
    """Pass a stage's stderr (progress bars, logs) through, keeping its last lines."""
    for line in stream:
        sys.stderr.write(line)
        tail.append(line)


def run_stage(stage: str, quick: bool, seconds: float, copy_gbps: float | None
              ) -> list[dict[str, Any]]:
    """Run one stage in its own process; its rows, plus one recording a crash or a stop.
    `seconds`: its share of the budget from now (rows after it are skipped)."""
    with tempfile.TemporaryDirectory(prefix="jaxserve-device-stage-") as scratch:
        rows_file = Path(scratch) / "rows.jsonl"
        command = [sys.executable, "-m", "jaxserve.bench.device_stages", stage,
                   "--rows", str(rows_file), "--deadline-s", str(max(seconds, 0.0))]
        command += (["--quick"] if quick else []) + (
            ["--copy-gbps", str(copy_gbps)] if copy_gbps else [])
        env = {**os.environ, "XLA_PYTHON_CLIENT_MEM_FRACTION": SERVING_GPU_MEM_FRACTION}
        if stage == "startup":  # its process only reads the chip's kind; its servers take
            env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # their own share of the card
        limit = QUICK_STAGE_LIMIT_S if quick else max(seconds, 0.0) + GRACE_S
        child = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
        tail: collections.deque = collections.deque(maxlen=60)
        echo = threading.Thread(target=_echo, args=(child.stderr, tail), daemon=True)
        echo.start()
        problem = None
        try:
            child.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            problem = f"stopped after {limit:.0f} s (its share of --budget-s and {GRACE_S:.0f} s)"
        echo.join(timeout=10)
        if problem is None and child.returncode != 0:
            problem = f"the stage's process exited with {child.returncode}"
        rows = ([json.loads(line) for line in rows_file.read_text().splitlines() if line]
                if rows_file.exists() else [])
    if problem:
        rows.append({"stage": stage, "error": problem, "output_tail": "".join(tail)})
    return rows


def run_from_args(args: argparse.Namespace) -> int:
    import jax  # the version only: this process never starts a backend

    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise ValueError(f"--only: unknown section(s) {unknown}; sections: {list(SECTIONS)}")
    started = time.perf_counter()
    report = Report(args.out, {"device_kind": None, "jax": jax.__version__,
                               "commit": _commit(), "date": time.strftime("%Y-%m-%d"),
                               "quick": args.quick, "sections": sections})
    # serving's MBU is held to the device stage's copy bandwidth: it runs whenever serving does
    chosen = [(section, stage, share) for section, stage, share in STAGES
              if section in sections or (section == "device" and "serving" in sections)]
    print(f"jaxserve bench device: {', '.join(stage for _, stage, _ in chosen)} "
          f"(budget {'none, --quick' if args.quick else f'{args.budget_s:.0f} s'})", flush=True)
    total_share, share, copy_gbps = sum(s for _, _, s in chosen), 0.0, None
    for section, stage, stage_share in chosen:
        share += stage_share  # each stage ends at its cumulative share of the budget
        seconds = started + args.budget_s * share / total_share - time.perf_counter()
        print(f"== {stage}", flush=True)
        for row in run_stage(stage, args.quick, seconds, copy_gbps):
            if section == "device" and "kind" in row:
                copy_gbps = row["copy_gbps"]
                report.data["device_kind"] = row["kind"]
            report.add(section, row)
    args.out.with_suffix(".md").write_text(markdown(report.data))
    drew = plot(report.data, args.out.with_suffix(".png"))
    print(f"wrote {args.out}, {args.out.with_suffix('.md')}"
          + (f", {args.out.with_suffix('.png')}" if drew else " (no plot: matplotlib missing)")
          + f" in {time.perf_counter() - started:.0f} s", flush=True)
    failed = [r for section in SECTIONS for r in report.data[section]
              if "error" in r or r.get("ok") is False]
    return 1 if failed else 0


def markdown(data: dict[str, Any]) -> str:
    """A table per section: one row per result, one column per scalar field."""
    lines = [f"# jaxserve bench device: {data.get('device_kind')}", "",
             f"jax {data.get('jax')}, commit {data.get('commit')}, {data.get('date')}", ""]
    for section in SECTIONS:
        rows = [{k: v for k, v in row.items()
                 if not isinstance(v, (dict, list)) and k not in LONG_TEXT}
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
        right.plot([r["batch"] for r in mine], [r["mbu"] or 0 for r in mine], "o-",
                   label=variant)
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
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, cwd=Path(__file__).parent)
        return done.stdout.strip() or None
    except OSError:
        return None
