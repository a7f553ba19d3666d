"""Fair turns on devices that several engines share.

Every engine steps on its own thread. When two engines' meshes share a device, their steps
take turns on it, round-robin: a step waits for the devices it runs on, and waiters are served
in the order they asked. A flooded engine therefore cannot hold a shared device for more than
one of its steps while another engine waits: the other engine's step runs next. Engines on
disjoint devices never wait for each other.

Why steps rather than time slices: a step is the unit the device runs without interruption
(one compiled program, or a decode loop), and its length is bounded by the engine's buckets;
round-robin of steps gives each engine with work one step per turn, which is what keeps a
quiet model's time to first token close to its value alone while another model is flooded.
A turn covers a step's dispatch and the reading of its results: an engine alone leaves a
step in flight and reads it at its next step (host and device overlap), but when another
engine waits for the device it reads the step before giving the turn away
(`Engine.read_in_flight`), so a request's first token does not wait for the other engine's
step as well.

Waiters are ordered by a ticket taken on all their devices at once, under one lock, so a
waiter that is first on one shared device is first on every device it shares: no deadlock.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
from typing import Iterable, Iterator


class DeviceTurns:
    """Round-robin turns on shared devices, keyed by `jax.Device.id`."""

    def __init__(self):
        self._changed = threading.Condition()
        self._queues: dict[int, collections.deque[int]] = collections.defaultdict(
            collections.deque)
        self._busy: set[int] = set()
        self._tickets = itertools.count()

    def contended(self, devices: Iterable[int]) -> bool:
        """Whether another engine waits for one of `devices` (call while holding them)."""
        with self._changed:
            return any(self._queues[d] for d in devices)

    @contextlib.contextmanager
    def turn(self, devices: Iterable[int]) -> Iterator[None]:
        """Hold `devices` for the block, after every earlier waiter on any of them."""
        devices = sorted(set(devices))
        with self._changed:
            ticket = next(self._tickets)
            for device in devices:
                self._queues[device].append(ticket)
            self._changed.wait_for(lambda: all(
                self._queues[d][0] == ticket and d not in self._busy for d in devices))
            for device in devices:
                self._queues[device].popleft()
                self._busy.add(device)
        try:
            yield
        finally:
            with self._changed:
                self._busy.difference_update(devices)
                self._changed.notify_all()
