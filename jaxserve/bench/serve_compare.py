"""`jaxserve bench serve --baseline-url URL`: one load, run alternately against jaxserve
(`--url`) and a baseline server (`--baseline-url`, e.g. vLLM serving the same folder), so
that both meet the machine at nearly the same moment: on a shared machine the load moves
from one minute to the next, and two runs minutes apart compare the minutes, not the servers.

Each server first gets one unmeasured wave of `--max-concurrency` requests (a server's first
requests after start-up wait for work done once: 325 ms TTFT p50 against ~100 after, on the
shipped model). Then `--rounds` rounds, each running jaxserve then the baseline on prompts of
their own (`--seed` + round, so that neither prefix cache answers a round from an earlier
one). Prints every round and the medians over rounds side by side — TTFT p50, TPOT p50,
output tokens/s — and whether jaxserve's TTFT p50 is at most the baseline's at no less
throughput (issue 67's goal for first tokens under load).
"""

from __future__ import annotations

import argparse
import statistics

SERVERS = ("jaxserve", "baseline")
COLUMNS = (("TTFT p50 (ms)", lambda p: p["ttft_s"]["p50"] * 1000),
           ("TPOT p50 (ms)", lambda p: p["tpot_s"]["p50"] * 1000),
           ("output tok/s", lambda p: p["output_token_throughput"]))


def load_for(args: argparse.Namespace, url: str, seed: int, num_prompts: int | None = None
             ) -> argparse.Namespace:
    """`args` for one run of the single point against `url` with prompts from `seed`."""
    if len(args.request_rate) != 1 or len(args.max_concurrency) != 1:
        raise ValueError("--baseline-url compares one point: give one --request-rate and one "
                         "--max-concurrency")
    return argparse.Namespace(**{**vars(args), "url": url, "seed": seed,
                                 "request_rate": args.request_rate[0],
                                 "max_concurrency": args.max_concurrency[0],
                                 "num_prompts": num_prompts or args.num_prompts})


async def compare(args: argparse.Namespace, slos: dict[str, float]) -> list[dict]:
    """Warm each server up, then run the rounds; one `run_benchmark` summary per round and
    server, with "round" and "server" added, in the order they ran."""
    from jaxserve.bench.serve_bench import run_benchmark

    if args.rounds < 1:
        raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
    urls = dict(zip(SERVERS, (args.url, args.baseline_url)))
    for name, url in urls.items():
        print(f"warming up {name} ({url}) ...", flush=True)
        await run_benchmark(load_for(args, url, args.seed - 1, args.max_concurrency[0]), slos)
    rows = []
    for index in range(args.rounds):
        for name, url in urls.items():
            point = await run_benchmark(load_for(args, url, args.seed + index), slos)
            rows.append({"round": index, "server": name, **point})
            print(f"round {index + 1}/{args.rounds} {name}: " + ", ".join(
                f"{label} {value(point):.1f}" for label, value in COLUMNS), flush=True)
    return rows


def medians(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per server, the median over rounds of each column."""
    return {name: {label: statistics.median(value(r) for r in rows if r["server"] == name)
                   for label, value in COLUMNS} for name in SERVERS}


def format_comparison(rows: list[dict]) -> str:
    """Every round, the medians, jaxserve over the baseline, and the TTFT goal's verdict."""
    header = f"{'':<22}" + "".join(f"{label:>16}" for label, _ in COLUMNS)
    lines = [header]
    for row in rows:
        lines.append(f"{'round ' + str(row['round'] + 1) + ' ' + row['server']:<22}" + "".join(
            f"{value(row):>16.1f}" for _, value in COLUMNS))
    middle = medians(rows)
    for name in SERVERS:
        lines.append(f"{'median ' + name:<22}" + "".join(
            f"{middle[name][label]:>16.1f}" for label, _ in COLUMNS))
    ours, theirs = middle["jaxserve"], middle["baseline"]
    lines.append(f"{'jaxserve/baseline':<22}" + "".join(
        f"{ours[label] / theirs[label]:>15.2f}x" if theirs[label] else f"{'-':>16}"
        for label, _ in COLUMNS))
    met = (ours["TTFT p50 (ms)"] <= theirs["TTFT p50 (ms)"]
           and ours["output tok/s"] >= theirs["output tok/s"])
    lines.append("TTFT p50 at most the baseline's at no less throughput (medians): "
                 + ("yes" if met else "no"))
    return "\n".join(lines)
