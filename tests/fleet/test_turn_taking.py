"""Engines sharing a device: seats tell whether a device is shared, and on a shared device
an engine's turn is one step of its on the device, so a waiting engine's step follows at
most one of its steps (an engine alone on its devices keeps two in the pipeline)."""

from types import SimpleNamespace

from jaxserve.fleet.device_turns import DeviceTurns
from jaxserve.server.async_engine import AsyncEngine


def test_seats_tell_whether_a_device_is_shared():
    turns = DeviceTurns()
    first, apart = turns.seat([0]), turns.seat([1])
    assert not first.shared() and not apart.shared()
    second = turns.seat([0, 2])
    assert first.shared() and second.shared() and not apart.shared()
    second.leave()
    second.leave()  # idempotent
    assert not first.shared()
    with first.turn():
        assert not first.contended()


class _FakeEngine:
    """Records what the engine thread asked of it; a dispatched single step stays in
    flight until read."""

    def __init__(self, in_flight: bool):
        self.calls: list[str] = []
        self.has_in_flight = in_flight

    def step(self):
        self.calls.append("read previous + dispatch" if self.has_in_flight else "dispatch")
        self.has_in_flight = True
        return []

    def read_in_flight(self):
        self.calls.append("read")
        self.has_in_flight = False
        return []


def _turn(shared: bool, contended: bool, in_flight: bool) -> list[str]:
    seat = SimpleNamespace(shared=lambda: shared, contended=lambda: contended)
    engine = _FakeEngine(in_flight)
    AsyncEngine(engine, max_waiting=8, seat=seat)._turn()
    return engine.calls


def test_alone_on_its_devices_the_engine_pipelines_its_steps():
    assert _turn(shared=False, contended=False, in_flight=True) == ["read previous + dispatch"]


def test_on_a_shared_device_a_waiting_engine_goes_after_the_step_in_flight():
    # someone waits: read the step dispatched at the last turn, dispatch nothing more
    assert _turn(shared=True, contended=True, in_flight=True) == ["read"]
    # nobody waits: read it, then dispatch the next (left in flight: host and device overlap)
    assert _turn(shared=True, contended=False, in_flight=True) == ["read", "dispatch"]
    # nothing in flight and someone waits: one step, read before the turn is given away
    assert _turn(shared=True, contended=True, in_flight=False) == ["dispatch", "read"]
    assert _turn(shared=True, contended=False, in_flight=False) == ["dispatch"]
