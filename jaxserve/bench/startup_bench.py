"""`jaxserve bench startup`: how long a server takes to come up, cold and warm, the way a
user (or an autoscaler adding a replica) starts it.

Each start runs `jaxserve serve` in a new process on 127.0.0.1 with one cache folder
(`--cache-dir`, default a new empty one, so the first start is cold) and measures, from the
moment the process is launched:
- `healthy`: the first `GET /health` that answers 200 (polled every 50 ms);
- `first answer`: a completion of 8 tokens returned after that;
- `all ready`: the first `/health` whose body says every model "ready" (with
  `--compile-in-background`, the default, a server answers while its larger buckets'
  programs still compile: "warming");
- the server's own phases from `/metrics` (`jaxserve:startup_seconds{phase}`: load, compile,
  warmup) and how many of its programs it read from the executable cache.
Then `jaxserve generate` (8 tokens) runs once against the same, now warm, cache: its wall time
from launch to exit. Printed as a table, one row per start. The baseline runs next (unless
`--no-baseline`): the same starts with `--no-executable-cache`, on a cache of their own, so
programs are traced every start and compiled through JAX's persistent cache.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

_PHASE = re.compile(r'^jaxserve:startup_seconds\{[^}]*phase="(\w+)"[^}]*\} (\S+)$', re.M)
_FROM_CACHE = re.compile(r"^jaxserve:programs_from_executable_cache\{[^}]*\} (\S+)$", re.M)
_PROGRAMS = re.compile(r"^jaxserve:compiled_programs\{[^}]*\} (\S+)$", re.M)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="HF model folder (default: the shipped model)")
    parser.add_argument("--config", default=None, help="deployment preset for the server")
    parser.add_argument("--starts", type=int, default=2,
                        help="server starts, one after another on the same cache (default 2)")
    parser.add_argument("--cache-dir", default=None,
                        help="jaxserve's cache folder (default: a new empty one: the first "
                             "start compiles everything)")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the baseline (the same starts with --no-executable-cache, "
                             "on their own new cache)")
    parser.add_argument("--server-flags", default="",
                        help="more `jaxserve serve` flags for every start, in one string "
                             "(e.g. \"--no-compile-in-background\" for the old start-up)")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds a start may take before the bench gives up")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, ""
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, ""


def _complete(base: str) -> None:
    body = json.dumps({"prompt": "It is a truth", "max_tokens": 8, "temperature": 0})
    request = urllib.request.Request(f"{base}/v1/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        json.load(answer)


def _all_ready(health: str) -> bool:
    """Whether a `/health` body says every model is "ready" (not "warming")."""
    try:
        models = json.loads(health)["models"]
    except (ValueError, KeyError, TypeError):
        return False
    return bool(models) and all(state == "ready" for state in models.values())


def _model_args(args: argparse.Namespace) -> list[str]:
    return ((["--model", args.model] if args.model else [])
            + (["--config", args.config] if args.config else []))


def one_start(args: argparse.Namespace, env: dict[str, str], extra: list[str]) -> dict:
    """Launch a server, wait for health, ask one completion, read its phases, stop it."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "jaxserve.cli", "serve", "--host", "127.0.0.1",
               "--port", str(port), *_model_args(args), *extra, *args.server_flags.split()]
    # the server's log goes to a file: a pipe nobody reads fills up and stalls the server
    log = tempfile.TemporaryFile("w+")
    launched = time.perf_counter()
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=log,
                              text=True)

    def log_end() -> str:
        log.seek(0)
        return log.read()[-2000:]

    try:
        while _get(f"{base}/health", timeout=1.0)[0] != 200:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited ({server.returncode}): {log_end()}")
            if time.perf_counter() - launched > args.timeout:
                raise RuntimeError(f"the server was not healthy within {args.timeout} s; "
                                   f"its log ends: {log_end()}")
            time.sleep(0.05)
        healthy = time.perf_counter() - launched
        _complete(base)
        answered = time.perf_counter() - launched
        while not _all_ready(_get(f"{base}/health", timeout=5.0)[1]):
            if time.perf_counter() - launched > args.timeout:
                raise RuntimeError(f"the server's programs were not all ready within "
                                   f"{args.timeout} s; its log ends: {log_end()}")
            time.sleep(0.05)
        all_ready = time.perf_counter() - launched
        metrics = _get(f"{base}/metrics")[1]
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    phases = {name: float(value) for name, value in _PHASE.findall(metrics)}
    from_cache, programs = _FROM_CACHE.search(metrics), _PROGRAMS.search(metrics)
    return {"healthy_s": healthy, "first_answer_s": answered, "all_ready_s": all_ready,
            "phases": phases,
            "programs_from_cache": int(float(from_cache.group(1))) if from_cache else -1,
            "programs": int(float(programs.group(1))) if programs else -1}


def time_generate(args: argparse.Namespace, env: dict[str, str], extra: list[str]) -> float:
    """Wall seconds of `jaxserve generate` (8 tokens), launch to exit; a failed run raises
    with the end of its stderr (with the Python stacks of a crash)."""
    launched = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "jaxserve.cli", "generate", "It is a truth",
                           "--max-tokens", "8", *_model_args(args), *extra], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          timeout=args.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"jaxserve generate exited with {done.returncode}:\n"
                           f"{done.stderr[-4000:]}")
    return time.perf_counter() - launched


def run_mode(args: argparse.Namespace, cache: Path, extra: list[str]) -> None:
    """`args.starts` server starts, then one `generate`, on `cache`, with `extra` flags."""
    env = {**os.environ, "JAXSERVE_CACHE_DIR": str(cache)}
    print(f"{'start':>5} {'healthy s':>10} {'1st answer s':>13} {'all ready s':>12} "
          f"{'load s':>7} {'compile s':>10} {'warmup s':>9} {'programs from cache':>20}",
          flush=True)
    for index in range(args.starts):
        result = one_start(args, env, extra)
        phases = result["phases"]
        print(f"{index + 1:>5} {result['healthy_s']:>10.2f} {result['first_answer_s']:>13.2f} "
              f"{result['all_ready_s']:>12.2f} {phases.get('load', float('nan')):>7.2f} "
              f"{phases.get('compile', float('nan')):>10.2f} "
              f"{phases.get('warmup', float('nan')):>9.2f} "
              f"{result['programs_from_cache']:>13} of {result['programs']:<3}", flush=True)
    generate_s = time_generate(args, env, extra)
    print(f"jaxserve generate (8 tokens) with the warm cache: {generate_s:.2f} s launch to exit",
          flush=True)


def run_from_args(args: argparse.Namespace) -> int:
    modes = [("with the executable cache (the default)", [])]
    if not args.no_baseline:
        modes.append(("baseline: --no-executable-cache (JAX's compilation cache only)",
                      ["--no-executable-cache"]))
    for title, extra in modes:
        print(f"== {title}", flush=True)
        with tempfile.TemporaryDirectory(prefix="jaxserve-startup-") as scratch:
            run_mode(args, Path(args.cache_dir) if args.cache_dir else Path(scratch), extra)
    return 0
