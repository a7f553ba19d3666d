"""Which adapter each device slot holds, and which to write next (plain Python, no jax).

A replica has `max_loras` slots. A sequence with an adapter holds a slot from its admission
until it finishes or is preempted (`Scheduler`): its adapter's slot if resident, else a free
slot, else the least recently used slot nobody holds, whose adapter is then replaced. When
every slot is held by running sequences of other adapters, the sequence waits and the
scheduler admits the requests behind it. A replaced slot is written before the next step
(`take_loads`, then `Runner.load_lora`), and any step already on the device reads the slot
before the write lands (the write takes the slot stacks as a donated input, so it waits for
their readers). A slot whose adapter was unloaded is zeroed on the device once nobody uses
it, so nothing of a forgotten adapter stays in the programs' inputs.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the scheduler imports this module without jax
    from jaxserve.lora.adapter import LoRAAdapter


@dataclasses.dataclass(frozen=True, eq=False)
class Adapter:
    """An adapter loaded for serving. `key` is unique to this load (an adapter unloaded and
    loaded again under its name gets a new one), so prefix-cache pages computed with one
    version are never reused for another."""

    name: str
    int_id: int
    weights: LoRAAdapter
    key: str

    _loads = itertools.count(1)

    @classmethod
    def loaded(cls, name: str, int_id: int, weights: LoRAAdapter) -> "Adapter":
        return cls(name, int_id, weights, f"{name}#{next(cls._loads)}")


class SlotTable:
    """The slots of one replica: what each holds, how many sequences use it, when it was
    last released, and the writes still owed to the device."""

    def __init__(self, num_slots: int):
        self.adapters: list[Adapter | None] = [None] * num_slots
        self.users = [0] * num_slots
        self._released_at = [0] * num_slots
        self._clock = itertools.count(1)
        # slot -> adapter to write before the next step (None: zeros)
        self._loads: dict[int, Adapter | None] = {}
        self._forgotten: weakref.WeakSet[Adapter] = weakref.WeakSet()  # unloaded adapters

    def acquire(self, adapter: Adapter) -> int | None:
        """A slot holding `adapter` for one more sequence, or None when none can be had."""
        slot = next((s for s, held in enumerate(self.adapters) if held is adapter), None)
        if slot is None:
            idle = [s for s, users in enumerate(self.users) if users == 0]
            if not idle:
                return None
            slot = min(idle, key=lambda s: (self.adapters[s] is not None, self._released_at[s]))
            self.adapters[slot] = adapter
            self._loads[slot] = adapter
        self.users[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        """One sequence no longer uses `slot`."""
        if self.users[slot] <= 0:
            raise RuntimeError(f"LoRA slot {slot} released more often than acquired")
        self.users[slot] -= 1
        self._released_at[slot] = next(self._clock)
        if self.users[slot] == 0 and self.adapters[slot] in self._forgotten:
            self._free(slot)

    def forget(self, adapter: Adapter) -> None:
        """`adapter` was unloaded: a slot holding it idle becomes free and is zeroed (one
        still in use keeps it until its sequences finish, then is zeroed)."""
        self._forgotten.add(adapter)
        for slot, held in enumerate(self.adapters):
            if held is adapter and self.users[slot] == 0:
                self._free(slot)

    def _free(self, slot: int) -> None:
        """Empty `slot` and owe the device a write of zeros there."""
        self.adapters[slot] = None
        self._loads[slot] = None

    def take_loads(self) -> list[tuple[int, Adapter | None]]:
        """The (slot, adapter) writes owed to the device, once each (None: zeros)."""
        loads, self._loads = sorted(self._loads.items()), {}
        return loads

    def running_and_waiting(self, waiting: list[Adapter]) -> tuple[list[str], list[str]]:
        """Names of the adapters in use, and of those `waiting` sequences need (vLLM's
        `lora_requests_info` labels)."""
        running = sorted({a.name for a, users in zip(self.adapters, self.users)
                          if a is not None and users})
        return running, sorted({a.name for a in waiting} - set(running))
