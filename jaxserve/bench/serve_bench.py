"""`jaxserve bench serve`: load-test a running OpenAI-compatible server, at one load or a sweep
of them, and answer the capacity question: how much throughput, at what cost, for this latency.

Requests go to `/v1/completions` with `stream: true` (`--no-stream`: whole answers), at a
Poisson rate (`--request-rate`) or all at once, never more than `--max-concurrency` in flight.
Prompts are random token ids in `--prompt-token-range` (default [100, 1000), valid for any real
vocabulary) with lengths drawn around `--input-len`; every request asks for exactly
`--output-len` tokens (`ignore_eos`). Reports completed/failed, request and token throughput,
TTFT, TPOT (per request, excluding the first token; unstreamed, where the first token comes
with the last, the whole request's time per output token), ITL (between streamed chunks) and
end-to-end latency as mean/p50/p90/p99, and goodput: requests per second meeting every SLO
given (`--slo-ttft`, `--slo-tpot`, `--slo-e2e` in ms, or vLLM's `--goodput ttft:MS tpot:MS`).
A server that speculates also gets its acceptance rate over the run: accepted over proposed
draft tokens, from its `vllm:spec_decode_*` counters on `/metrics` before and after.

Several `--request-rate` and/or `--max-concurrency` values sweep every pair of them, one run
per point with the same seeded prompts and arrival pattern (the Poisson gaps scaled to each
rate), and print one table row per point. Each point's prompts differ from the other points'
in their first token only, so the server's prefix cache cannot answer a point from an earlier
one. `serve_sweep` judges the points against the SLO at `--slo-percentile`, picks the best one
meeting it, prices its output tokens (`--cost-per-hour`) and sizes a deployment for
`--target-rate`. `--json` writes every point and that summary; `--plot` draws throughput
against latency with the SLO lines, and the latency CDFs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import time

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.bench import serve_sweep


@dataclasses.dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    error: str = ""
    streamed: bool = True

    @property
    def tpot(self) -> float:
        """Seconds per output token after the first (streamed), or per output token of the
        whole request (unstreamed: its TTFT is its end-to-end latency)."""
        if not self.streamed:
            return self.e2e / self.output_tokens if self.output_tokens else 0.0
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", "--base-url", dest="url", default="http://127.0.0.1:8000",
                        help="server base URL")
    parser.add_argument("--model", default=None, help="model name (default: the first served)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-prompts", type=int, default=200, help="requests per point")
    parser.add_argument("--request-rate", type=float, nargs="+", default=[math.inf],
                        help="requests per second, Poisson arrivals (default: inf, all at "
                             "once); several values sweep them")
    parser.add_argument("--max-concurrency", type=int, nargs="+", default=[32],
                        help="most requests in flight; several values sweep them")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--input-len-std", type=float, default=0.0,
                        help="standard deviation of prompt lengths (normal, clipped at 1)")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prompt-token-range", type=int, nargs=2, default=(100, 1000),
                        metavar=("LOW", "HIGH"), help="prompt token ids are drawn from [LOW, HIGH)")
    parser.add_argument("--no-stream", dest="stream", action="store_false",
                        help="ask for whole answers instead of server-sent events")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    parser.add_argument("--slo-ttft", type=float, default=None, metavar="MS",
                        help="SLO on time to first token, milliseconds")
    parser.add_argument("--slo-tpot", type=float, default=None, metavar="MS",
                        help="SLO on time per output token after the first, milliseconds")
    parser.add_argument("--slo-e2e", type=float, default=None, metavar="MS",
                        help="SLO on end-to-end request latency, milliseconds")
    parser.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                        help="the SLOs as vLLM spells them, e.g. ttft:2000 tpot:200")
    parser.add_argument("--slo-percentile", type=float, default=90.0,
                        help="a point meets the SLO when this percentile of each limited "
                             "metric is within its limit and no request failed (default 90)")
    parser.add_argument("--cost-per-hour", type=float, default=None, metavar="USD",
                        help="price of the measured deployment: prints the cost per million "
                             "output tokens at the best point meeting the SLO")
    parser.add_argument("--target-rate", type=float, default=None, metavar="REQ_PER_S",
                        help="prints the replicas of the measured deployment this load needs")
    parser.add_argument("--baseline-url", default=None, metavar="URL",
                        help="also load this server (e.g. vLLM on the same folder), alternating "
                             "with --url round by round, and print both side by side")
    parser.add_argument("--rounds", type=int, default=3,
                        help="with --baseline-url: rounds of one run per server (default 3)")
    parser.add_argument("--json", default=None, help="write every point and the summary here")
    parser.add_argument("--plot", default=None,
                        help="write a PNG: throughput vs TTFT/TPOT with the SLO, latency CDFs "
                             "(needs matplotlib)")


async def _one(client: httpx.AsyncClient, url: str, body: dict, headers: dict,
               timeout: float) -> RequestResult:
    start = time.perf_counter()
    result = RequestResult(ok=False, streamed=body["stream"])
    last = None
    try:
        if not body["stream"]:
            response = await client.post(url, json=body, headers=headers, timeout=timeout)
            result.e2e = result.ttft = time.perf_counter() - start
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {response.text[:200]!r}"
                return result
            usage = response.json()["usage"]
            result.prompt_tokens = usage["prompt_tokens"]
            result.output_tokens = usage["completion_tokens"]
            result.ok = result.output_tokens > 0
            result.error = "" if result.ok else "no tokens"
            return result
        async with client.stream("POST", url, json=body, headers=headers,
                                 timeout=timeout) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.e2e = time.perf_counter() - start
        result.ok = result.output_tokens > 0
        if not result.ok:
            result.error = "no tokens"
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        result.error = f"{type(err).__name__}: {err}"
    return result


async def run_sweep(args: argparse.Namespace, points: list[tuple[float, int]],
                    slos: dict[str, float]) -> list[dict]:
    """Run every (request rate, max concurrency) point in turn with the same prompts and
    arrival pattern; return one `summarize` dict per point, with its load added."""
    rng = np.random.default_rng(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.url) as client:
        model = args.model
        if model is None:
            response = await client.get("/v1/models", headers=headers)
            response.raise_for_status()
            model = response.json()["data"][0]["id"]
        lengths = np.maximum(1, rng.normal(args.input_len, args.input_len_std,
                                           args.num_prompts).round().astype(int))
        low, high = args.prompt_token_range
        prompts = [rng.integers(low, high, n).tolist() for n in lengths]
        gaps = rng.exponential(1.0, args.num_prompts)  # unit-rate Poisson gaps
        summaries = []
        for index, (rate, concurrency) in enumerate(points):
            if len(points) > 1:
                print(f"point {index + 1}/{len(points)}: rate {rate:g}/s, "
                      f"concurrency {concurrency}", flush=True)
            # the point's own first token: no prefix-cache hits on an earlier point's prompts
            bodies = [{"model": model, "prompt": [low + index % (high - low)] + prompt[1:],
                       "max_tokens": args.output_len, "ignore_eos": True, "temperature": 0.0,
                       "stream": args.stream}
                      | ({"stream_options": {"include_usage": True}} if args.stream else {})
                      for prompt in prompts]
            before = await spec_decode_counts(client, headers)
            results, duration = await _load(client, bodies, gaps / rate, concurrency,
                                             headers, args.timeout)
            summary = summarize(results, duration, slos)
            summary["spec_acceptance_rate"] = acceptance_rate(
                before, await spec_decode_counts(client, headers))
            summaries.append({"request_rate": rate, "max_concurrency": concurrency, **summary})
    return summaries


async def spec_decode_counts(client: httpx.AsyncClient, headers: dict
                             ) -> tuple[float, float] | None:
    """(draft tokens, accepted tokens) from the server's `/metrics` (vLLM's
    `vllm:spec_decode_*` counters, summed over models); None when it has no such counters
    (no speculation, or a server without `/metrics`)."""
    response = await client.get("/metrics", headers=headers)
    if response.status_code != 200:
        return None
    totals = {"vllm:spec_decode_num_draft_tokens": 0.0,
              "vllm:spec_decode_num_accepted_tokens": 0.0}
    found = False
    for family in text_string_to_metric_families(response.text):
        if family.name in totals:
            found = True
            totals[family.name] += sum(sample.value for sample in family.samples
                                       if sample.name.endswith("_total"))
    return tuple(totals.values()) if found else None


def acceptance_rate(before: tuple[float, float] | None,
                    after: tuple[float, float] | None) -> float | None:
    """Accepted over proposed draft tokens between two `spec_decode_counts` (None when the
    server does not speculate or proposed nothing)."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    return (after[1] - before[1]) / (after[0] - before[0])


