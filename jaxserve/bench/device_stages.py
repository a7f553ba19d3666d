"""One stage of `jaxserve bench device`, run in a process of its own:
`python -m jaxserve.bench.device_stages STAGE --rows FILE [--quick] [--deadline-s S]`.

Why a process each: a stage that runs out of device memory, crashes or hangs must leave the
next one a clean device, and JAX's allocator keeps what a process took until it exits (on
GPU it preallocates a share of the card when the first array is made). The parent
(`device_bench`) never touches the device itself; it starts each stage with the memory share
that stage may take and reads back the rows.

Stages:
- `device`: chip kind and count, peak HBM GB/s from the data sheet, copy GB/s (a jitted
  `x + 1` over 2 GiB: read plus write) and bfloat16 matmul TFLOP/s (8192 x 8192);
- `kernels`: `pallas_kernels.device_check` — correctness over the test grid, then decode
  timing at engine shapes beside JAX's own Pallas kernel (`gbps`, `share_of_peak`);
- `serving:VARIANT`: one variant of `device_serving` (`bf16_short` is the first figure: the
  8B shape, bfloat16, batch 1 and 64, short prompts);
- `startup`: `jaxserve serve` of the random 60M Llama, cold then warm, on one new store.

Each row is appended to `--rows` as one JSON line the moment it is measured. A stage that
fails records `error` (type and message) and `traceback` (whole) in a row and exits 0; the
parent records a crash or a timeout itself.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

# The GPU memory the start-up stage's server may take (XLA_PYTHON_CLIENT_MEM_FRACTION): the
# 60M model needs little, and the stage's own process holds nothing (it runs without
# preallocation: it only reads the chip's kind).
STARTUP_GPU_MEM_FRACTION = "0.5"


def failure_row(err: BaseException) -> dict[str, str]:
    """What a report row records of an exception: a short `error` for the tables and the
    whole `traceback` for the reader."""
    message = f"{type(err).__name__}: {err}"
    return {"error": message if len(message) <= 600 else f"{message[:300]} ... "
                                                          f"{message[-300:]}",
            "traceback": "".join(traceback.format_exception(err))}


def probe_device(add: Callable[[dict], None], quick: bool) -> None:
    """The device row: the roofline the other stages are held to."""
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
    add({"kind": device.device_kind, "platform": device.platform, "count": jax.device_count(),
         "jax": jax.__version__, "peak_hbm_gbps": peak, "copy_gbps": round(copy_gbps, 1),
         "copy_share_of_peak": round(copy_gbps / peak, 3) if peak else None,
         "matmul_bf16_tflops": round(2 * size ** 3 / matmul_s / 1e12, 2)})


class _KernelRows:
    """`device_check`'s results interface: a timing row gets `gbps` and `share_of_peak` of
    jaxserve's kernel at top level."""

    def __init__(self, add: Callable[[dict], None], peak_gbps: float | None):
        self._add, self.peak = add, peak_gbps

    def add(self, check: str, row: dict[str, Any]) -> None:
        ours = row.get("jaxserve") or {}
        if "us" in ours:
            gbps = row["kv_bytes"] / (ours["us"] * 1e3)  # bytes per microsecond / 1e3
            row = {**row, "gbps": float(f"{gbps:.4g}"),
                   "share_of_peak": round(gbps / self.peak, 3) if self.peak else None}
        self._add({"check": check, **row})


def run_kernels(add: Callable[[dict], None], quick: bool, deadline: float) -> None:
    import jax

    from pallas_kernels import device_check

    device = jax.devices()[0]
    platform = {"cuda": "gpu", "rocm": "gpu"}.get(device.platform, device.platform)
    interpret = quick or platform == "cpu"
    peak = device_check.peak_gbps(device.device_kind)
    rows = _KernelRows(add, peak)
    device_check.check_correctness(rows, interpret, quick)
    started = time.perf_counter()
    device_check.bench_decode(rows, platform, peak, quick, interpret,
                              max(0.0, deadline - started), started, 2 if quick else 20)


