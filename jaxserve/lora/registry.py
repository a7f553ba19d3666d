"""The adapters an engine can serve, by name: loaded from their PEFT folders into host memory
once, shared by every replica's slots (thread-safe: the server loads and unloads while the
engine steps)."""

from __future__ import annotations

import itertools
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
        self._server_ids = itertools.count(1)  # lora_int_id candidates for `add_folder`

    def add_folder(self, name: str, path: str, replace: bool = False) -> Adapter:
        """Load the PEFT folder `path` as `name` with an id no loaded adapter has (the server
        names adapters, clients do not number them); see `add`."""
        with self._lock:
            used = {a.int_id for a in self._adapters.values()}
            int_id = next(i for i in self._server_ids if i not in used)
        return self.add(LoRARequest(name, int_id, path), replace)

    def add(self, request: LoRARequest, replace: bool = False) -> Adapter:
        """The adapter `request` names, loading its folder the first time (`ValueError`
        naming what is wrong with the folder, or a name or id already used otherwise).
        `replace`: a name loaded from another folder takes the new one (a models-file version
        whose `lora_path` changed); sequences using the old load finish with it."""
        with self._lock:
            known = self._adapters.get(request.lora_name)
            if known is not None and not replace:
                if (known.int_id, known.weights.path) != (request.lora_int_id,
                                                          request.lora_path):
                    raise ValueError(f"a LoRA adapter named {request.lora_name!r} is already "
                                     f"loaded from {known.weights.path!r} (id "
                                     f"{known.int_id}); unload it first")
                return known
            clash = next((a for a in self._adapters.values() if a.int_id
                          == request.lora_int_id and a.name != request.lora_name), None)
            if clash is not None:
                raise ValueError(f"lora_int_id {request.lora_int_id} is already used by the "
                                 f"adapter {clash.name!r}")
        weights = load_adapter(request.lora_path, self.cfg, self.max_lora_rank,
                               self.tensor_parallel_size)  # outside the lock: seconds
        adapter = Adapter.loaded(request.lora_name, request.lora_int_id, weights)
        with self._lock:
            if replace:
                self._adapters[request.lora_name] = adapter
            return self._adapters.setdefault(request.lora_name, adapter)

    def remove(self, adapter: Adapter) -> bool:
        """Forget this load of an adapter, if its name still names it; sequences already
        using it finish with it."""
        with self._lock:
            if self._adapters.get(adapter.name) is not adapter:
                return False
            del self._adapters[adapter.name]
            return True

    def get(self, name: str) -> Adapter | None:
        with self._lock:
            return self._adapters.get(name)

    def all(self) -> list[Adapter]:
        with self._lock:
            return list(self._adapters.values())
