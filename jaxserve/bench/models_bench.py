"""`jaxserve bench models`: several models in one server (`jaxserve serve --models`), measured
the way a user runs it: a models file, default engine options, real HTTP clients against a
server on 127.0.0.1 (uvicorn on a thread of this process). The flood of part 1 comes from
a process of its own, as a user's clients would: its streams' client work (HTTP, SSE
parsing) does not run in the server's interpreter, where it would compete for the GIL.

The models file serves one model folder (`--model`, default the shipped model) twice, as
"busy" and "quiet": two engines on the same device, which take round-robin turns of engine
steps (`jaxserve.fleet.device_turns`).

1. Isolation. The quiet model's time to first token (`--requests` sequential streaming
   completions of a short prompt, 8 tokens) is measured with the busy model idle, then
   while the busy model is flooded (`--flood-concurrency` streaming completions of
   `--flood-max-tokens` tokens, eos ignored, each replaced as soon as it finishes, sent from
   a process of their own; the measurement starts once each of them has had a request
   stream, and the flood lasts until it ends). With `--no-flood-stream` the flood's
   requests are answered whole, as a batch client's, which an engine alone on its device
   would run as decode loops of `num_decode_steps`. Printed: quiet TTFT p50/p90 alone and under
   flood, their ratio (the target: p50 under flood within 3x of alone), and the busy model's
   output tokens/s during the flood.
2. Reload timeline. While `--reload-concurrency` streaming requests to "quiet" run (each
   replaced as it finishes), the file is rewritten and `POST /admin/reload` applied three
   times: add quiet version 2 (weight 50); set version 1's weight to 0; remove version 1.
   Printed: each reload's timeline (load, loaded with weights_s and warm_up_s, switch,
   drain, freed; t in seconds since that reload began), the requests each version answered
   between reloads, the failed requests (there must be none) and how long the removed
   version took to be freed.

The busy throughput counts the tokens streamed during the measurement: a request's tokens
are spread over its streamed chunks in proportion to their text, at the tokens per
character of the flood requests that finished (their `usage`); the requests still running
when the measurement ends are cancelled (not counted as failures).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import secrets
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np

TTFT_TARGET_RATIO = 3.0  # the target: quiet p50 under flood within 3x of alone
QUIET_MAX_TOKENS = 8
REQUEST_TIMEOUT = 600.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="model folder served twice (default: the shipped model)")
    parser.add_argument("--requests", type=int, default=20,
                        help="sequential quiet requests timed, alone and under flood")
    parser.add_argument("--flood-concurrency", type=int, default=64,
                        help="streaming requests kept in flight to the busy model")
    parser.add_argument("--flood-max-tokens", type=int, default=128,
                        help="tokens each flood request generates (eos ignored)")
    parser.add_argument("--flood-stream", action=argparse.BooleanOptionalAction, default=True,
                        help="the flood's requests stream (default), or, with "
                             "--no-flood-stream, each gets its whole answer at once (a "
                             "batch client: the engine may run decode loops for them)")
    parser.add_argument("--reload-concurrency", type=int, default=32,
                        help="streaming requests kept in flight during the reloads")
    parser.add_argument("--json", default=None, help="write the results as JSON here")


# ---- the server, in this process -------------------------------------------------------
class _Server:
    """`jaxserve serve --models FILE` on 127.0.0.1: uvicorn on a background thread."""

    def __init__(self, models_file: Path):
        import uvicorn

        from jaxserve.server.app import create_app
        from jaxserve.server.state import ServerOptions, ServerState

        self.admin_key = secrets.token_hex(16)  # POST /admin/reload needs one
        self.state = ServerState(ServerOptions(models_file=str(models_file),
                                               admin_api_key=self.admin_key))
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.state), host="127.0.0.1",
                                                    port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="jaxserve-bench-server",
                                       daemon=True)

    def start(self, timeout: float = 900.0) -> float:
        """Start and wait until every model is loaded and warm; returns the seconds taken."""
        started = time.perf_counter()
        self.thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.state.fatal_error:
                raise RuntimeError(f"the server cannot serve: {self.state.fatal_error}")
            if self.server.started:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{self.url}/health", timeout=10).status_code == 200:
                        return time.perf_counter() - started
            time.sleep(0.1)
        raise RuntimeError(f"the server was not ready after {timeout:.0f} s")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


@contextlib.contextmanager
def _serving(models_file: Path):
    server = _Server(models_file)
    try:
        yield server
    finally:
        server.stop()


def _toml_entry(**fields) -> str:
    lines = ["[[models]]"]
    for key, value in fields.items():
        lines.append(f"{key} = {json.dumps(value)}")  # JSON strings and numbers are TOML's
    return "\n".join(lines) + "\n"


def _write_models(path: Path, entries: list[dict]) -> None:
    path.write_text("\n".join(_toml_entry(**entry) for entry in entries))


# ---- streaming requests ----------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class _Result:
    ok: bool = False
    cancelled: bool = False  # stopped by the benchmark (end of the measurement)
    version: str = ""  # the x-jaxserve-model-version header
    start: float = 0.0  # time.perf_counter()
    ttft: float = 0.0  # seconds to the first streamed choice
    tokens: int = 0  # usage.completion_tokens (requests that finished)
    chunks: list[tuple[float, int]] = dataclasses.field(default_factory=list)  # (time, chars)
    error: str = ""

    @property
    def chars(self) -> int:
        return sum(n for _, n in self.chunks)


async def _stream(client: httpx.AsyncClient, body: dict, result: _Result) -> None:
    """One streaming completion into `result` (which keeps what arrived if cancelled)."""
    result.start = time.perf_counter()
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", "/v1/completions", json=body,
                                 timeout=REQUEST_TIMEOUT) as response:
            result.version = response.headers.get("x-jaxserve-model-version", "")
            if response.status_code != 200:
                text = (await response.aread())[:200]
                result.error = f"HTTP {response.status_code}: {text!r}"
                return
            done = False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if "error" in chunk:
                    result.error = f"error in the stream: {chunk['error'].get('message')}"
                    return
                if chunk.get("usage"):
                    result.tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices") or ():
                    if not result.chunks:
                        result.ttft = now - result.start
                    result.chunks.append((now, len(choice.get("text") or "")))
            result.ok = done and result.tokens > 0
            if not result.ok:
                result.error = "no tokens" if done else "the stream ended without [DONE]"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, TypeError) as err:
        result.error = f"{type(err).__name__}: {err}"


async def _complete(client: httpx.AsyncClient, body: dict, result: _Result) -> None:
    """One completion, not streamed, into `result`: its one chunk is the whole text, when
    it arrives."""
    result.start = time.perf_counter()
    try:
        response = await client.post("/v1/completions", json=body, timeout=REQUEST_TIMEOUT)
        result.version = response.headers.get("x-jaxserve-model-version", "")
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}: {response.text[:200]!r}"
            return
        answer = response.json()
        now = time.perf_counter()
        result.ttft = now - result.start
        result.chunks.append((now, len(answer["choices"][0]["text"])))
        result.tokens = answer["usage"]["completion_tokens"]
        result.ok = result.tokens > 0
        if not result.ok:
            result.error = "no tokens"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, TypeError, IndexError) as err:
        result.error = f"{type(err).__name__}: {err}"


class _Load:
    """`concurrency` workers, each sending requests (`make_body(index)`) one after another
    until `stop()`: as many requests in flight as workers, for as long as it runs. They
    stream (`_stream`) unless `send` says otherwise (`_complete`)."""

    def __init__(self, client: httpx.AsyncClient, concurrency: int,
                 make_body: Callable[[int], dict], send=_stream):
        self.client, self.make_body, self.send = client, make_body, send
        self.results: list[_Result] = []  # finished, failed and cancelled
        self.in_flight: list[_Result] = []
        self._count = 0
        self._stopping = False
        self._tasks = [asyncio.ensure_future(self._worker()) for _ in range(concurrency)]

    async def _worker(self) -> None:
        while not self._stopping:
            result = _Result()
            body = self.make_body(self._count)
            self._count += 1
            self.in_flight.append(result)
            try:
                await self.send(self.client, body, result)
            except asyncio.CancelledError:
                result.cancelled = True
                return
            finally:
                self.in_flight.remove(result)
                self.results.append(result)

    @property
    def streaming(self) -> int:
        """Requests in flight that have streamed their first token."""
        return sum(bool(r.chunks) for r in self.in_flight)

    @property
    def running(self) -> int:
        """Requests known to be running: those streaming, or all in flight when the
        requests are answered whole (nothing tells when one has started)."""
        return self.streaming if self.send is _stream else len(self.in_flight)

    async def wait_all_served(self, timeout: float = 300.0) -> None:
        """Until every worker has had a request stream, or answered when they do not (the
        engine has taken in the whole load, also when it runs fewer at once than there are
        workers) or `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and sum(
                bool(r.chunks) for r in self.results + self.in_flight) < len(self._tasks):
            await asyncio.sleep(0.05)

    async def stop(self, cancel: bool) -> None:
        """Send no more; cancel the requests in flight (`cancel`) or let them finish."""
        self._stopping = True
        if cancel:
            for task in self._tasks:
                task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    @property
    def completed(self) -> list[_Result]:
        return [r for r in self.results if r.ok]

    @property
    def failed(self) -> list[_Result]:
        return [r for r in self.results if not r.ok and not r.cancelled]


def _client(base_url: str, concurrency: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=concurrency + 8,
                          max_keepalive_connections=concurrency + 8)
    return httpx.AsyncClient(base_url=base_url, limits=limits, timeout=REQUEST_TIMEOUT)


def _stats(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "mean": None}
    arr = np.asarray(values, dtype=float)
    return {"p50": float(np.percentile(arr, 50)), "p90": float(np.percentile(arr, 90)),
            "mean": float(arr.mean())}


def _errors(results: list[_Result]) -> list[str]:
    return sorted({r.error for r in results if r.error})[:5]


# ---- 1. isolation ----------------------------------------------------------------------
async def _quiet_requests(client: httpx.AsyncClient, count: int, first: int) -> list[_Result]:
    """`count` streaming requests to "quiet", one after another."""
    results = []
    for i in range(first, first + count):
        result = _Result()
        await _stream(client, {"model": "quiet", "prompt": f"Question {i}: the weather today is",
                               "max_tokens": QUIET_MAX_TOKENS, "ignore_eos": True,
                               "temperature": 0.0}, result)
        results.append(result)
    return results


def _engine_ttfts(served) -> list[float]:
    """Times to first token the engine measured (arrival in the engine to its first token,
    so without HTTP, tokenization and delivery) for the finished requests so far."""
    return list(served.llm.engine.metrics.snapshot()["observations"].get(
        "time_to_first_token", ()))


def _flood_tokens_per_second(load: _Load, since: float, until: float) -> dict:
    """Output tokens the busy model streamed in [since, until], per second: each request's
    tokens spread over its chunks by their text (finished requests: their own usage; the
    cancelled ones: the tokens per character of the finished ones)."""
    done = [r for r in load.results if r.ok and r.chars]
    per_char = sum(r.tokens for r in done) / max(1, sum(r.chars for r in done))
    tokens = 0.0
    for r in load.results:
        if not (r.ok or r.cancelled) or not r.chars:
            continue
        ratio = r.tokens / r.chars if r.ok else per_char
        tokens += ratio * sum(n for t, n in r.chunks if since <= t <= until)
    seconds = max(until - since, 1e-9)
    return {"output_tokens": round(tokens), "seconds": seconds,
            "output_tokens_per_s": tokens / seconds}


def _flood_body(index: int, max_tokens: int) -> dict:
    return {"model": "busy", "prompt": f"Story {index}: once upon a time, in a land",
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.8, "seed": index}


FLOOD_LINE = "jaxserve-bench-flood: "  # how the flood process's messages start


def flood_main() -> None:
    """The flood's own process (`python -c`, arguments: url, concurrency, max_tokens,
    "stream" or "complete"): once every worker has had a request stream (or answered),
    writes how many are in flight; then reads the measurement's "since until" and writes
    the flood's result (JSON lines on stdout)."""
    url, concurrency, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    asyncio.run(_flood(url, concurrency, max_tokens, sys.argv[4] == "stream"))


def _tell(message) -> None:
    print(FLOOD_LINE + json.dumps(message), flush=True)


async def _flood(url: str, concurrency: int, max_tokens: int, stream: bool) -> None:
    async with _client(url, concurrency) as client:
        load = _Load(client, concurrency, lambda index: _flood_body(index, max_tokens),
                     send=_stream if stream else _complete)
        await load.wait_all_served()
        _tell(load.running)
        since, until = map(float, (await asyncio.to_thread(sys.stdin.readline)).split())
        running = load.running
        # cancel the unfinished requests, unless none finished to count tokens by
        await load.stop(cancel=bool(load.completed))
    _tell({"throughput": {**_flood_tokens_per_second(load, since, until),
                          "completed": len(load.completed),
                          "cancelled": sum(r.cancelled for r in load.results)},
           "streaming_at_end": running, "failed": len(load.failed),
           "errors": _errors(load.failed)})


class _FloodProcess:
    """`concurrency` streaming requests to "busy", each replaced as it finishes, from a
    process of their own (`flood_main`). Times cross as `time.perf_counter()` values: the
    system's monotonic clock, the same in both processes."""

    def __init__(self, process: asyncio.subprocess.Process):
        self._process = process

    @classmethod
    async def start(cls, url: str, concurrency: int, max_tokens: int,
                    stream: bool) -> _FloodProcess:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-c", "from jaxserve.bench.models_bench import flood_main; "
            "flood_main()", url, str(concurrency), str(max_tokens),
            "stream" if stream else "complete",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        return cls(process)

    async def _hear(self):
        while line := (await self._process.stdout.readline()).decode():
            if line.startswith(FLOOD_LINE):
                return json.loads(line[len(FLOOD_LINE):])
        raise RuntimeError(f"the flood process ended (exit status "
                           f"{await self._process.wait()})")

    async def established(self) -> int:
        """Wait until the flood is established; returns the requests streaming then."""
        return await self._hear()

    async def finish(self, since: float, until: float) -> dict:
        """Stop the flood; its throughput over [since, until] with its request counts, the
        requests streaming when it stopped, and its failures."""
        self._process.stdin.write(f"{since!r} {until!r}\n".encode())
        await self._process.stdin.drain()
        result = await self._hear()
        await self._process.wait()
        return result

    def close(self) -> None:
        if self._process.returncode is None:
            self._process.kill()


async def _isolation(server: _Server, requests: int, flood_concurrency: int,
                     flood_max_tokens: int, flood_stream: bool,
                     say: Callable[[str], None]) -> dict:
    busy = server.state.fleet.table.pinned["busy@1"]
    quiet = server.state.fleet.table.pinned["quiet@1"]
    devices = {"busy@1": list(busy.device_ids), "quiet@1": list(quiet.device_ids)}
    async with _client(server.url, flood_concurrency) as client:
        # first requests outside the timing (both engines)
        await _quiet_requests(client, 2, 10_000)
        await _stream(client, {"model": "busy", "prompt": "Warm-up: once upon a time",
                               "max_tokens": 16, "ignore_eos": True}, _Result())

        say(f"  quiet alone: {requests} sequential requests...")
        before = len(_engine_ttfts(quiet))
        alone = await _quiet_requests(client, requests, 0)
        engine_alone = _engine_ttfts(quiet)[before:]

        kind = "streaming" if flood_stream else "non-streamed"
        say(f"  flooding busy from another process: {flood_concurrency} {kind} requests "
            f"in flight (max_tokens {flood_max_tokens}, ignore_eos)...")
        flood = await _FloodProcess.start(server.url, flood_concurrency, flood_max_tokens,
                                          flood_stream)
        try:
            running = await flood.established()
            say(f"  quiet under flood: {requests} sequential requests "
                f"({running} busy requests {'streaming' if flood_stream else 'in flight'})...")
            since = time.perf_counter()
            before = len(_engine_ttfts(quiet))
            flooded = await _quiet_requests(client, requests, requests)
            until = time.perf_counter()
            engine_flooded = _engine_ttfts(quiet)[before:]
            result = await flood.finish(since, until)
        finally:
            flood.close()

    failed = [r for r in alone + flooded if not r.ok]
    wrong = [r.version for r in alone + flooded if r.ok and r.version != "quiet@1"]
    ttft_alone = _stats([r.ttft for r in alone if r.ok])
    ttft_flooded = _stats([r.ttft for r in flooded if r.ok])
    ratio = {k: (ttft_flooded[k] / ttft_alone[k] if ttft_alone[k] and ttft_flooded[k]
                 else None) for k in ("p50", "p90")}
    return {
        "devices": devices,
        "requests": requests,
        "quiet_max_tokens": QUIET_MAX_TOKENS,
        "flood_concurrency": flood_concurrency,
        "flood_max_tokens": flood_max_tokens,
        "flood_stream": flood_stream,
        "quiet_ttft_alone_s": ttft_alone,
        "quiet_ttft_flooded_s": ttft_flooded,
        "ttft_ratio": ratio,
        "quiet_engine_ttft_alone_s": _stats(engine_alone),
        "quiet_engine_ttft_flooded_s": _stats(engine_flooded),
        "target_ratio": TTFT_TARGET_RATIO,
        "meets_target": ratio["p50"] is not None and ratio["p50"] <= TTFT_TARGET_RATIO,
        "busy_streaming_at_start": running,
        "busy_streaming_at_end": result["streaming_at_end"],
        "busy_throughput": result["throughput"],
        "quiet_answered_by_other_version": len(wrong),
        "failed": len(failed) + result["failed"],
        "errors": _errors(failed) + result["errors"],
    }


def format_isolation(r: dict) -> str:
    def ms(value):
        return f"{value * 1000:>9.1f}" if value is not None else f"{'-':>9}"

    def times(value):
        return f"{value:.2f}x" if value is not None else "-"

    a, f, ratio = r["quiet_ttft_alone_s"], r["quiet_ttft_flooded_s"], r["ttft_ratio"]
    ea, ef = r["quiet_engine_ttft_alone_s"], r["quiet_engine_ttft_flooded_s"]
    flood = f"busy flooded ({r['flood_concurrency']} " \
            f"{'streaming' if r['flood_stream'] else 'not streamed'}, max_tokens " \
            f"{r['flood_max_tokens']})"
    thr = r["busy_throughput"]
    lines = [
        f"devices: busy@1 {r['devices']['busy@1']}, quiet@1 {r['devices']['quiet@1']}",
        (f"quiet TTFT, {r['requests']} sequential requests (max_tokens "
         f"{r['quiet_max_tokens']}):"),
        f"  {'':<46}{'p50 (ms)':>9} {'p90 (ms)':>9}",
        f"  {'alone (busy idle)':<46}{ms(a['p50'])} {ms(a['p90'])}",
        f"  {flood:<46}{ms(f['p50'])} {ms(f['p90'])}",
        f"  {'ratio flooded / alone':<46}{times(ratio['p50']):>9} {times(ratio['p90']):>9}",
        "  as the engine measured it (arrival in the engine to first token):",
        f"  {'  alone':<46}{ms(ea['p50'])} {ms(ea['p90'])}",
        f"  {'  busy flooded':<46}{ms(ef['p50'])} {ms(ef['p90'])}",
        f"target, p50 under flood within {r['target_ratio']:.0f}x of alone: "
        + ("met" if r["meets_target"] else "NOT met"),
        (f"busy throughput during the flood: {thr['output_tokens_per_s']:.1f} output "
         f"tokens/s ({thr['output_tokens']} tokens in {thr['seconds']:.1f} s; "
         f"{thr['completed']} requests completed, {thr['cancelled']} cancelled at the end)"),
        f"failed requests: {r['failed']}" + (f"  {r['errors']}" if r["errors"] else ""),
    ]
    if r["quiet_answered_by_other_version"]:
        lines.append(f"quiet requests answered by another version: "
                     f"{r['quiet_answered_by_other_version']}")
    return "\n".join(lines)


# ---- 2. reloads ------------------------------------------------------------------------
RELOAD_MAX_TOKENS = 64


def _models(model: str, quiet_versions: list[dict], options: dict) -> list[dict]:
    """The models file: "busy" version 1, and "quiet" in the versions given (every entry
    with the engine `options`, none by default)."""
    return [{"name": "busy", "path": model, **options}] + [
        {"name": "quiet", "path": model, **version, **options} for version in quiet_versions]


RELOADS = [  # (what changes, quiet's versions after it)
    ("add quiet@2 (weight 50)", [{"version": "1"}, {"version": "2", "weight": 50}]),
    ("set quiet@1's weight to 0",
     [{"version": "1", "weight": 0}, {"version": "2", "weight": 50}]),
    ("remove quiet@1", [{"version": "2", "weight": 50}]),
]


async def _reloads(server: _Server, models_file: Path, model: str, options: dict,
                   concurrency: int, say: Callable[[str], None]) -> dict:
    state = server.state

    def body(i: int) -> dict:
        return {"model": "quiet", "prompt": f"Request {i}: it was a fine morning when",
                "max_tokens": RELOAD_MAX_TOKENS, "ignore_eos": True, "temperature": 0.8,
                "seed": i}

    reloads = []
    async with _client(server.url, concurrency) as client:
        load = _Load(client, concurrency, body)
        await load.wait_all_served()
        for number, (change, versions) in enumerate(RELOADS, 1):
            if number > 1:  # let requests flow under the new split first (fewer before
                # the removal, so that the removed version still has requests in flight)
                wanted = len(load.results) + (concurrency if number == 2
                                              else max(1, concurrency // 4))
                while len(load.results) < wanted:
                    await asyncio.sleep(0.05)
            _write_models(models_file, _models(model, versions, options))
            in_flight = len(load.in_flight)
            say(f"  reload {number}: {change} ({in_flight} requests in flight)...")
            sent = time.perf_counter()
            response = await client.post("/admin/reload", timeout=REQUEST_TIMEOUT, headers={
                "Authorization": f"Bearer {server.admin_key}"})
            answered = time.perf_counter()
            reply = response.json()
            if response.status_code != 200:
                raise RuntimeError(f"reload {number} answered HTTP {response.status_code}: "
                                   f"{reply}")
            reloads.append({"reload": number, "change": change, "answered_s": answered - sent,
                            "answered_at": answered, "in_flight": in_flight,
                            "models": reply["models"], "timeline": reply["timeline"]})
        # the removed version drains and is freed on a background thread
        await asyncio.to_thread(state.fleet.wait_drained, REQUEST_TIMEOUT)
        freed_wall = time.perf_counter() - reloads[-1]["answered_at"]
        reloads[-1]["timeline"] = list(state.fleet.timeline.events)  # now with "freed"
        listed = [card["id"] for card in (await client.get("/v1/models")).json()["data"]]
        await load.stop(cancel=False)  # every request runs to its end: none may fail

    # which version answered, by when the request was sent (before each reload answered)
    bounds = [r["answered_at"] for r in reloads]
    labels = ["before reload 1"] + [f"after reload {r['reload']}" for r in reloads]
    by_phase: dict[str, dict[str, int]] = {label: {} for label in labels}
    for result in load.results:
        counts = by_phase[labels[int(np.searchsorted(bounds, result.start))]]
        counts[result.version or "none"] = counts.get(result.version or "none", 0) + 1
    last = reloads[-1]["timeline"]
    drain = next((e for e in last if e["phase"] == "drain"), None)
    freed = next((e for e in last if e["phase"] == "freed"), None)
    for r in reloads:
        del r["answered_at"]
    return {
        "concurrency": concurrency,
        "max_tokens": RELOAD_MAX_TOKENS,
        "reloads": reloads,
        "requests": len(load.results),
        "completed": len(load.completed),
        "failed": len(load.failed),
        "errors": _errors(load.failed),
        "answered_by": by_phase,
        "removed": "quiet@1",
        "removed_in_flight": drain.get("in_flight") if drain else None,
        "freed_t_s": freed["t"] if freed else None,  # since reload 3 began
        "freed_after_drain_s": round(freed["t"] - drain["t"], 3) if freed and drain else None,
        "freed_after_answer_s": freed_wall,  # wall clock, reload 3's answer to freed
        "models_listed": listed,
    }


def _event_details(event: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in event.items() if k not in ("t", "phase", "model"))


def format_reloads(r: dict) -> str:
    lines = [(f"{r['concurrency']} streaming requests to \"quiet\" in flight throughout "
              f"(max_tokens {r['max_tokens']}, ignore_eos)")]
    for reload in r["reloads"]:
        lines.append(f"reload {reload['reload']}: {reload['change']} "
                     f"({reload['in_flight']} requests in flight): answered in "
                     f"{reload['answered_s']:.2f} s; serving {', '.join(reload['models'])}")
        lines.append(f"  {'t (s)':>8}  {'phase':<8}{'model':<28}details")
        for event in reload["timeline"]:
            lines.append(f"  {event['t']:>8.3f}  {event['phase']:<8}{event['model']:<28}"
                         f"{_event_details(event)}".rstrip())
    lines.append("requests answered, by version (grouped by when they were sent):")
    for phase, counts in r["answered_by"].items():
        shown = ", ".join(f"{v} {n}" for v, n in sorted(counts.items())) or "none"
        lines.append(f"  {phase:<18}{shown}")
    lines.append(f"requests: {r['requests']}, completed {r['completed']}, "
                 f"failed {r['failed']}" + (f"  {r['errors']}" if r["errors"] else ""))
    if r["freed_t_s"] is not None:
        lines.append(f"{r['removed']} freed {r['freed_after_drain_s']:.2f} s after its drain "
                     f"began with {r['removed_in_flight']} requests in flight (t="
                     f"{r['freed_t_s']:.3f} s in reload 3; {r['freed_after_answer_s']:.2f} s "
                     f"after reload 3 answered)")
    else:
        lines.append(f"{r['removed']} was not freed")
    lines.append(f"/v1/models now lists: {', '.join(r['models_listed'])}")
    return "\n".join(lines)


# ---- both ------------------------------------------------------------------------------
def run_benchmark(model: str | None = None, requests: int = 20, flood_concurrency: int = 64,
                  flood_max_tokens: int = 128, reload_concurrency: int = 32,
                  say: Callable[[str], None] = print, flood_stream: bool = True,
                  engine_options: dict | None = None) -> dict:
    """Both measurements on one server; the returned dict is what `--json` writes.
    `engine_options`: for every entry of the models file (none by default, as a user runs
    it; tests give smaller bucket ladders so that warm-up is short)."""
    options = dict(engine_options or {})
    from jaxserve.default_model import DEFAULT_MODEL_DIR

    model = str(Path(model or DEFAULT_MODEL_DIR).resolve())
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="jaxserve-bench-models-") as folder:
        models_file = Path(folder) / "models.toml"
        _write_models(models_file, _models(model, [{"version": "1"}], options))
        say(f"models file: {model} as \"busy\" and \"quiet\"; loading and warming up "
            "both (default engine options)...")
        with _serving(models_file) as server:
            ready = server.start()
            say(f"  ready in {ready:.1f} s")
            say("isolation: quiet's time to first token, alone and while busy is flooded")
            isolation = asyncio.run(_isolation(server, requests, flood_concurrency,
                                               flood_max_tokens, flood_stream, say))
            say(f"reloads: {reload_concurrency} streaming requests to \"quiet\" in flight "
                "while the models file changes")
            reload = asyncio.run(_reloads(server, models_file, model, options,
                                          reload_concurrency, say))
    return {"model": model, "engine_options": options, "ready_s": ready,
            "isolation": isolation, "reload": reload,
            "failed": isolation["failed"] + reload["failed"],
            "duration_s": time.perf_counter() - started}


def run_from_args(args: argparse.Namespace) -> int:
    def say(line: str) -> None:
        print(line, flush=True)

    summary = run_benchmark(args.model, args.requests, args.flood_concurrency,
                            args.flood_max_tokens, args.reload_concurrency, say,
                            flood_stream=args.flood_stream)
    print()
    print("== isolation: quiet model's time to first token while another model is flooded")
    print(format_isolation(summary["isolation"]))
    print()
    print("== reload timeline (POST /admin/reload while requests stream)")
    print(format_reloads(summary["reload"]))
    print()
    print(f"total {summary['duration_s']:.1f} s (loading {summary['ready_s']:.1f} s); "
          f"failed requests: {summary['failed']}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(summary, out, indent=2)
    return 0 if summary["failed"] == 0 else 1
