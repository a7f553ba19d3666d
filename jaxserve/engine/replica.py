"""A data-parallel replica of the engine and the step it has on device.

Each replica owns a page pool, a scheduler and a runner on its own `(1, tp)` sub-mesh; its
weights are views of the engine's buffers (`on_mesh`), so building one copies nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

import sharding
from jaxserve.engine.batcher import StepInput
from jaxserve.engine.page_allocator import PageAllocator
from jaxserve.engine.runner import Runner
from jaxserve.engine.scheduler import Scheduler, SchedulerOutput
from jaxserve.model import LlamaModel


def on_mesh(model: LlamaModel, mesh: Mesh) -> LlamaModel:
    """A replica's model: the same device buffers, viewed on its sub-mesh."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.tree.map(lambda a: sharding.restrict_to(a, mesh), state))


@dataclasses.dataclass
class InFlight:
    """A dispatched step whose results are still on device."""

    plan: SchedulerOutput
    inp: StepInput
    pending: Any  # the runner's device results
    started: float
    placeholders: list[int | None] | None  # `Scheduler.advance`'s; None: a decode loop

    @property
    def needs_host_tokens(self) -> bool:
        """Whether the next step needs this one's tokens on the host (penalty counts, the
        next grammar bitmask)."""
        return any(chunk.seq.params.has_penalties or chunk.seq.grammar is not None
                   for chunk in self.plan.chunks)


@dataclasses.dataclass
class Replica:
    """One data-parallel replica: a page pool, its scheduler and a runner on a sub-mesh, and
    the step it has on device."""

    allocator: PageAllocator
    scheduler: Scheduler
    runner: Runner
    in_flight: InFlight | None = None
    scheduling: SchedulerOutput | None = None  # scheduled, not yet in flight
    consecutive_failures: int = 0  # failed steps since its last step that completed

    @property
    def load(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)
