"""Compile-only devices: TPUs and GPUs that XLA can compile for on a machine without them.

A `Target` names an accelerator and a device count (what a preset's `[hardware]` section
says). `compile_only_devices(target)` gives `jax.Device`s of that kind which cannot run
anything but which `jit(...).trace(...).lower(lowering_platforms=...).compile()` compiles for
in full: for TPU, libtpu's topology description (Mosaic compiles the Pallas kernels, XLA:TPU
the rest); for GPU, the CUDA plugin with a `GpuTargetConfigProto` kept as data in
`gpu_targets/` (Triton and ptxas compile the Pallas kernels to the target's SASS).

Needs the `aot` extra (`pip install -e ".[aot]"`): `libtpu` and the CUDA plugin at the
installed jax version. libtpu reads its environment once, when first loaded: the variables
below are set (unless already set) before the first TPU topology is made.

HBM per device, and where each number comes from:
- TPU: what XLA:TPU itself reports as available HBM when a compile does not fit (libtpu
  0.0.42.1: v5e 15.75 GiB, v6e 31.25 GiB, v5p 95.74 GiB), a little under the chips' 16 / 32 /
  95 GiB of Google Cloud's TPU pages. JAX sees one device per chip (v5p: one megacore device).
- GPU: `device_memory_size` of the target config (what the CUDA driver reports for the card).
  JAX's GPU allocator takes `XLA_PYTHON_CLIENT_MEM_FRACTION` of it (default 0.75) at start-up,
  so that is the limit a GPU plan is held to, as `jaxserve serve` would be.
"""

from __future__ import annotations

import dataclasses
import os
import re
from functools import lru_cache
from pathlib import Path

import jax

GPU_TARGETS_DIR = Path(__file__).with_name("gpu_targets")
GIB = 1 << 30

# libtpu's environment for compiling on a host that has no TPU (read once, at load). No chip
# is used, so several processes may plan at once (libtpu otherwise takes a lock file).
TPU_COMPILE_ONLY_ENV = {"TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": "v6e-4",
                        "TPU_WORKER_HOSTNAMES": "localhost", "TPU_WORKER_ID": "0",
                        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
DEFAULT_GPU_MEM_FRACTION = 0.75  # XLA_PYTHON_CLIENT_MEM_FRACTION's default


@dataclasses.dataclass(frozen=True)
class TpuKind:
    """One TPU generation (the key of TPU_KINDS is its topology-name prefix): HBM per chip
    and the topologies known here."""

    hbm_bytes: int
    topologies: dict[int, tuple[str, tuple[int, int, int]]]  # chips → (name, chips per host)


TPU_KINDS = {
    "v5e": TpuKind(int(15.75 * GIB), {1: ("1x1", (1, 1, 1)), 4: ("2x2", (2, 2, 1)),
                                     8: ("2x4", (2, 4, 1))}),
    "v6e": TpuKind(int(31.25 * GIB), {1: ("1x1", (1, 1, 1)), 4: ("2x2", (2, 2, 1)),
                                     8: ("2x4", (2, 4, 1))}),
    "v5p": TpuKind(int(95.74 * GIB), {4: ("2x2x1", (2, 2, 1))}),
}
GPU_KINDS = tuple(sorted(p.stem for p in GPU_TARGETS_DIR.glob("*.txtpb")))


@dataclasses.dataclass(frozen=True)
class Target:
    """An accelerator kind and how many of them: what a plan compiles for."""

    platform: str  # "tpu" | "gpu"
    accelerator: str  # a key of TPU_KINDS or a file stem in gpu_targets/
    devices: int

    def __post_init__(self):
        kinds = TPU_KINDS if self.platform == "tpu" else GPU_KINDS
        if self.platform not in ("tpu", "gpu") or self.accelerator not in kinds:
            raise ValueError(f"accelerator {self.accelerator!r} is not a known {self.platform} "
                             f"kind; known: {list(kinds)}")
        if self.platform == "tpu" and self.devices not in TPU_KINDS[self.accelerator].topologies:
            raise ValueError(f"no {self.accelerator} topology of {self.devices} chips here; "
                             f"known: {sorted(TPU_KINDS[self.accelerator].topologies)}")

    @property
    def lowering_platform(self) -> str:
        """The platform name JAX lowers for ("tpu" or "cuda")."""
        return "cuda" if self.platform == "gpu" else "tpu"

    @property
    def name(self) -> str:
        """e.g. "v6e:2x4" or "NVIDIA H100 80GB HBM3 x8"."""
        if self.platform == "tpu":
            return f"{self.accelerator}:{TPU_KINDS[self.accelerator].topologies[self.devices][0]}"
        description = re.search(r'device_description_str:\s*"([^"]+)"',
                                gpu_target_config(self.accelerator)).group(1)
        return description if self.devices == 1 else f"{description} x{self.devices}"

    def hbm_bytes(self) -> int:
        """Memory one device offers to the engine (see the module docstring)."""
        if self.platform == "tpu":
            return TPU_KINDS[self.accelerator].hbm_bytes
        size = int(re.search(r"device_memory_size:\s*(\d+)",
                             gpu_target_config(self.accelerator)).group(1))
        fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION",
                                        DEFAULT_GPU_MEM_FRACTION))
        return int(size * fraction)


def gpu_target_config(accelerator: str) -> str:
    """The `GpuTargetConfigProto` text of a GPU kind (`gpu_targets/<accelerator>.txtpb`)."""
    return (GPU_TARGETS_DIR / f"{accelerator}.txtpb").read_text()


@lru_cache(maxsize=None)
def compile_only_devices(target: Target) -> tuple[jax.Device, ...]:
    """`target.devices` compile-only devices of the target's kind (needs the `aot` extra)."""
    from jax.experimental import topologies

    from jaxserve.errors import require_extra

    require_extra(["libtpu"] if target.platform == "tpu" else ["jax_plugins.xla_cuda13"],
                  "aot", f"compiling for {target.accelerator} without the hardware")
    try:
        if target.platform == "tpu":
            for name, value in TPU_COMPILE_ONLY_ENV.items():
                os.environ.setdefault(name, value)
            shape, per_host = TPU_KINDS[target.accelerator].topologies[target.devices]
            topology = topologies.get_topology_desc(
                platform="tpu", topology_name=f"{target.accelerator}:{shape}",
                chips_per_host_bounds=per_host)
        else:
            topology = topologies.get_topology_desc(
                target.accelerator, "cuda", target_config=gpu_target_config(target.accelerator),
                topology=f"1x1x{target.devices}")
    except Exception as err:  # a missing plugin surfaces as several error types
        raise RuntimeError(
            f"cannot make compile-only {target.platform} devices ({err}); install the aot "
            "extra: pip install -e \".[aot]\"") from err
    return tuple(topology.devices)
