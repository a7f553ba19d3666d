"""`jaxserve serve` as a real process: the README's command on the shipped model, and
SIGTERM draining in-flight requests before exit."""

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from server_helpers import ONE_RUNG_PRESET, free_port, wait_until
from tiny_models import build_model

ROOT = Path(__file__).resolve().parents[2]


def start_server(*args, wait_healthy: bool = True) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "jaxserve.cli", "serve", "--port", str(port), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"

    def healthy():
        if process.poll() is not None:
            raise AssertionError(f"server exited early:\n{process.stdout.read()}")
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    if wait_healthy:
        wait_until(healthy, 600, "server never became healthy", interval=0.5)
    return process, url


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
    process.wait(timeout=30)


def readme_serve_command() -> list[str]:
    """The serve command from the README's first lines (after 'pip install ... &&')."""
    for line in (ROOT / "README.md").read_text().splitlines()[:10]:
        if "jaxserve serve" in line:
            return line.split("jaxserve serve", 1)[1].split()
    raise AssertionError("the README's first lines have no 'jaxserve serve' command")


def ready_line(process: subprocess.Popen, timeout: float = 30) -> str:
    """The log's ready line (logged as the server turns healthy), read on a thread so that a
    log without one fails the test instead of blocking it."""
    found: list[str] = []

    def read():
        for line in process.stdout:
            if " ready: serving " in line:
                found.append(line)
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    assert found, "the server's log has no ready line"
    return found[0]


