"""Multi-host serving: one SPMD program on every process, one scheduler on process 0.

Every process loads its shards of the weights, builds the same mesh over all processes'
devices and compiles the same bucket programs. Process 0 (the leader) runs the scheduler,
the HTTP server or `LLM.generate`; before each program call it broadcasts a fixed-size
header — `[kind, tokens, rows, num_steps]` — and then the `StepInput` itself, so the
followers (`Engine.run_follower`) call the very same program with the very same inputs:
the collectives inside line up because every process issues the same programs in the same
order. `Engine.shutdown` broadcasts a stop header, after which followers return.

The header goes first because a broadcast needs the same shapes on every process and only
the leader knows the step's bucket. Broadcasts use
`jax.experimental.multihost_utils.broadcast_one_to_all` (a psum over all devices; on CPU
through the gloo collectives).
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.experimental import multihost_utils

STOP, STEP, DECODE = 0, 1, 2
ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
    """Join a multi-process run with `jax.distributed.initialize` before any other jax call.

    Missing arguments come from $JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES and
    $JAX_PROCESS_ID. With none of them set, or one process, this is a no-op. Returns
    whether a multi-process run was joined.
    """
    address = coordinator_address or os.environ.get(ENV[0]) or None
    num = num_processes if num_processes is not None else os.environ.get(ENV[1])
    pid = process_id if process_id is not None else os.environ.get(ENV[2])
    if address is None and num is None and pid is None:
        return False
    for name, value, env in (("num_processes", num, ENV[1]), ("process_id", pid, ENV[2])):
        if value is None or not str(value).lstrip("-").isdigit():
            raise ValueError(f"{name} must be an integer (argument or ${env}), got {value!r}")
    num, pid = int(num), int(pid)
    if num < 1:
        raise ValueError(f"num_processes must be >= 1, got {num}")
    if not 0 <= pid < num:
        raise ValueError(f"process_id must be in [0, {num}), got {pid}")
    if num == 1:
        return False
    if not address:
        raise ValueError(f"coordinator_address (host:port, or ${ENV[0]}) is needed for "
                         f"{num} processes")
    # CPU processes exchange collectives through gloo; GPU/TPU clients ignore this option.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(address, num, pid)
    return True


def is_leader() -> bool:
    """Whether this process owns the scheduler (and the HTTP server): process 0."""
    return jax.process_index() == 0


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def agree(value: int) -> int:
    """Process 0's `value` on every process (e.g. the KV-cache page count, which each
    process would otherwise size from its own free memory)."""
    if not is_multiprocess():
        return value
    return int(multihost_utils.broadcast_one_to_all(np.asarray(value, np.int32)))


def _header(kind: int, tokens: int = 0, rows: int = 0, num_steps: int = 0) -> np.ndarray:
    return np.asarray([kind, tokens, rows, num_steps], np.int32)  # [4]


def send_step(kind: int, inp, num_steps: int = 1) -> None:
    """Leader: announce the next program call (`STEP` or `DECODE`) and its inputs."""
    tokens, rows = inp.token_ids.shape[0], inp.kv_lens.shape[0]
    multihost_utils.broadcast_one_to_all(_header(kind, tokens, rows, num_steps))
    multihost_utils.broadcast_one_to_all(inp)


def send_stop() -> None:
    """Leader: release the followers."""
    multihost_utils.broadcast_one_to_all(_header(STOP))


def receive_step(empty_input) -> tuple[int, object, int]:
    """Follower: wait for the leader's next call; returns (kind, StepInput, num_steps), the
    input `None` for `STOP`. `empty_input(tokens, rows)` builds a zero input of that shape."""
    kind, tokens, rows, num_steps = (
        int(x) for x in multihost_utils.broadcast_one_to_all(_header(STOP)))
    if kind == STOP:
        return kind, None, 0
    inp = multihost_utils.broadcast_one_to_all(empty_input(tokens, rows))
    return kind, jax.tree.map(np.asarray, inp), num_steps