async def _load(client: httpx.AsyncClient, bodies: list[dict], gaps: np.ndarray,
                concurrency: int, headers: dict, timeout: float
                ) -> tuple[list[RequestResult], float]:
    """Send `bodies`, waiting `gaps[i]` seconds between the i-th and the next, at most
    `concurrency` in flight; return the results and the wall time from the first send to the
    last answer."""
    gate = asyncio.Semaphore(concurrency)
    done = 0

    async def limited(body):
        nonlocal done
        async with gate:
            out = await _one(client, "/v1/completions", body, headers, timeout)
        done += 1
        if done % max(1, len(bodies) // 10) == 0 or done == len(bodies):
            print(f"  {done}/{len(bodies)} requests done", flush=True)
        return out

    start = time.perf_counter()
    tasks = []
    for index, body in enumerate(bodies):
        if index and gaps[index - 1] > 0:
            await asyncio.sleep(gaps[index - 1])
        tasks.append(asyncio.ensure_future(limited(body)))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


async def run_benchmark(args: argparse.Namespace, slos: dict[str, float] | None = None) -> dict:
    """One point at `args.request_rate` and `args.max_concurrency` (single numbers), with
    `slos` in seconds for goodput; return its summary dict."""
    points = [(args.request_rate, args.max_concurrency)]
    return (await run_sweep(args, points, slos or {}))[0]


def _stats(values) -> dict:
    if not len(values):
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    arr = np.asarray(values, dtype=float)
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)),
            "p90": float(np.percentile(arr, 90)), "p99": float(np.percentile(arr, 99))}


