"""What a client may load while the server runs (`POST /v1/load_lora_adapter`), as the
operator allows it.

Runtime loading and unloading is off unless the operator turns it on, as vLLM keeps it
behind `VLLM_ALLOW_RUNTIME_LORA_UPDATING`: a client that may load adapters can otherwise fill
the disk, read any folder the server can, and grow host memory. When it is on, a
`lora_path` must be a folder under one of `allowed_roots` (symlinks and `..` resolved before
the check), or, if `allow_hub`, a Hugging Face Hub id (fetched with the server's token, so
any repository that token reads). A refused path gets one answer whether it exists or not.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from jaxserve.loading.hub import split_hub_id
from jaxserve.lora.adapter import hub_adapter_folder

ENV_VAR = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's opt-in, taken as it spells it


def env_allows_runtime_updating(environ=os.environ) -> bool:
    """Whether `VLLM_ALLOW_RUNTIME_LORA_UPDATING` turns runtime loading on ("1" or "true", as
    vLLM reads it)."""
    return environ.get(ENV_VAR, "").strip().lower() in ("1", "true")


@dataclasses.dataclass(frozen=True)
class RuntimeLoRAUpdating:
    """The operator's leave for runtime adapter loads: folders under `allowed_roots`, and
    Hub ids if `allow_hub`."""

    allowed_roots: tuple[str, ...] = ()
    allow_hub: bool = False

    def __post_init__(self):
        if not self.allowed_roots and not self.allow_hub:
            raise ValueError("runtime LoRA updating needs somewhere adapters may come from: "
                             "--lora-allowed-roots DIR [DIR ...] and/or --lora-allow-hub")
        for root in self.allowed_roots:
            if not Path(root).is_dir():
                raise ValueError(f"--lora-allowed-roots: {root!r} is not a folder")

    def resolve(self, lora_path: str) -> str:
        """The folder to load for a client's `lora_path`: the real path of a folder under an
        allowed root, or, when Hub ids are allowed, the snapshot of one (its config fetched
        and checked before its weights; `jaxserve.lora.adapter.hub_adapter_folder`).
        `ValueError` otherwise, the same whether the path exists or not."""
        try:
            real = Path(lora_path).expanduser().resolve()
        except (OSError, RuntimeError):  # a symlink loop
            real = None
        if real is not None and any(real.is_relative_to(Path(root).resolve())
                                    for root in self.allowed_roots):
            return str(real)
        if self.allow_hub and split_hub_id(lora_path) is not None:
            return str(hub_adapter_folder(lora_path))  # never a local folder of that name
        allowed = []
        if self.allowed_roots:
            allowed.append("a folder under the allowed roots (--lora-allowed-roots)")
        if self.allow_hub:
            allowed.append("a Hugging Face Hub id ORG/NAME[@REVISION]")
        raise ValueError(f"lora_path must be {' or '.join(allowed)}")
