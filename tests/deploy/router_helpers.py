"""The processes and the clients of the router recipe's test: jaxserve replicas and
`vllm-router` started with deploy/router/replicas.py's commands on free loopback ports,
requests sent through the router with httpx, counters read from /metrics."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import random
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
MODEL = "austen-3.4m"  # the shipped model's served name (its /v1/models id)
HELDOUT = REPO / "jaxserve" / "default_model" / "heldout.txt"


def load_recipe():
    """deploy/router/replicas.py as a module (deploy/ is no package)."""
    spec = importlib.util.spec_from_file_location(
        "router_replicas", REPO / "deploy" / "router" / "replicas.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


recipe = load_recipe()


def free_port() -> int:
    """A port nothing listens on now (the OS's pick for port 0)."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def replica_env() -> dict[str, str]:
    """The test's environment without the 8 fake host devices tests/conftest.py asks for:
    a replica is one CPU device, as `jaxserve serve` runs for a user (so the executable
    cache entries are the ones a user's replicas with the same flags use)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def log_tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


class Fleet:
    """Replicas of the shipped model, one port each for the fleet's life."""

    def __init__(self, size: int, logs: Path):
        self.ports = [free_port() for _ in range(size)]
        self.logs = logs
        self.processes: list[subprocess.Popen | None] = [None] * size
        self.started_at = [0.0] * size  # time.monotonic() at each replica's latest launch

    def url(self, i: int) -> str:
        return f"http://{HOST}:{self.ports[i]}"

    @property
    def urls(self) -> list[str]:
        return [self.url(i) for i in range(len(self.ports))]

    def log(self, i: int) -> Path:
        return self.logs / f"replica-{i}.log"

    def launch(self, i: int) -> None:
        self.started_at[i] = time.monotonic()
        self.processes[i] = recipe.start(recipe.replica_command(self.ports[i]), self.log(i),
                                         replica_env())

    def wait_healthy(self, i: int, timeout: float) -> float:
        try:
            return recipe.wait_healthy(self.url(i), timeout, self.processes[i])
        except (RuntimeError, TimeoutError) as e:
            raise AssertionError(f"replica {i}: {e}\n{log_tail(self.log(i))}") from e

    def ensure_up(self, first_timeout: float, timeout: float) -> None:
        """Start every replica that is not running: the first alone (a cold executable
        cache compiles there), the others together once it is ready (they read the cache)."""
        down = [i for i, p in enumerate(self.processes) if p is None or p.poll() is not None]
        if not down:
            return
        self.launch(down[0])
        self.wait_healthy(down[0], first_timeout)
        for i in down[1:]:
            self.launch(i)
        for i in down[1:]:
            self.wait_healthy(i, timeout)

    def kill(self, i: int) -> None:
        """SIGKILL replica `i`: no drain, its connections reset."""
        os.killpg(self.processes[i].pid, signal.SIGKILL)
        self.processes[i].wait()

    def stop_all(self) -> None:
        for process in self.processes:
            if process is not None:
                recipe.stop(process)


@dataclass
class Router:
    process: subprocess.Popen
    url: str
    metrics_url: str
    log: Path

    def counter(self, name: str, **labels: str) -> float:
        """Sum of the router's own Prometheus samples `name` whose labels include `labels`."""
        return counter_sum(self.metrics_url, name, **labels)


def start_router(policy: str, workers: list[str], logs: Path,
                 flags: tuple[str, ...] = recipe.ROUTER_FLAGS, timeout: float = 60) -> Router:
    """`vllm-router` with `policy` and `flags` in front of `workers`, once it answers."""
    port, metrics_port = free_port(), free_port()
    log = logs / f"router-{policy}-{port}.log"
    process = recipe.start(
        recipe.router_command(port, workers, policy, metrics_port, flags=flags), log)
    router = Router(process, f"http://{HOST}:{port}", f"http://{HOST}:{metrics_port}", log)
    try:
        recipe.wait_healthy(router.url, timeout, process)
    except (RuntimeError, TimeoutError) as e:
        recipe.stop(process)
        raise AssertionError(f"router: {e}\n{log_tail(log)}") from e
    return router


def counter_sum(base_url: str, name: str, **labels: str) -> float:
    """Sum of the samples called `name` (e.g. `vllm:prefix_cache_hits_total`) on
    `base_url`/metrics whose labels include `labels`."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())


def prefix_cache_counts(urls: list[str]) -> tuple[float, float]:
    """(hits, queries) of the prefix cache, in prompt tokens, summed over the replicas."""
    return (sum(counter_sum(u, "vllm:prefix_cache_hits_total") for u in urls),
            sum(counter_sum(u, "vllm:prefix_cache_queries_total") for u in urls))


def served(url: str) -> float:
    """Requests the replica at `url` finished (any reason)."""
    return counter_sum(url, "vllm:request_success_total")


def load(url: str) -> int:
    """Requests running and waiting on the replica at `url` (its `/get_load`)."""
    return httpx.get(f"{url}/get_load", timeout=10).json()["load"]


@dataclass
class Result:
    status: int | str  # the HTTP status, or the client's exception
    started: float  # time.monotonic()
    finished: float


def completion(prompt: str, max_tokens: int = 16) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}


async def post_all(base_url: str, prompts: list[str], concurrency: int,
                   on_done=None, timeout: float = 180) -> list[Result]:
    """POST each prompt to `base_url`/v1/completions, `concurrency` at a time; no client
    retries. `on_done(n)` is called after the n-th answer."""
    results: list[Result | None] = [None] * len(prompts)
    queue = list(enumerate(prompts))[::-1]
    done = 0
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout) as client:
        async def worker():
            nonlocal done
            while queue:
                i, prompt = queue.pop()
                started = time.monotonic()
                try:
                    status = (await client.post("/v1/completions",
                                                json=completion(prompt))).status_code
                except httpx.HTTPError as e:
                    status = repr(e)
                results[i] = Result(status, started, time.monotonic())
                done += 1
                if on_done is not None:
                    on_done(done)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def system_prompts(seed: int, count: int = 8, words: int = 160) -> list[str]:
    """`count` distinct long prompts (about 1.4 tokens a word: ~220 tokens each) of words
    from the shipped model's held-out text, shuffled by `seed`."""
    vocabulary = HELDOUT.read_text().split()
    rng = random.Random(seed)
    return [" ".join(rng.choice(vocabulary) for _ in range(words)) for _ in range(count)]


def shared_prefix_workload(seed: int, requests: int = 96) -> list[str]:
    """`requests` prompts: the 8 system prompts of `seed` in turn, each followed by a short
    user turn of its own."""
    systems = system_prompts(seed)
    return [f"{systems[i % len(systems)]}\nQuestion {i}: what did she say next?"
            for i in range(requests)]