def summarize(results: list[RequestResult], duration: float, slos: dict[str, float]) -> dict:
    """Counts, throughput, latency stats and goodput of one point; `_samples` keeps the raw
    latencies (seconds) for the SLO percentile and the plot, and is left out of the JSON."""
    ok = [r for r in results if r.ok]
    good = [r for r in ok if serve_sweep.meets_slos(
        {"ttft": r.ttft, "tpot": r.tpot, "e2e": r.e2e}, slos)]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "request_throughput": len(ok) / duration,
        "output_token_throughput": output_tokens / duration,
        "total_token_throughput": (output_tokens + prompt_tokens) / duration,
        "goodput": len(good) / duration,
        "slo_fraction": len(good) / len(results) if results else 0.0,
        "ttft_s": _stats([r.ttft for r in ok]), "tpot_s": _stats([r.tpot for r in ok]),
        "itl_s": _stats([g for r in ok for g in r.itl]),
        "e2e_s": _stats([r.e2e for r in ok]),
        "_samples": {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok],
                     "itl": [g for r in ok for g in r.itl], "e2e": [r.e2e for r in ok]},
    }


def format_table(summary: dict, slos: dict[str, float]) -> str:
    """One point's numbers, one per line (the output of a run without a sweep)."""
    slos = " ".join(f"{k}<={v * 1000:g}ms" for k, v in slos.items()) or "none"
    lines = [f"{'completed':<28}{summary['completed']}", f"{'failed':<28}{summary['failed']}",
             f"{'duration (s)':<28}{summary['duration_s']:.2f}",
             f"{'requests/s':<28}{summary['request_throughput']:.2f}",
             f"{'output tokens/s':<28}{summary['output_token_throughput']:.1f}",
             f"{'total tokens/s':<28}{summary['total_token_throughput']:.1f}",
             f"{'goodput (requests/s)':<28}{summary['goodput']:.2f}  SLOs {slos}",
             *([f"{'spec acceptance rate':<28}{summary['spec_acceptance_rate']:.1%}"]
               if summary.get("spec_acceptance_rate") is not None else []),
             f"{'latency (ms)':<14}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"]
    for name in ("ttft", "tpot", "itl", "e2e"):
        s = summary[f"{name}_s"]
        lines.append(f"{name.upper():<14}" + "".join(f"{s[k] * 1000:>10.1f}"
                                                     for k in ("mean", "p50", "p90", "p99")))
    return "\n".join(lines)


