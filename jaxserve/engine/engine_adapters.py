"""The engine's LoRA adapters: loading them into host memory by name, forgetting them, and
writing those the scheduler gave slots into the device's slot stacks before a step
(`jaxserve.lora`). A mixin of `Engine`, which owns `loras` (an `AdapterRegistry`, None
without `enable_lora`), `replicas` and the inbox the engine's thread drains."""

from __future__ import annotations

from jaxserve.engine.replica import Replica
from jaxserve.lora.registry import AdapterRegistry
from jaxserve.lora.request import LoRARequest
from jaxserve.lora.slots import Adapter


class EngineAdapters:
    """`Engine`'s LoRA methods (safe from other threads but `_write_adapters`)."""

    def load_lora(self, request: LoRARequest) -> Adapter:
        """Read an adapter's folder into host memory (once per name; thread-safe). It reaches
        a device slot when a request using it is admitted."""
        return self._adapter_registry().add(request)

    def load_lora_folder(self, name: str, path: str, replace: bool = False) -> Adapter:
        """`load_lora` with an unused `lora_int_id` chosen here (the server's adapters have
        names; `AdapterRegistry.add_folder`)."""
        return self._adapter_registry().add_folder(name, path, replace)

    def _adapter_registry(self) -> AdapterRegistry:
        if self.loras is None:
            raise ValueError("this engine was started without enable_lora")
        return self.loras

    def unload_lora(self, name: str) -> bool:
        """Forget the adapter called `name` (thread-safe); requests already using it finish
        with it. False if no adapter has that name."""
        adapter = None if self.loras is None else self.loras.get(name)
        if adapter is not None:
            self.forget_lora(adapter)
        return adapter is not None

    def forget_lora(self, adapter: Adapter) -> None:
        """Forget this load of an adapter: its name, if it still names it, and the slots it
        holds once no sequence uses them."""
        self.loras.remove(adapter)
        self._inbox.put(("forget_lora", adapter))

    def lora_requests(self) -> tuple[list[str], list[str]]:
        """Names of the adapters running sequences use and of those only waiting sequences
        need (vLLM's `vllm:lora_requests_info`; safe from another thread)."""
        running, waiting = set(), set()
        for replica in self.replicas:
            table = replica.scheduler.lora_slots
            queued = [seq.lora for seq in list(replica.scheduler.waiting) if seq.lora]
            now, later = table.running_and_waiting(queued)
            running.update(now)
            waiting.update(later)
        return sorted(running), sorted(waiting - running)

    def _write_adapters(self, replica: Replica) -> None:
        """Write into the replica's slots the adapters its scheduler just gave them, and
        zeros into the slots of unloaded adapters nobody uses any more."""
        if replica.scheduler.lora_slots is not None:
            for slot, adapter in replica.scheduler.lora_slots.take_loads():
                replica.runner.load_lora(slot, None if adapter is None else adapter.weights)
