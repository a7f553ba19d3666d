"""The executable store: a later process reads every bucket program from disk (no tracing,
no compile) and still generates what transformers generates; unusable entries (corrupted,
truncated, or programs that cannot run their bucket) are warned about and compiled again."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tiny_models import SMALL_ENGINE, build_model

PROMPT = [0, 5, 9, 14, 3, 7, 21, 2, 8]
MAX_TOKENS = 12

# One start of an engine in a fresh process: what it read from the store, and what it made.
START = textwrap.dedent("""
    import json, logging, sys
    logging.basicConfig(level=logging.WARNING)
    from jaxserve import LLM, SamplingParams
    llm = LLM(sys.argv[1], **json.loads(sys.argv[2]))  # progress on stderr
    out = llm.generate({"prompt_token_ids": json.loads(sys.argv[3])},
                       SamplingParams(max_tokens=int(sys.argv[4]), temperature=0,
                                      ignore_eos=True))
    stats = llm.engine.stats()
    print(json.dumps({"programs": stats.compiled_programs,
                      "from_store": stats.programs_from_store,
                      "startup": llm.engine.startup_seconds,
                      "tokens": list(out[0].outputs[0].token_ids)}))
""")


@pytest.fixture(scope="module")
def model_and_expected(tmp_path_factory):
    """A tiny Llama folder and transformers' greedy continuation of PROMPT (the reference)."""
    folder = tmp_path_factory.mktemp("store_llama")
    hf = build_model("llama", folder)
    with torch.no_grad():
        ids = hf.generate(torch.tensor([PROMPT]), max_new_tokens=MAX_TOKENS, do_sample=False,
                          min_new_tokens=MAX_TOKENS)
    return folder, ids[0, len(PROMPT):].tolist()


def start(folder, cache_dir):
    """Run START in a new process with `cache_dir` as jaxserve's cache; (result, stderr)."""
    engine = {**SMALL_ENGINE, "seq_buckets": [2, 8]}  # 4 programs: 2 steps, 2 decode loops
    env = {**os.environ, "JAXSERVE_CACHE_DIR": str(cache_dir), "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = " ".join(  # one device, as a user's process has; the suite's
        flag for flag in os.environ["XLA_FLAGS"].split()  # cheaper compiles (conftest.py)
        if not flag.startswith("--xla_force_host_platform_device_count"))
    done = subprocess.run([sys.executable, "-c", START, str(folder), json.dumps(engine),
                           json.dumps(PROMPT), str(MAX_TOKENS)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_second_start_reads_every_program_and_unusable_entries_are_recompiled(
        model_and_expected, tmp_path):
    folder, expected = model_and_expected
    cache = tmp_path / "cache"
    first, stderr = start(folder, cache)
    assert first["from_store"] == 0 and first["programs"] > 0
    assert f"Compiling {first['programs']} programs" in stderr
    assert first["tokens"] == expected
    entries = sorted((cache / "executables").glob("*.jxe"))
    assert len(entries) == first["programs"] == 4

    # Three bad entries: bytes flipped, cut short, and two programs' files swapped (each
    # intact and loadable, but compiled for the other bucket's shapes: its first run fails).
    flipped = bytearray(entries[0].read_bytes())
    flipped[len(flipped) // 2] ^= 0xFF
    entries[0].write_bytes(bytes(flipped))
    entries[1].write_bytes(entries[1].read_bytes()[:1000])
    a, b = entries[2].read_bytes(), entries[3].read_bytes()
    entries[2].write_bytes(b)
    entries[3].write_bytes(a)

    second, stderr = start(folder, cache)
    assert "checksum mismatch" in stderr
    assert stderr.count("ignoring executable cache entry") >= 3
    assert second["tokens"] == expected
    assert second["from_store"] == 0  # every entry was bad, and each was compiled again

    third, stderr = start(folder, cache)  # the bad entries were replaced by good ones
    assert "ignoring executable cache entry" not in stderr
    assert third["from_store"] == third["programs"] == first["programs"]
    assert f"Reading {first['programs']} programs from the cache" in stderr
    assert third["tokens"] == expected
    assert set(third["startup"]) == {"load", "compile", "warmup"}
    print(f"\nstart-up phases, first start: {first['startup']}, third: {third['startup']}")


class _Trap:
    """Unpickling this creates `path`: proof that a file was unpickled."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def _plant(folder, key, marker):
    """An entry of the right format and checksum whose body is a _Trap pickle."""
    import hashlib
    import pickle
    from jaxserve.engine.executable_store import FORMAT
    body = pickle.dumps(_Trap(marker))
    entry = folder / f"{key}.jxe"
    entry.write_bytes(FORMAT + hashlib.sha256(body).digest() + body)
    return entry


def test_entries_others_could_write_are_never_unpickled(tmp_path, caplog):
    """Only files the process's own user wrote, in a folder only it can write, are read."""
    import jax
    from jaxserve.engine.executable_store import ExecutableStore
    devices, marker = jax.devices()[:1], tmp_path / "unpickled"
    folder = tmp_path / "executables"
    folder.mkdir(mode=0o700)
    folder.chmod(0o700)
    store = ExecutableStore(folder)

    entry = _plant(folder, "a", marker)
    entry.chmod(0o666)  # anyone could have written it: removed unread
    assert store.load("a", None, devices) is None
    assert not marker.exists() and not entry.exists()
    assert "writable by group or others" in caplog.text

    entry = _plant(folder, "b", marker)
    entry.chmod(0o600)
    folder.chmod(0o777)  # anyone could have put it there: nothing in the folder is read
    assert store.load("b", None, devices) is None
    assert not marker.exists() and entry.exists()
    assert "not reading the executable cache" in caplog.text

    folder.chmod(0o700)  # the control: a trusted entry is unpickled (then refused as unusable)
    assert store.load("b", None, devices) is None
    assert marker.exists() and store.rejected == 2