def _finite(value):
    """JSON has no infinity: an unlimited request rate is written as null."""
    return None if isinstance(value, float) and math.isinf(value) else value


def run_from_args(args: argparse.Namespace) -> int:
    """The CLI: run the points, print the table(s) and the capacity answer, write JSON/plot.
    Exit status 1 when any request failed."""
    slos = serve_sweep.parse_slos(args.slo_ttft, args.slo_tpot, args.slo_e2e, args.goodput)
    points = serve_sweep.sweep_points(args.request_rate, args.max_concurrency)
    q = args.slo_percentile
    if not 0 < q <= 100:
        raise ValueError("--slo-percentile must be in (0, 100]")
    if args.plot:
        serve_sweep.require_pyplot()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a log line per request
    if args.baseline_url:
        return _compare_from_args(args, slos)
    if len(points) == 1:
        print(f"benchmarking {args.url}: {args.num_prompts} prompts, rate "
              f"{points[0][0]}/s, concurrency {points[0][1]}", flush=True)
    else:
        print(f"benchmarking {args.url}: {len(points)} points of {args.num_prompts} prompts, "
              f"rates {args.request_rate}/s x concurrencies {args.max_concurrency}", flush=True)
    results = asyncio.run(run_sweep(args, points, slos))
    for point in results:
        point.update(serve_sweep.judge_point(point, slos, q))
    summary = serve_sweep.capacity(results, args.cost_per_hour, args.target_rate)
    print(format_table(results[0], slos) if len(results) == 1
          else serve_sweep.format_sweep_table(results, q))
    if (len(results) > 1 or slos or args.cost_per_hour is not None
            or args.target_rate is not None):
        print(serve_sweep.format_capacity(summary, results, slos, q))
    if args.json:
        report = {"url": args.url, "num_prompts": args.num_prompts, "input_len": args.input_len,
                  "output_len": args.output_len, "slo_ms": {k: v * 1000 for k, v in slos.items()},
                  "slo_percentile": q,
                  "points": [{k: _finite(v) for k, v in p.items() if k != "_samples"}
                             for p in results],
                  "capacity": {k: _finite(v) for k, v in summary.items()}}
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    if args.plot:
        serve_sweep.plot(results, slos, q, args.plot)
    return 0 if all(p["failed"] == 0 for p in results) else 1


def _compare_from_args(args: argparse.Namespace, slos: dict[str, float]) -> int:
    """`--baseline-url`: both servers alternately (`serve_compare`), side by side."""
    from jaxserve.bench import serve_compare

    print(f"comparing {args.url} with {args.baseline_url}: {args.rounds} rounds of "
          f"{args.num_prompts} prompts, rate {args.request_rate[0]}/s, concurrency "
          f"{args.max_concurrency[0]}", flush=True)
    rows = asyncio.run(serve_compare.compare(args, slos))
    print(serve_compare.format_comparison(rows))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"rounds": [{k: _finite(v) for k, v in row.items() if k != "_samples"}
                                  for row in rows],
                       "medians": serve_compare.medians(rows)}, out, indent=2)
    return 0 if all(row["failed"] == 0 for row in rows) else 1
