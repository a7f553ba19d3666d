"""Engines sharing a device: seats tell whether a device is shared, and on a shared device
an engine's turn is the dispatch of one step, its step in flight read before and outside the
turn, so a waiting engine's step follows at most one of its steps (an engine alone on its
devices keeps two in the pipeline)."""

from jaxserve.fleet.device_turns import DeviceTurns
from jaxserve.engine.async_engine import AsyncEngine


def test_seats_tell_whether_a_device_is_shared():
    turns = DeviceTurns()
    first, apart = turns.seat([0]), turns.seat([1])
    assert not first.shared() and not apart.shared()
    second = turns.seat([0, 2])
    assert first.shared() and second.shared() and not apart.shared()
    second.leave()
    second.leave()  # idempotent
    assert not first.shared()


class _RecordingEngine:
    """Stands in for the engine's stepping API (the device work is not what is tested) and
    records each call, with whether the caller held its turn at the time."""

    def __init__(self, seat, in_flight: bool):
        self.seat, self.calls, self.has_in_flight = seat, [], in_flight

    def _held(self) -> str:
        return "in turn" if seat_is_held(self.seat) else "outside"

    def has_unfinished(self):
        return True

    def step(self, max_decode_steps=None):
        kind = "read previous + dispatch" if self.has_in_flight else "dispatch"
        loop = "" if max_decode_steps is None else f", loops of {max_decode_steps}"
        self.calls.append(f"{kind} {self._held()}{loop}")
        self.has_in_flight = True
        return []

    def read_in_flight(self):
        self.calls.append(f"read {self._held()}")
        self.has_in_flight = False
        return []


def seat_is_held(seat) -> bool:
    """Whether a turn on the seat's devices is running (another engine asking now waits)."""
    return any(d in seat.turns._busy for d in seat.devices)


def _one_step(shared: bool, in_flight: bool) -> list[str]:
    turns = DeviceTurns()
    seat = turns.seat([0])
    if shared:
        turns.seat([0, 1])
    engine = _RecordingEngine(seat, in_flight)
    AsyncEngine(engine, max_waiting=8, seat=seat)._step_once()
    return engine.calls


def test_alone_on_its_devices_the_engine_pipelines_its_steps():
    # the next step is dispatched before the last is read: two of its steps on the device
    assert _one_step(shared=False, in_flight=True) == ["read previous + dispatch in turn"]


def test_on_a_shared_device_a_turn_is_one_dispatch_and_reads_need_no_turn():
    # the step in flight is read first, outside the turn; the turn only dispatches the next,
    # a single decode step (no decode loop holds the device for several)
    assert _one_step(shared=True, in_flight=True) == ["read outside",
                                                      "dispatch in turn, loops of 1"]
    assert _one_step(shared=True, in_flight=False) == ["dispatch in turn, loops of 1"]
