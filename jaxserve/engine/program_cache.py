"""Compiled programs shared by every engine of a process, and what they cost it natively.

Two engines of one architecture and the same options compile the same programs: the weights
and the KV cache are arguments, so only shapes, shardings and devices shape a program. Each
compiled program holds native memory — on XLA:CPU every JIT-linked object is three memory
mappings, about 800 per program of the default model — and a Linux process has
`vm.max_map_count` (65,530 by default) of them; past it LLVM aborts the whole process
(`Unable to allocate section memory`). So a program is compiled once per process and shared
(`compile_shared`), keyed by its lowered text and the devices it runs on, and freed when the
last runner holding it goes. `memory_mappings()` says how close the process is to the limit.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import weakref
from pathlib import Path

import jax

_PROGRAMS: "weakref.WeakValueDictionary[str, jax.stages.Compiled]" = (
    weakref.WeakValueDictionary())
_LOCK = threading.Lock()
log = logging.getLogger("jaxserve.engine")


def program_key(lowered: jax.stages.Lowered, devices) -> str:
    """What identifies a compiled program: its StableHLO text and its devices' ids, in mesh
    order (two meshes over different devices lower to the same text)."""
    digest = hashlib.sha256(lowered.as_text().encode())
    digest.update(repr((lowered.in_tree, lowered.out_tree)).encode())  # how it is called
    digest.update(repr([(d.platform, d.id) for d in devices]).encode())
    return digest.hexdigest()


def compile_shared(lowered: jax.stages.Lowered, devices) -> jax.stages.Compiled:
    """`lowered.compile()`, or the same program another engine of this process compiled."""
    key = program_key(lowered, devices)
    with _LOCK:
        compiled = _PROGRAMS.get(key)
    if compiled is None:  # compiled outside the lock: other programs need not wait
        compiled = lowered.compile()
        with _LOCK:  # two engines compiling it at once keep the first
            compiled = _PROGRAMS.setdefault(key, compiled)
    return compiled


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
