"""jaxserve replicas behind vLLM's router (`vllm-router`) on one machine: the commands of
deploy/router/README.md, as a launcher and as the functions its test
(tests/deploy/test_router_recipe.py) starts the same processes with.

    pip install vllm-router==0.1.17
    python deploy/router/replicas.py --replicas 3 --port 8000 [-- jaxserve serve flags]

starts replica 1 on port 8001 and waits until it is ready (the first start compiles the
programs into the executable cache), then replicas 2..N on 8002.. (they load the compiled
programs from the cache in seconds), then the router on 8000. Ctrl-C stops them all.
Replicas and router bind 127.0.0.1 unless `--host` says otherwise.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROUTER_VERSION = "0.1.17"  # the vllm-router release these flags were checked against
# Small engine settings: little to compile and little memory per replica.
ENGINE_ARGS = ("--max-num-seqs", "8", "--max-num-batched-tokens", "256",
               "--max-model-len", "512")
# The router's failure handling, tuned for replicas that can die (README: "Flags").
ROUTER_FLAGS = (
    # 2 failed attempts open a replica's breaker: a request's own retries then go to another
    # replica (with the default 10, cache_aware retries all 5 attempts of a prompt whose
    # prefix the dead replica owns on that replica, and the client gets a 500).
    "--cb-failure-threshold", "2",
    "--retry-max-retries", "6",  # attempts in all; more than the breaker's threshold
    "--cb-timeout-duration-secs", "5",  # an open breaker lets a probe through after 5 s
    # a dead replica is out of the rotation within ~4 s, a restarted one back at its first
    # 200 from /health (defaults: every 60 s, 3 failures, 2 successes)
    "--health-check-interval-secs", "2",
    "--health-failure-threshold", "2",
    "--health-success-threshold", "1",
    # cache_aware sends every prompt whose beginning it has seen to the same replica until
    # that replica has 64 more requests in flight than the least busy one (the default):
    # prompts from one template then all land on one replica. 8 (a replica's batch,
    # --max-num-seqs) spreads them once a replica's queue grows.
    "--balance-abs-threshold", "8",
)


def replica_command(port: int, host: str = "127.0.0.1",
                    engine_args: tuple[str, ...] = ENGINE_ARGS) -> list[str]:
    """`jaxserve serve` for one replica of the shipped model (add `--model DIR` for another)."""
    return ["jaxserve", "serve", "--host", host, "--port", str(port), *engine_args]


def router_command(port: int, workers: list[str], policy: str = "cache_aware",
                   prometheus_port: int = 29000, host: str = "127.0.0.1",
                   flags: tuple[str, ...] = ROUTER_FLAGS) -> list[str]:
    """`vllm-router` in front of `workers` (base URLs). Its own metrics go to
    `prometheus_port` (it binds 29000 unless told otherwise)."""
    return ["vllm-router", "--host", host, "--port", str(port),
            "--prometheus-host", host, "--prometheus-port", str(prometheus_port),
            "--policy", policy, *flags, "--worker-urls", *workers]


def start(command: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`command` in its own process group (so that `stop` ends its children too), its
    output appended to `log`."""
    with open(log, "ab") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def stop(process: subprocess.Popen, sig: int = signal.SIGTERM, grace: float = 30.0) -> None:
    """Send `sig` to the process group of `process`; SIGKILL it if still there after
    `grace` seconds."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, sig)
        process.wait(timeout=grace)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def wait_healthy(url: str, timeout: float, process: subprocess.Popen | None = None) -> float:
    """Poll `url`/health until it answers 200; the seconds that took. Raises if `process`
    exits first or `timeout` passes."""
    start_time = time.monotonic()
    while time.monotonic() - start_time < timeout:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.monotonic() - start_time
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy after {timeout:.0f} s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--port", type=int, default=8000, help="the router's port; "
                        "replicas take the next ones")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--policy", default="cache_aware")
    parser.add_argument("--prometheus-port", type=int, default=29000)
    parser.add_argument("--logs", type=Path, default=Path("."), help="folder for the logs")
    parser.add_argument("engine_args", nargs="*", help="after --: `jaxserve serve` flags "
                        f"(default: {' '.join(ENGINE_ARGS)})")
    args = parser.parse_args(argv)
    engine_args = tuple(args.engine_args) or ENGINE_ARGS
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stop the replicas on SIGTERM too
    processes = []
    try:
        urls = []
        for i in range(args.replicas):
            port = args.port + 1 + i
            processes.append(start(replica_command(port, args.host, engine_args),
                                   args.logs / f"replica-{port}.log"))
            urls.append(f"http://{args.host}:{port}")
            if i == 0:  # the first start fills the executable cache; the others read it
                seconds = wait_healthy(urls[0], 1800, processes[0])
                print(f"{urls[0]} ready after {seconds:.1f} s", flush=True)
        for url, process in zip(urls[1:], processes[1:]):
            seconds = wait_healthy(url, 600, process)
            print(f"{url} ready (waited {seconds:.1f} s more)", flush=True)
        router = start(router_command(args.port, urls, args.policy, args.prometheus_port,
                                      args.host), args.logs / "router.log")
        processes.append(router)
        print(f"router on http://{args.host}:{args.port} ({args.policy})", flush=True)
        router.wait()
    except KeyboardInterrupt:
        pass
    finally:
        for process in reversed(processes):
            stop(process)


if __name__ == "__main__":
    sys.exit(main())
