"""One device's memory around an engine's first runs, logged at start-up as JSON: what the
allocator allows and holds, the bytes of the live arrays on the device, the weights, the KV
cache, and each compiled program's temporaries. Written before the first run, so when that
run fails (out of memory, on an accelerator) the figures are already out; `jaxserve bench
device` records them from the log record's `memory_figures` attribute."""

from __future__ import annotations

import json
import logging
import math

import jax

log = logging.getLogger(__name__)


def bytes_on(device: jax.Device, arrays) -> int:
    """Bytes `device` holds of `arrays` (live arrays, or `ShapeDtypeStruct`s with
    shardings): each one's shard, where the device is among its sharding's."""
    return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
               for a in jax.tree.leaves(arrays) if device in a.sharding.device_set)


def program_temporaries(compiled: jax.stages.Compiled) -> int:
    """Bytes a run of `compiled` needs beyond its arguments: its temporaries and the outputs
    not aliased to a donated input (0 where the backend does not say)."""
    memory = compiled.memory_analysis()
    if memory is None:
        return 0
    return int(memory.temp_size_in_bytes + memory.output_size_in_bytes
               - memory.alias_size_in_bytes)


def log_figures(moment: str, device: jax.Device, weights, caches,
                programs: dict[str, jax.stages.Compiled] | None = None) -> dict:
    """Log (INFO) and return the figures of `device` at `moment`: `weights` and `caches`
    (arrays) as this engine holds them, and `programs`' temporaries by name."""
    stats = device.memory_stats() or {}
    figures = {"moment": moment, "device": device.device_kind,
               "bytes_limit": stats.get("bytes_limit"), "bytes_in_use": stats.get("bytes_in_use"),
               "live_bytes": bytes_on(device, [a for a in jax.live_arrays()
                                               if not a.is_deleted()]),
               "weights_bytes": bytes_on(device, weights),
               "kv_cache_bytes": bytes_on(device, caches)}
    if programs is not None:
        figures["program_temp_bytes"] = {name: program_temporaries(compiled)
                                         for name, compiled in programs.items()}
    log.info("device memory %s: %s", moment, json.dumps(figures),
             extra={"memory_figures": figures})
    return figures