def test_readme_command_serves_the_default_model_with_real_words():
    """The README's command serves austen-3.4m; its ready line names the URL, the model and
    a curl command that, sent as printed, answers."""
    process, url = start_server(*readme_serve_command())
    try:
        line = ready_line(process)
        assert f"ready: serving austen-3.4m at {url} — try: curl " in line
        curl = shlex.split(line.partition(" try: ")[2])
        assert curl[:2] == ["curl", f"{url}/v1/completions"] and curl[-2] == "-d"
        response = httpx.post(curl[1], timeout=120, json={
            **json.loads(curl[-1]), "temperature": 0})
        assert response.status_code == 200, response.text
        assert response.json()["model"] == "austen-3.4m"
        text = response.json()["choices"][0]["text"]
        words = [w.strip(".,;:!?\"'") for w in text.split()]
        assert sum(w.isalpha() for w in words) >= 3, text
        assert f"the text `{text}`" in " ".join((ROOT / "README.md").read_text().split())
    finally:
        stop(process)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigterm_drains_in_flight_requests_then_exits(tmp_path):
    build_model("llama", tmp_path / "model")
    (tmp_path / "preset.toml").write_text(ONE_RUNG_PRESET)
    process, url = start_server("--model", str(tmp_path / "model"), "--config",
                                str(tmp_path / "preset.toml"))
    try:
        received, first_chunk = [], threading.Event()

        def stream():
            body = {"prompt": [0, 5, 6], "max_tokens": 200, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        received.append(line[6:])
                        first_chunk.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first_chunk.wait(60)
        process.send_signal(signal.SIGTERM)
        reader.join(timeout=120)
        assert received[-1] == "[DONE]"
        finals = [json.loads(r)["choices"][0]["finish_reason"] for r in received[:-1]]
        assert finals[-1] == "length"  # the in-flight request ran to its end
        # uvicorn re-raises the signal after its graceful shutdown, so the exit status is the
        # conventional "terminated by SIGTERM"; what matters is a clean shutdown log.
        assert process.wait(timeout=60) in (0, -signal.SIGTERM)
        log = process.stdout.read()
        assert "Finished server process" in log and "Traceback" not in log
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/health", timeout=2)
    finally:
        stop(process)


@pytest.mark.parametrize("args, message", [
    (["--model", "/does/not/exist"], "is not a folder"),
    (["--page-size", "7"], "--page-size: invalid choice: 7 (choose from 16, 32, 64, 128)"),
    (["--max-num-seqs", "600"], "max_num_batched_tokens (512) must be >= max_num_seqs (600)"),
    (["--tensor-parallel-size", "64"], "tensor_parallel_size (64)"),
    (["--max-tools", "0"], "max_tools must be a positive integer, got 0"),
    (["--tokenizer", "/does/not/exist"], "model '/does/not/exist' is not a folder"),
    (["--ssl-keyfile", "key.pem"], "HTTPS needs both --ssl-keyfile and --ssl-certfile"),
], ids=["missing-model", "page-size", "conflict", "mesh", "request-cap", "tokenizer", "tls"])
def test_options_that_cannot_work_exit_2_before_serving(args, message):
    """Checked before the socket opens: a non-zero exit within seconds, the reason on
    stderr, not a server that answers 503 forever."""
    process = subprocess.run([sys.executable, "-m", "jaxserve.cli", "serve", "--port",
                              str(free_port()), *args], capture_output=True, text=True,
                             timeout=120)
    assert process.returncode == 2
    assert message in process.stderr and "Uvicorn running" not in process.stderr


def test_a_port_in_use_exits_2_before_loading():
    """The socket is bound first: a port another process listens on is exit 2 in seconds,
    naming the port, before the model loads."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process = subprocess.run([sys.executable, "-m", "jaxserve.cli", "serve", "--port",
                                  str(port)], capture_output=True, text=True, timeout=60)
    assert process.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in process.stderr
    assert "Loading" not in process.stderr and "Compiling" not in process.stderr


def test_a_model_that_fails_to_load_exits_non_zero(tmp_path):
    """Past the checks (its config.json is fine) but its weights are not: the server exits 1
    with the reason instead of staying up unhealthy."""
    build_model("llama", tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    process, _ = start_server("--model", str(tmp_path), "--dtype", "float32",
                              wait_healthy=False)
    try:
        assert process.wait(timeout=120) == 1
        log = process.stdout.read()
        assert "jaxserve: error: model failed to load" in log
    finally:
        stop(process)


def shipped_entry(version: str, preset: Path) -> str:
    from jaxserve.default_model import DEFAULT_MODEL_DIR

    return (f'[[models]]\nname = "shipped"\nversion = "{version}"\n'
            f'path = "{DEFAULT_MODEL_DIR}"\nconfig = "{preset}"\n')


@pytest.mark.parametrize("extra, entries, message", [
    ([], '[[models]]\nname = "a"\npath = "{missing}"\n', "a@1: model '"),
    ([], '[[models]]\nname = "a"\npath = "{missing}"\nfallback = "b"\n',
     "fallback 'b' is not a model name"),
    (["--max-num-seqs", "4"], '[[models]]\nname = "a"\npath = "{missing}"\n',
     "drop ['--max-num-seqs']"),
    ([], '[[models]]\nname = "a"\npath = "{shipped}"\n[[models]]\nname = "a"\nversion = "2"\n'
         'base = "a@1"\nlora_path = "{missing}"\n', "a@1: LoRA adapters (a@2) need enable_lora"),
], ids=["missing-folder", "unknown-fallback", "flag-with-file", "adapter-without-lora"])
def test_a_models_file_that_cannot_work_exits_2_before_serving(tmp_path, extra, entries,
                                                               message):
    models = tmp_path / "models.toml"
    from jaxserve.default_model import DEFAULT_MODEL_DIR

    models.write_text(entries.format(missing=tmp_path / "missing", shipped=DEFAULT_MODEL_DIR))
    process = subprocess.run([sys.executable, "-m", "jaxserve.cli", "serve", "--port",
                              str(free_port()), "--models", str(models), *extra],
                             capture_output=True, text=True, timeout=120)
    assert process.returncode == 2, process.stderr
    assert message in process.stderr and "Uvicorn running" not in process.stderr


@pytest.mark.slow  # two loads of the shipped model in a fresh process
def test_sighup_reloads_the_models_file(tmp_path):
    (tmp_path / "preset.toml").write_text(ONE_RUNG_PRESET)
    models = tmp_path / "models.toml"
    models.write_text(shipped_entry("1", tmp_path / "preset.toml"))
    process, url = start_server("--models", str(models))
    try:
        def ids():
            return [card["id"] for card in httpx.get(f"{url}/v1/models").json()["data"]]
        assert ids() == ["shipped", "shipped@1"]
        models.write_text(shipped_entry("2", tmp_path / "preset.toml"))
        process.send_signal(signal.SIGHUP)
        wait_until(lambda: ids() == ["shipped", "shipped@2"], 300, "SIGHUP did not reload",
                   interval=0.5)
        answer = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "shipped", "prompt": "It is", "max_tokens": 2})
        assert answer.status_code == 200 and answer.json()["model"] == "shipped@2"
        models.write_text("[[models]]\n")  # a bad file: logged, the old models serve on
        process.send_signal(signal.SIGHUP)
        wait_until(lambda: process.poll() is None and ids() == ["shipped", "shipped@2"], 10,
                   "a bad reload changed the served models")
    finally:
        stop(process)