def run_startup(add: Callable[[dict], None], quick: bool, deadline: float) -> None:
    """Cold, then warm, start of `jaxserve serve` (the random bench model, the chip's
    preset) on one new executable store. Each start may take what is left of the stage's
    time, and never less than a start compiles in (`timeout` below)."""
    import jax

    from jaxserve.bench import startup_bench
    from jaxserve.bench.device_serving import (FULL, QUICK, QUICK_CONFIG, QUICK_LADDER,
                                               preset_for)
    from jaxserve.bench.random_model import CONFIG, build_random_model

    with tempfile.TemporaryDirectory(prefix="jaxserve-device-startup-") as scratch:
        folder = Path(scratch) / "model"
        config = {**QUICK_CONFIG, "torch_dtype": "float32"} if quick else CONFIG
        build_random_model(folder, config=config)
        # a cold start compiles the whole ladder: on a loaded 2-core CPU that is minutes
        timeout = 900.0 if quick else max(180.0, deadline - time.perf_counter())
        args = argparse.Namespace(model=str(folder), config=preset_for(jax.devices()[0]),
                                  timeout=timeout, server_flags="")
        env = {**{k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_PREALLOCATE"},
               "JAXSERVE_CACHE_DIR": str(Path(scratch) / "cache"),
               "XLA_PYTHON_CLIENT_MEM_FRACTION": STARTUP_GPU_MEM_FRACTION}
        # The serving stages' batch limit: the same ladder of programs.
        flags = ["--max-num-seqs", str(max((QUICK if quick else FULL).batches))]
        if quick:  # the serving stages' ladder too
            for name, value in QUICK_LADDER.items():
                flags += [f"--{name.replace('_', '-')}",
                          *map(str, value if isinstance(value, tuple) else (value,))]
        row: dict[str, Any] = {"model": "random llama " + ("tiny" if quick else "60M"),
                               "preset": args.config, "flags": " ".join(flags),
                               "gpu_mem_fraction": STARTUP_GPU_MEM_FRACTION,
                               "timeout_s": timeout}
        try:
            for name in ("cold", "warm"):
                start = startup_bench.one_start(args, env, flags)
                row.update({f"{name}_s": round(start["healthy_s"], 2),
                            f"{name}_programs_from_cache": start["programs_from_cache"],
                            f"{name}_phases": start["phases"]})
        except Exception as err:  # noqa: BLE001 - recorded in the row
            row.update(failure_row(err))
        add(row)


def run_stage(stage: str, add: Callable[[dict], None], quick: bool, deadline: float,
              copy_gbps: float | None) -> None:
    """Run `stage`, handing each row to `add`."""
    if stage == "device":
        probe_device(add, quick)
    elif stage == "kernels":
        run_kernels(add, quick, deadline)
    elif stage == "startup":
        run_startup(add, quick, deadline)
    elif stage.startswith("serving:"):
        from jaxserve.bench.device_serving import measure_variant

        measure_variant(stage.removeprefix("serving:"), add, copy_gbps, quick, deadline,
                        progress=True)
    else:
        raise ValueError(f"unknown stage {stage!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage")
    parser.add_argument("--rows", type=Path, required=True,
                        help="JSON lines file the rows are appended to")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--deadline-s", type=float, default=math.inf,
                        help="seconds from now after which rows are recorded as skipped")
    parser.add_argument("--copy-gbps", type=float, default=None,
                        help="the device stage's copy bandwidth, the MBU's denominator")
    args = parser.parse_args(argv)
    deadline = time.perf_counter() + args.deadline_s

    def add(row: dict) -> None:
        with args.rows.open("a") as rows:
            rows.write(json.dumps(row) + "\n")
        print(f"[{args.stage}] {json.dumps({k: v for k, v in row.items() if k != 'traceback'})}",
              flush=True)

    try:
        run_stage(args.stage, add, args.quick, deadline, args.copy_gbps)
    except Exception as err:  # noqa: BLE001 - recorded, the parent goes on
        add(failure_row(err))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
