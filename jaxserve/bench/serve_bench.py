"""`jaxserve bench serve`: load-test a running OpenAI-compatible server.

Requests go to `/v1/completions` with `stream: true`, at a Poisson rate (`--request-rate`) or
all at once, never more than `--max-concurrency` in flight. Prompts are random token ids in
`--prompt-token-range` (default [100, 1000), valid for any real vocabulary) with lengths
drawn around `--input-len`; every request asks for exactly `--output-len` tokens
(`ignore_eos`). Reports completed/failed,
request and token throughput, TTFT, TPOT (per request, excluding the first token), ITL
(between streamed chunks) and end-to-end latency as mean/p50/p90/p99, and goodput: requests
per second meeting every SLO given. Prints a table, optionally writes JSON and a CDF plot.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time

import httpx
import numpy as np


@dataclasses.dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    parser.add_argument("--model", default=None, help="model name (default: the first served)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second, Poisson arrivals (default: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--input-len-std", type=float, default=0.0,
                        help="standard deviation of prompt lengths (normal, clipped at 1)")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prompt-token-range", type=int, nargs=2, default=(100, 1000),
                        metavar=("LOW", "HIGH"), help="prompt token ids are drawn from [LOW, HIGH)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    parser.add_argument("--slo-ttft", type=float, default=None, help="seconds")
    parser.add_argument("--slo-tpot", type=float, default=None, help="seconds")
    parser.add_argument("--slo-e2e", type=float, default=None, help="seconds")
    parser.add_argument("--json", default=None, help="write the results as JSON here")
    parser.add_argument("--plot", default=None, help="write latency CDFs as PNG (matplotlib)")


async def _one(client: httpx.AsyncClient, url: str, body: dict, headers: dict,
               timeout: float) -> RequestResult:
    start = time.perf_counter()
    result = RequestResult(ok=False)
    last = None
    try:
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


async def run_benchmark(args: argparse.Namespace) -> dict:
    """Send the load; return the summary dict."""
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
        bodies = [{"model": model, "prompt": rng.integers(low, high, n).tolist(),
                   "max_tokens": args.output_len, "ignore_eos": True, "temperature": 0.0,
                   "stream": True, "stream_options": {"include_usage": True}}
                  for n in lengths]
        gate = asyncio.Semaphore(args.max_concurrency)
        done = 0

        async def limited(body):
            nonlocal done
            async with gate:
                out = await _one(client, "/v1/completions", body, headers, args.timeout)
            done += 1
            if done % max(1, args.num_prompts // 10) == 0 or done == args.num_prompts:
                print(f"  {done}/{args.num_prompts} requests done", flush=True)
            return out

        start = time.perf_counter()
        tasks = []
        for body in bodies:
            tasks.append(asyncio.ensure_future(limited(body)))
            if np.isfinite(args.request_rate):
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration, args)


def _stats(values) -> dict:
    if not len(values):
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    arr = np.asarray(values, dtype=float)
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)),
            "p90": float(np.percentile(arr, 90)), "p99": float(np.percentile(arr, 99))}


def summarize(results: list[RequestResult], duration: float, args) -> dict:
    ok = [r for r in results if r.ok]
    slos = {"ttft": args.slo_ttft, "tpot": args.slo_tpot, "e2e": args.slo_e2e}
    good = [r for r in ok if all(limit is None or getattr(r, name) <= limit
                                 for name, limit in slos.items())]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "request_throughput": len(ok) / duration,
        "output_token_throughput": output_tokens / duration,
        "total_token_throughput": (output_tokens + prompt_tokens) / duration,
        "goodput": len(good) / duration, "slos": {k: v for k, v in slos.items() if v},
        "ttft_s": _stats([r.ttft for r in ok]), "tpot_s": _stats([r.tpot for r in ok]),
        "itl_s": _stats([g for r in ok for g in r.itl]),
        "e2e_s": _stats([r.e2e for r in ok]),
        "_samples": {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok],
                     "itl": [g for r in ok for g in r.itl], "e2e": [r.e2e for r in ok]},
    }


def format_table(summary: dict) -> str:
    lines = [f"{'completed':<28}{summary['completed']}", f"{'failed':<28}{summary['failed']}",
             f"{'duration (s)':<28}{summary['duration_s']:.2f}",
             f"{'requests/s':<28}{summary['request_throughput']:.2f}",
             f"{'output tokens/s':<28}{summary['output_token_throughput']:.1f}",
             f"{'total tokens/s':<28}{summary['total_token_throughput']:.1f}",
             f"{'goodput (requests/s)':<28}{summary['goodput']:.2f}  SLOs {summary['slos']}",
             f"{'latency (ms)':<14}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"]
    for name in ("ttft", "tpot", "itl", "e2e"):
        s = summary[f"{name}_s"]
        lines.append(f"{name.upper():<14}" + "".join(f"{s[k] * 1000:>10.1f}"
                                                     for k in ("mean", "p50", "p90", "p99")))
    return "\n".join(lines)


def plot_cdfs(summary: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ValueError("--plot needs matplotlib: pip install 'jaxserve[plot]'") from err
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.5))
    for ax, name in zip(axes, ("ttft", "tpot", "itl", "e2e")):
        values = np.sort(np.asarray(summary["_samples"][name]) * 1000)
        ax.plot(values, np.linspace(0, 1, len(values)) if len(values) else values)
        ax.set_title(f"{name.upper()} CDF")
        ax.set_xlabel("ms")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


def run_from_args(args: argparse.Namespace) -> int:
    print(f"benchmarking {args.url}: {args.num_prompts} prompts, rate {args.request_rate}/s, "
          f"concurrency {args.max_concurrency}", flush=True)
    summary = asyncio.run(run_benchmark(args))
    print(format_table(summary))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({k: v for k, v in summary.items() if k != "_samples"}, out, indent=2)
    if args.plot:
        plot_cdfs(summary, args.plot)
    return 0 if summary["failed"] == 0 else 1
