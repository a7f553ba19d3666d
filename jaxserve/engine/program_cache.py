"""Compiled programs shared by every engine of a process, and what they cost it natively.

Two engines of one architecture and the same options compile the same programs: the weights
and the KV cache are arguments, so only shapes, shardings and devices shape a program. Each
compiled program holds native memory — on XLA:CPU every JIT-linked object is three memory
mappings, about 800 per program of the default model — and a Linux process has
`vm.max_map_count` (65,530 by default) of them; past it LLVM aborts the whole process
(`Unable to allocate section memory`). So a program is compiled once per process and shared
(`compile_shared`), keyed by the runner's description of it
(`executable_store.program_store_key`: shapes, options, devices, versions, source), and freed
when the last runner holding it goes. `memory_mappings()` says how close the process is to
the limit.
"""

from __future__ import annotations

import logging
import threading
import weakref
from pathlib import Path
from typing import Callable

import jax

_PROGRAMS: "weakref.WeakValueDictionary[str, jax.stages.Compiled]" = (
    weakref.WeakValueDictionary())
_LOCK = threading.Lock()
log = logging.getLogger("jaxserve.engine")


def compile_shared(key: str, build: Callable[[], jax.stages.Compiled]) -> jax.stages.Compiled:
    """The program of `key` another engine of this process already holds, else `build()`."""
    with _LOCK:
        compiled = _PROGRAMS.get(key)
    if compiled is None:  # built outside the lock: other programs need not wait
        compiled = build()
        with _LOCK:  # two engines building it at once keep the first
            compiled = _PROGRAMS.setdefault(key, compiled)
    return compiled


def forget(key: str) -> None:
    """Drop `key`'s program from the shared table (it proved unusable): the next
    `compile_shared` of it builds a new one."""
    with _LOCK:
        _PROGRAMS.pop(key, None)


def process_programs() -> int:
    """Compiled bucket programs alive in this process (shared ones counted once)."""
    return len(_PROGRAMS)


def warn_near_mapping_limit(fraction: float = 0.8) -> None:
    """Log a warning when the process holds more than `fraction` of its mapping limit: one
    more engine with programs of its own may then abort the process."""
    mappings = memory_mappings()
    if mappings is not None and mappings[0] > fraction * mappings[1]:
        log.warning("this process holds %d of its %d memory mappings (vm.max_map_count); "
                    "each further engine with programs of its own adds hundreds per program",
                    *mappings)


def memory_mappings() -> tuple[int, int] | None:
    """(mappings this process holds, the kernel's limit per process), or None off Linux."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            held = sum(1 for _ in maps)
        limit = int(Path("/proc/sys/vm/max_map_count").read_text())
    except OSError:
        return None
    return held, limit
