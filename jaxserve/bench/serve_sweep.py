"""Capacity planning for `jaxserve bench serve`: which sweep points meet a latency SLO, the best
of them, what its output tokens cost, how many replicas a target load needs, and the
throughput–latency plot. Pure functions of the per-point summaries, so they can be checked
against hand-computed cases without a server.

The SLO is per request, as vLLM's `--goodput`: a request meets it when its TTFT, TPOT and
end-to-end latency are each within their limits (metrics without a limit don't count). Goodput
is such requests per second, and the SLO fraction is their share of the requests sent.

A sweep *point* meets the SLO the way latency targets are usually written ("p90 TTFT under
2 s"; MLPerf's server scenario does the same at p99): every request completed, and for each
metric with a limit, its `--slo-percentile` (default 90) over the completed requests is within
it. Percentiles are numpy's linear interpolation, as vLLM's benchmark computes them. With no
limit given, a point qualifies when every request completed.

The best point is the one with the most output tokens/s among those meeting the SLO: the
throughput one deployment sustains at that latency. Its cost per million output tokens is
`cost_per_hour / (tokens_per_s * 3600) * 1e6`, and a target load of R requests/s needs
`ceil(R / its requests/s)` replicas. Both are conservative by the sweep's step: the true
capacity lies between the best point and the next one.
"""

from __future__ import annotations

import math

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2e")


def parse_slos(ttft_ms: float | None = None, tpot_ms: float | None = None,
               e2e_ms: float | None = None, goodput: list[str] | None = None) -> dict[str, float]:
    """The SLO limits in seconds, keyed by metric, from `--slo-ttft/--slo-tpot/--slo-e2e` and
    vLLM's `--goodput ttft:MS tpot:MS` (both in milliseconds; one metric given twice with two
    values is an error)."""
    slos = {name: ms / 1000 for name, ms in zip(SLO_METRICS, (ttft_ms, tpot_ms, e2e_ms))
            if ms is not None}
    for item in goodput or ():
        name, _, value = item.partition(":")
        if name not in SLO_METRICS or not value:
            raise ValueError(f"--goodput takes KEY:MS with KEY in {SLO_METRICS}, not {item!r}")
        seconds = float(value) / 1000
        if slos.setdefault(name, seconds) != seconds:
            raise ValueError(f"the {name} SLO is given twice with different values")
    if any(limit <= 0 for limit in slos.values()):
        raise ValueError("SLO limits must be positive")
    return slos


def meets_slos(latencies: dict[str, float], slos: dict[str, float]) -> bool:
    """Whether one request (its metric → seconds) is within every SLO limit."""
    return all(latencies[name] <= limit for name, limit in slos.items())


def sweep_points(rates: list[float], concurrencies: list[int]) -> list[tuple[float, int]]:
    """Every (request rate, max concurrency) pair, rates outermost, in the order given."""
    if any(not rate > 0 for rate in rates) or any(c < 1 for c in concurrencies):
        raise ValueError("request rates must be > 0 (inf: all at once), concurrencies >= 1")
    return [(rate, concurrency) for rate in rates for concurrency in concurrencies]


def percentile(values, q: float) -> float:
    """The q-th percentile (linear interpolation); 0.0 for no values, like the table's stats."""
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else 0.0


def judge_point(point: dict, slos: dict[str, float], q: float) -> dict:
    """Whether a point's summary meets the SLO at percentile q: every request completed and the
    q-th percentile of each limited metric is within its limit. Returns the percentiles too."""
    at = {name: percentile(point["_samples"][name], q) for name in slos}
    ok = (point["failed"] == 0 and point["completed"] > 0
          and all(at[name] <= limit for name, limit in slos.items()))
    return {"slo_percentile": q, "at_slo_percentile_s": at, "meets_slo": ok}


def cost_per_million_tokens(cost_per_hour: float, tokens_per_s: float) -> float:
    """Dollars per million output tokens of a deployment costing `cost_per_hour` that makes
    `tokens_per_s` output tokens per second."""
    return cost_per_hour / (tokens_per_s * 3600) * 1e6


def replicas_needed(target_rate: float, rate_per_replica: float) -> int:
    """Replicas, each sustaining `rate_per_replica` requests/s, that serve `target_rate`."""
    return max(1, math.ceil(target_rate / rate_per_replica - 1e-9))


def capacity(points: list[dict], cost_per_hour: float | None = None,
             target_rate: float | None = None) -> dict:
    """The best point meeting the SLO (judged points: see `judge_point`), its cost per million
    output tokens and the replicas for `target_rate`; `best_point` is None when none meets it."""
    meeting = [i for i, p in enumerate(points) if p["meets_slo"]]
    out = {"best_point": None, "request_rate": None, "max_concurrency": None,
           "output_token_throughput": None, "request_throughput": None,
           "cost_per_hour": cost_per_hour, "cost_per_million_output_tokens": None,
           "target_rate": target_rate, "replicas_needed": None}
    if not meeting:
        return out
    best = max(meeting, key=lambda i: points[i]["output_token_throughput"])
    point = points[best]
    out.update(best_point=best, request_rate=point["request_rate"],
               max_concurrency=point["max_concurrency"],
               output_token_throughput=point["output_token_throughput"],
               request_throughput=point["request_throughput"])
    if cost_per_hour is not None and point["output_token_throughput"] > 0:
        out["cost_per_million_output_tokens"] = cost_per_million_tokens(
            cost_per_hour, point["output_token_throughput"])
    if target_rate is not None and point["request_throughput"] > 0:
        out["replicas_needed"] = replicas_needed(target_rate, point["request_throughput"])
    return out


