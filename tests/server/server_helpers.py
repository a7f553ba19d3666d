"""Run a real jaxserve HTTP server on 127.0.0.1 inside a test (uvicorn on a thread)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
import uvicorn

from jaxserve.server.app import create_app
from jaxserve.server.state import ServerOptions, ServerState


def cpu_preset(num_pages: int, max_num_seqs: int, max_num_batched_tokens: int,
               token_buckets: list[int], seq_buckets: list[int]) -> str:
    """A CPU preset's TOML for a test server: float32, 256 tokens of context, pages of 16."""
    return f"""
[hardware]
platform = "cpu"
devices = 1
[model]
dtype = "float32"
max_model_len = 256
[kv_cache]
page_size = 16
num_pages = {num_pages}
[batching]
max_num_seqs = {max_num_seqs}
max_num_batched_tokens = {max_num_batched_tokens}
num_decode_steps = 4
token_buckets = {token_buckets}
seq_buckets = {seq_buckets}
"""


# The admin key of test servers that reload or load adapters (`jaxserve.server.auth`).
ADMIN_KEY = "test-admin-key"
AS_ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}

# One rung per ladder: a step program and a decode loop, the fewest a server compiles (for
# tests whose point is not the buckets).
ONE_RUNG_PRESET = cpu_preset(64, 4, 64, [64], [4])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ThreadedServer:
    """uvicorn serving `create_app(state)` on a background thread."""

    def __init__(self, state: ServerState):
        self.state = state
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(create_app(state), host="127.0.0.1", port=self.port,
                                log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self, ready_timeout: float = 300.0) -> "ThreadedServer":
        self.thread.start()
        wait_until(lambda: self.server.started, 30, "server did not start")
        return self

    def wait_ready(self, timeout: float = 300.0) -> None:
        wait_until(lambda: httpx.get(f"{self.url}/health").status_code == 200, timeout,
                   f"model did not become ready: {self.state.not_ready_reason()}")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@contextlib.contextmanager
def serving(options: ServerOptions):
    """A ready `ThreadedServer` of `options` for the block; stopped after it."""
    running = ThreadedServer(ServerState(options)).start()
    try:
        running.wait_ready()
        yield running
    finally:
        running.stop()


def wait_until(condition, timeout: float, message: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(interval)
    raise AssertionError(message)
