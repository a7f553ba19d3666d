"""The adapters an engine can serve, by name: loaded from their PEFT folders into host memory
once, shared by every replica's slots (thread-safe: the server loads and unloads while the
engine steps).

At most `max_cpu_loras` adapters are held (vLLM's option; loads in progress count): one more
is refused with a `LoRACapacityError` rather than growing host memory without bound. A name
is reserved while its folder is read, so two loads of one name at once cannot both succeed:
the second gets a `LoRAConflictError`."""

from __future__ import annotations

import itertools
import threading

from jaxserve.lora.adapter import load_adapter
from jaxserve.lora.request import LoRARequest
from jaxserve.lora.slots import Adapter
from jaxserve.model.config import ModelConfig


class LoRAConflictError(ValueError):
    """The name is being loaded by another request right now (HTTP 409)."""


class LoRACapacityError(ValueError):
    """`max_cpu_loras` adapters are held already."""


class AdapterRegistry:
    """Loaded adapters by `lora_name`, for a base model of config `cfg` (as stored on the
    mesh) served with rank `max_lora_rank` over `tensor_parallel_size` devices, at most
    `max_cpu_loras` of them."""

    def __init__(self, cfg: ModelConfig, max_lora_rank: int, tensor_parallel_size: int,
                 max_cpu_loras: int):
        self.cfg = cfg
        self.max_lora_rank = max_lora_rank
        self.tensor_parallel_size = tensor_parallel_size
        self.max_cpu_loras = max_cpu_loras
        self._adapters: dict[str, Adapter] = {}
        self._loading: set[str] = set()  # names whose folders are being read
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
        naming what is wrong with the folder, or a name or id already used otherwise;
        `LoRAConflictError` while another load of the name runs; `LoRACapacityError` beyond
        `max_cpu_loras`). `replace`: a name loaded from another folder takes the new one (a
        models-file version whose `lora_path` changed); sequences using the old load finish
        with it."""
        name = request.lora_name
        with self._lock:
            if name in self._loading:
                raise LoRAConflictError(f"the LoRA adapter {name!r} is being loaded by "
                                        "another request; retry once it is done")
            known = self._adapters.get(name)
            if known is not None and not replace:
                if (known.int_id, known.weights.path) != (request.lora_int_id,
                                                          request.lora_path):
                    raise ValueError(f"a LoRA adapter named {name!r} is already loaded from "
                                     f"{known.weights.path!r} (id {known.int_id}); unload "
                                     "it first")
                return known
            clash = next((a for a in self._adapters.values() if a.int_id
                          == request.lora_int_id and a.name != name), None)
            if clash is not None:
                raise ValueError(f"lora_int_id {request.lora_int_id} is already used by the "
                                 f"adapter {clash.name!r}")
            held = len(self._adapters) + len(self._loading)
            if known is None and held >= self.max_cpu_loras:
                raise LoRACapacityError(
                    f"{held} LoRA adapters are loaded or loading, max_cpu_loras="
                    f"{self.max_cpu_loras}; unload one first (or start the server with a "
                    "larger --max-cpu-loras)")
            self._loading.add(name)
        try:
            weights = load_adapter(request.lora_path, self.cfg, self.max_lora_rank,
                                   self.tensor_parallel_size)  # outside the lock: seconds
            adapter = Adapter.loaded(name, request.lora_int_id, weights)
            with self._lock:
                self._adapters[name] = adapter
            return adapter
        finally:
            with self._lock:
                self._loading.discard(name)

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
