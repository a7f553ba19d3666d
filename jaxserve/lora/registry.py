"""The adapters an engine can serve, by name: loaded from their PEFT folders into host memory
once, shared by every replica's slots (thread-safe: the server loads and unloads while the
engine steps)."""

from __future__ import annotations

import threading

from jaxserve.lora.adapter import load_adapter
from jaxserve.lora.request import LoRARequest
from jaxserve.lora.slots import Adapter
from jaxserve.model.config import ModelConfig


class AdapterRegistry:
    """Loaded adapters by `lora_name`, for a base model of config `cfg` (as stored on the
    mesh) served with rank `max_lora_rank` over `tensor_parallel_size` devices."""

    def __init__(self, cfg: ModelConfig, max_lora_rank: int, tensor_parallel_size: int):
        self.cfg = cfg
        self.max_lora_rank = max_lora_rank
        self.tensor_parallel_size = tensor_parallel_size
        self._adapters: dict[str, Adapter] = {}
        self._lock = threading.Lock()

    def add(self, request: LoRARequest) -> Adapter:
        """The adapter `request` names, loading its folder the first time (`ValueError`
        naming what is wrong with the folder, or a name or id already used otherwise)."""
        with self._lock:
            known = self._adapters.get(request.lora_name)
            if known is not None:
                if (known.int_id, known.weights.path) != (request.lora_int_id,
                                                          request.lora_path):
                    raise ValueError(f"a LoRA adapter named {request.lora_name!r} is already "
                                     f"loaded from {known.weights.path!r} (id "
                                     f"{known.int_id}); unload it first")
                return known
            clash = next((a for a in self._adapters.values()
                          if a.int_id == request.lora_int_id), None)
            if clash is not None:
                raise ValueError(f"lora_int_id {request.lora_int_id} is already used by the "
                                 f"adapter {clash.name!r}")
        weights = load_adapter(request.lora_path, self.cfg, self.max_lora_rank,
                               self.tensor_parallel_size)  # outside the lock: seconds
        with self._lock:
            adapter = self._adapters.setdefault(
                request.lora_name, Adapter.loaded(request.lora_name, request.lora_int_id,
                                                  weights))
        return adapter

    def remove(self, name: str) -> Adapter | None:
        """Forget an adapter (None if unknown); sequences already using it finish with it."""
        with self._lock:
            return self._adapters.pop(name, None)

    def get(self, name: str) -> Adapter | None:
        with self._lock:
            return self._adapters.get(name)

    def all(self) -> list[Adapter]:
        with self._lock:
            return list(self._adapters.values())
