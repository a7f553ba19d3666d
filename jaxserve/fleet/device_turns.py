"""Fair turns on devices that several engines share.

Every engine steps on its own thread and takes a seat (`DeviceTurns.seat`) on the devices of
its mesh. When two engines' meshes share a device, they take turns on it, round-robin: a turn
waits for the devices it runs on, and waiters are served in the order they asked. A turn
covers the dispatch of one of the engine's steps, so a flooded engine cannot put more than one
step on a shared device ahead of another engine that waits. Engines on disjoint devices never
wait for each other.

Why steps rather than time slices: a step is the unit the device runs without interruption
(one compiled program, or a decode loop), and its length is bounded by the engine's buckets;
round-robin of steps gives each engine with work one step per turn, which is what keeps a
quiet model's time to first token close to its value alone while another model is flooded.

How a turn bounds the wait (`jaxserve.engine.async_engine`): an engine alone on its devices
dispatches its next step before it reads the last one (host and device overlap), so the
device has up to two of its steps queued, and a newcomer would wait for both. So an engine
whose devices are shared (`Seat.shared`) reads its step in flight before it asks for its next
turn, outside any turn: it has at most one step on the device, a newcomer's step follows at
most that one, and the newcomer reads its own result as soon as its step is done, without
waiting for the flooded engine's next turn.

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
        self._seated: collections.Counter[int] = collections.Counter()  # engines per device
        self._tickets = itertools.count()

    def seat(self, devices: Iterable[int]) -> Seat:
        """An engine's place on `devices` (until `Seat.leave`): its turns, and whether other
        engines share those devices."""
        return Seat(self, devices)

    def shared(self, devices: Iterable[int]) -> bool:
        """Whether more than one seated engine runs on one of `devices`."""
        with self._changed:
            return any(self._seated[d] > 1 for d in devices)

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

    def _sit(self, devices: tuple[int, ...], count: int) -> None:
        with self._changed:
            self._seated.update({d: count for d in devices})


class Seat:
    """One engine's turns on its devices (what `AsyncEngine` holds around its steps)."""

    def __init__(self, turns: DeviceTurns, devices: Iterable[int]):
        self.turns, self.devices = turns, tuple(sorted(set(devices)))
        self._seated = True
        turns._sit(self.devices, 1)

    def turn(self) -> contextlib.AbstractContextManager[None]:
        return self.turns.turn(self.devices)

    def shared(self) -> bool:
        """Whether another seated engine runs on one of this engine's devices."""
        return self.turns.shared(self.devices)

    def leave(self) -> None:
        """Give the seat up (the engine stopped); idempotent."""
        if self._seated:
            self._seated = False
            self.turns._sit(self.devices, -1)
