"""Compiled bucket programs kept on disk whole, so that a restart skips tracing too.

JAX's persistent compilation cache (which the engine also turns on) saves XLA's compile, but
every start still traces and lowers each bucket program to find the cache entry: 53 of the 54
seconds of a warm restart of the 60M bench model, most of `jaxserve generate`'s start. This
store keeps each program's executable (`jax.experimental.serialize_executable`) under a key
computed *without* tracing, from everything that shapes the program:

- the program's own description, from the runner: kind and bucket, the model config, the
  program-shaping engine options, the abstract arguments' shapes, dtypes and shardings;
- the devices in mesh order (platform, kind, id) and the backend's platform version;
- jax, jaxlib, flax and numpy versions, `XLA_FLAGS` / `LIBTPU_INIT_ARGS` and the jax options
  that change lowering (x64, default matmul precision);
- a digest of the source that traces the programs (`jaxserve`'s model, attention, engine and
  loading packages and top-level modules, `pallas_kernels`, `sharding`): a change there is a
  new key, so an edit never runs a stale program (at the price of one compile).

Beside the programs the store keeps small JSON records under keys of the same kind: the
weight layouts XLA chose in the TPU runner's layout probe (`Runner.weight_layouts`), which
every program's key includes, so a warm restart compiles nothing at all.

A miss compiles as before and writes the entry. An entry that cannot be used — truncated,
wrong checksum, not unpicklable, a different call signature, or a program that fails its
first run (`Engine` runs each program once on an empty batch at start) — is a warning, the
file is removed and the program compiled again.

An XLA:CPU executable that JAX read back from its persistent cache serializes without some
of its functions (jax 0.10.2: the reloaded copy fails with "Function ... not found"). So on
CPU the engine leaves JAX's persistent cache off while this store is on (the store is then the
cache of the bucket programs), and a CPU executable that JAX's cache did answer (a user who
turned it on) is not stored. On TPU/GPU both caches are on; the first run guards the store.

The store is off in multi-process runs (every process would need its own entry of a
collective program; they compile through the persistent cache as before).

Trust: an entry is machine code plus JAX's pickled call signature, so loading one runs what
the file says — the one place jaxserve unpickles (model folders and requests never are). The
store therefore trusts only what its own user could have written: it creates its folder with
mode 0700, and reads nothing (and warns) while the folder, or an entry, is not owned by the
process's user or is writable by group or others. An untrusted entry is removed unread.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import pickle
import threading
from pathlib import Path
from typing import Any, Callable

import jax
from jax.experimental import serialize_executable

from jaxserve.platforms import platform

log = logging.getLogger("jaxserve.engine")

FORMAT = b"jaxserve-executable-1\n"
# The source that traces the programs: jaxserve's top-level modules (sampling limits), the
# model, attention, engine, speculative and loading packages, the kernels and the sharding
# rules. The server, fleet, CLI, benches and plans do not shape a program: editing them
# keeps entries.
_TRACED_SOURCE = (("jaxserve", ("*.py", "model/**/*.py", "attention/**/*.py",
                                "engine/**/*.py", "speculative/**/*.py", "loading/**/*.py")),
                  ("pallas_kernels", ("**/*.py",)), ("sharding", ("**/*.py",)))
_DIGEST_LOCK = threading.Lock()
_SOURCE_DIGEST: list[str] = []


def source_digest() -> str:
    """sha256 over the Python source that traces the programs (once a process)."""
    with _DIGEST_LOCK:
        if not _SOURCE_DIGEST:
            digest = hashlib.sha256()
            for package, patterns in _TRACED_SOURCE:
                root = Path(importlib.import_module(package).__file__).parent
                paths = {path for pattern in patterns for path in root.glob(pattern)}
                for path in sorted(paths):
                    digest.update(str(path.relative_to(root.parent)).encode())
                    digest.update(path.read_bytes())
            _SOURCE_DIGEST.append(digest.hexdigest())
    return _SOURCE_DIGEST[0]


def environment(devices) -> dict[str, Any]:
    """What, outside the program's description, decides the executable."""
    versions = {name: importlib.metadata.version(name)
                for name in ("jax", "jaxlib", "flax", "numpy")}
    first = devices[0]
    return {"format": FORMAT.decode().strip(), "versions": versions,
            "platform_version": first.client.platform_version,
            "devices": [(d.platform, d.device_kind, d.id) for d in devices],
            "env": {name: os.environ.get(name, "") for name in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")},
            "jax": {"x64": jax.config.jax_enable_x64,
                    "matmul_precision": str(jax.config.jax_default_matmul_precision)},
            "source": source_digest()}


def program_store_key(description: dict[str, Any], devices) -> str:
    """The key of a program: sha256 of its description and its environment."""
    text = repr(sorted({**description, "environment": environment(list(devices))}.items()))
    return hashlib.sha256(text.encode()).hexdigest()


_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_compile_state = threading.local()  # .hit: this thread's last compile came from JAX's cache


def _note_cache_hit(event: str, **_) -> None:
    if event == _CACHE_HIT_EVENT:
        _compile_state.hit = True


jax.monitoring.register_event_listener(_note_cache_hit)


def compile_noting_cache(lowered: jax.stages.Lowered, compiler_options: dict | None = None
                         ) -> tuple[jax.stages.Compiled, bool]:
    """(`lowered.compile(compiler_options)`, whether JAX's persistent cache answered it)."""
    _compile_state.hit = False
    compiled = lowered.compile(compiler_options)
    return compiled, _compile_state.hit


class ExecutableStore:
    """A folder of serialized executables, one file per key."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.loaded = 0  # programs read from the store by this process
        self.written = 0
        self.rejected = 0  # entries found unusable and removed
        self._warned_folder = False

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.jxe"

    def load(self, key: str, in_tree, devices) -> jax.stages.Compiled | None:
        """The stored executable of `key` on `devices`, or None (missing or unusable: removed
        with a warning). `in_tree`: how the caller will call it; an entry called otherwise
        is unusable."""
        path = self.path(key)
        if not path.exists() or not self._folder_trusted():
            return None
        entry_problem = untrusted_reason(path)
        if entry_problem is not None:
            self.reject(key, f"the file {entry_problem}")
            return None
        try:
            blob = path.read_bytes()
        except OSError as err:
            log.warning("executable cache entry %s unreadable (%s); compiling", path.name, err)
            return None
        try:
            body = _checked_body(blob)
            payload, stored_in_tree, out_tree = pickle.loads(body)
            if stored_in_tree != in_tree:
                raise ValueError("it was compiled for another call signature")
            compiled = serialize_executable.deserialize_and_load(
                payload, stored_in_tree, out_tree, backend=devices[0].client,
                execution_devices=list(devices))
        except Exception as err:  # noqa: BLE001 - any unusable entry is a miss
            self.reject(key, f"{type(err).__name__}: {err}")
            return None
        self.loaded += 1
        return compiled

    def save(self, key: str, compiled: jax.stages.Compiled) -> None:
        """Write `compiled` under `key` (atomically: a reader sees all of it or nothing). A
        program that cannot be serialized or a folder that cannot be written is a warning."""
        try:
            body = pickle.dumps(serialize_executable.serialize(compiled))
            self._write(self.path(key), FORMAT + hashlib.sha256(body).digest() + body)
        except Exception as err:  # noqa: BLE001 - the store is an optimization
            log.warning("could not keep a compiled program in %s (%s: %s)", self.folder,
                        type(err).__name__, err)
            return
        self.written += 1

    def record_path(self, key: str) -> Path:
        return self.folder / f"{key}.json"

    def load_record(self, key: str) -> Any:
        """The JSON value kept under `key` by `save_record`, or None (missing, or unusable:
        removed with a warning). Records are data, never code; they are still read only from
        a folder and file of this user's own, as entries are."""
        path = self.record_path(key)
        if not path.exists() or not self._folder_trusted():
            return None
        problem = untrusted_reason(path)
        try:
            if problem is not None:
                raise ValueError(f"the file {problem}")
            return json.loads(path.read_text())
        except (OSError, ValueError) as err:
            log.warning("ignoring executable cache record %s (%s)", path.name, err)
            path.unlink(missing_ok=True)
            return None

    def save_record(self, key: str, value: Any) -> None:
        """Keep the JSON value `value` under `key` (atomically); a failure is a warning."""
        try:
            self._write(self.record_path(key), json.dumps(value).encode())
        except OSError as err:
            log.warning("could not keep a record in %s (%s)", self.folder, err)

    def _write(self, path: Path, data: bytes) -> None:
        """Write `data` to `path` atomically (a reader sees all of it or nothing), the file
        owner-only, in a folder created owner-only."""
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        partial = self.folder / f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp"
        descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
        os.replace(partial, path)

    def _folder_trusted(self) -> bool:
        """Whether the folder is this user's own and not writable by others (warned once)."""
        problem = untrusted_reason(self.folder)
        if problem is not None and not self._warned_folder:
            log.warning("not reading the executable cache %s: the folder %s; compiling",
                        self.folder, problem)
            self._warned_folder = True
        return problem is None

    def reject(self, key: str, reason: str) -> None:
        """Remove an unusable entry, saying why."""
        log.warning("ignoring executable cache entry %s (%s); compiling it again",
                    self.path(key).name, reason)
        self.rejected += 1
        try:
            self.path(key).unlink(missing_ok=True)
        except OSError as err:
            log.warning("could not remove %s (%s)", self.path(key).name, err)

    def load_or_compile(self, key: str, lower: Callable[[], jax.stages.Lowered], in_tree,
                        devices, compiler_options: dict | None = None
                        ) -> tuple[jax.stages.Compiled, bool]:
        """(the program, whether it came from the store): the stored one, else `lower()`
        compiled fresh (with `compiler_options`, which `key` must cover) and stored."""
        compiled = self.load(key, in_tree, devices)
        if compiled is not None:
            return compiled, True
        compiled, from_jax_cache = compile_noting_cache(lower(), compiler_options)
        if from_jax_cache and not platform(devices[0].platform).restores_cached_programs:
            log.debug("not storing a CPU program JAX's persistent cache answered (it would "
                      "not run once stored again)")
        else:
            self.save(key, compiled)
        return compiled, False


def untrusted_reason(path: Path) -> str | None:
    """Why `path` (an entry or the store's folder) could hold someone else's code, or None:
    owned by another user, or writable by group or others. (POSIX; elsewhere: None.)"""
    if not hasattr(os, "getuid"):
        return None
    status = path.stat()
    if status.st_uid != os.getuid():
        return f"is owned by uid {status.st_uid}, not this process's user"
    if status.st_mode & 0o022:
        return f"is writable by group or others (mode {status.st_mode & 0o777:o})"
    return None


def _checked_body(blob: bytes) -> bytes:
    """The pickled body of a file, after its format tag and checksum are verified."""
    if not blob.startswith(FORMAT):
        raise ValueError("not an executable cache file of this format")
    digest, body = blob[len(FORMAT):len(FORMAT) + 32], blob[len(FORMAT) + 32:]
    if hashlib.sha256(body).digest() != digest:
        raise ValueError("checksum mismatch (truncated or corrupted)")
    return body