def describe_slos(slos: dict[str, float], q: float) -> str:
    """E.g. 'TTFT p90 <= 2000 ms, TPOT p90 <= 200 ms, every request completed'."""
    limits = [f"{name.upper()} p{q:g} <= {limit * 1000:g} ms" for name, limit in slos.items()]
    return ", ".join(limits + ["every request completed"])


def point_label(point: dict) -> str:
    """A point's load, e.g. 'rate 8/s, conc 4' or 'all at once, conc 16'."""
    rate = point["request_rate"]
    rate_text = "all at once" if math.isinf(rate) else f"rate {rate:g}/s"
    return f"{rate_text}, conc {point['max_concurrency']}"


def format_sweep_table(points: list[dict], q: float) -> str:
    """One row per point: load, completed/failed, throughput, TTFT/TPOT/ITL p50/p90/p99 (ms),
    goodput, SLO fraction and whether the point meets the SLO at percentile q."""
    lat = "".join(f"{name + ' (ms)':^24}" for name in ("TTFT", "TPOT", "ITL"))
    head = (f"{'rate/s':>7}{'conc':>6}{'ok':>6}{'fail':>5}{'out tok/s':>11}{'req/s':>8}"
            + "".join(f"{p:>8}" for p in ("p50", "p90", "p99") * 3)
            + f"{'goodput':>9}{'SLO %':>7}{f'meets p{q:g}':>11}")
    lines = [" " * 43 + lat, head]
    for p in points:
        row = (f"{p['request_rate']:>7g}{p['max_concurrency']:>6}{p['completed']:>6}"
               f"{p['failed']:>5}{p['output_token_throughput']:>11.1f}"
               f"{p['request_throughput']:>8.2f}")
        for name in ("ttft", "tpot", "itl"):
            row += "".join(f"{p[f'{name}_s'][k] * 1000:>8.1f}" for k in ("p50", "p90", "p99"))
        row += (f"{p['goodput']:>9.2f}{p['slo_fraction'] * 100:>7.1f}"
                f"{'yes' if p['meets_slo'] else 'no':>11}")
        lines.append(row)
    return "\n".join(lines)


def format_capacity(summary: dict, points: list[dict], slos: dict[str, float],
                    q: float) -> str:
    """The capacity answer in words: the best point meeting the SLO, its cost, the replicas."""
    lines = [f"SLO: {describe_slos(slos, q)}"]
    if summary["best_point"] is None:
        lines.append(f"no point meets the SLO ({len(points)} measured): "
                     "lower the request rate or concurrency, or relax the SLO")
        return "\n".join(lines)
    lines.append(f"best point meeting the SLO: {point_label(points[summary['best_point']])}: "
                 f"{summary['output_token_throughput']:.1f} output tokens/s, "
                 f"{summary['request_throughput']:.2f} requests/s")
    if summary["cost_per_million_output_tokens"] is not None:
        lines.append(f"cost: ${summary['cost_per_hour']:g}/hour -> "
                     f"${summary['cost_per_million_output_tokens']:.2f} "
                     "per million output tokens")
    if summary["replicas_needed"] is not None:
        lines.append(f"replicas for {summary['target_rate']:g} requests/s: "
                     f"{summary['replicas_needed']}")
    return "\n".join(lines)


def require_pyplot():
    """matplotlib's pyplot on the file-only backend; a clear error when it isn't installed
    (checked before the load runs, so a long sweep never ends in a missing package)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ValueError("--plot needs matplotlib: pip install matplotlib "
                         "(or pip install 'jaxserve[plot]')") from err
    return plt


def plot(points: list[dict], slos: dict[str, float], q: float, path: str) -> None:
    """Write a PNG: on top, TTFT and TPOT at percentile q against output tokens/s, one marker
    per point (filled when it meets the SLO) labelled with its load, the SLO limits as
    horizontal lines; below, the TTFT/TPOT/ITL/E2E CDFs, one line per point."""
    plt = require_pyplot()
    fig = plt.figure(figsize=(16, 8))
    grid = fig.add_gridspec(2, 4)
    throughput = [p["output_token_throughput"] for p in points]
    for column, name in enumerate(("ttft", "tpot")):
        ax = fig.add_subplot(grid[0, 2 * column:2 * column + 2])
        latency = [percentile(p["_samples"][name], q) * 1000 for p in points]
        ax.plot(throughput, latency, color="tab:blue", alpha=0.5)
        for p, x, y in zip(points, throughput, latency):
            ax.plot(x, y, "o", color="tab:blue", fillstyle="full" if p["meets_slo"] else "none")
            ax.annotate(point_label(p), (x, y), textcoords="offset points", xytext=(4, 4),
                        fontsize=8)
        if name in slos:
            ax.axhline(slos[name] * 1000, color="tab:red", linestyle="--",
                       label=f"SLO {slos[name] * 1000:g} ms")
            ax.legend(loc="upper left")
        ax.set_title(f"{name.upper()} p{q:g} vs throughput (filled: meets the SLO)")
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel("ms")
        ax.margins(x=0.15)  # room for the labels of the outermost points
        ax.grid(alpha=0.3)
    for column, name in enumerate(("ttft", "tpot", "itl", "e2e")):
        ax = fig.add_subplot(grid[1, column])
        for p in points:
            values = np.sort(np.asarray(p["_samples"][name]) * 1000)
            ax.plot(values, np.linspace(0, 1, len(values)), label=point_label(p))
        ax.set_title(f"{name.upper()} CDF")
        ax.set_xlabel("ms")
        ax.grid(alpha=0.3)
    if len(points) > 1:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
