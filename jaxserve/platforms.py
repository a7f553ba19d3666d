"""What differs between the platforms jaxserve runs on, as properties the engine reads,
instead of `if platform == "cpu"` where a choice is made. Plain Python: the platform's name
comes from the caller or, when asked for, from JAX's default backend.

The attention backend's choice per platform is `jaxserve.attention.make_backend`'s, and how
KV rows fold into TPU lanes is `pallas_kernels.kv_quant.tokens_per_row`'s.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import sys
from pathlib import Path

PRESETS = Path(__file__).with_name("presets")
# Device files of each accelerator kind: (the JAX platform, globs, any of which present).
DEVICE_FILES = (("tpu", ("/dev/accel[0-9]*", "/dev/vfio/[0-9]*")),
                ("cuda", ("/dev/nvidia[0-9]*",)),
                ("rocm", ("/dev/kfd",)))


@dataclasses.dataclass(frozen=True)
class Platform:
    """`scan_layers_by_default`: run the layers as a scan over stacked weights unless the
    user says otherwise (off on CPU, where XLA copies each layer's weights out of the stack
    and a step runs ~2x slower). `restores_cached_programs`: a program JAX's persistent
    compilation cache answered can be serialized into the executable store and run when read
    back (not on CPU, so there the store alone caches programs). `default_preset`: the preset
    used when none is named. `quick_compile_options`: XLA options that compile a program
    much sooner and run it slower, for the first programs of a server that compiles the rest
    in the background and swaps these for full ones (`jaxserve.engine.background_compile`):
    on CPU LLVM at -O0 (about a third of a full compile) with XLA:CPU's older elemental
    emitters instead of its fusion emitters (about 40% less again), for slower steps
    (docs/performance.md)."""

    name: str
    scan_layers_by_default: bool
    restores_cached_programs: bool
    default_preset: Path | None = None
    quick_compile_options: tuple[tuple[str, object], ...] = ()


PLATFORMS = {
    "cpu": Platform("cpu", scan_layers_by_default=False, restores_cached_programs=False,
                    default_preset=PRESETS / "cpu.toml",
                    quick_compile_options=(("xla_backend_optimization_level", 0),
                                           ("xla_cpu_use_fusion_emitters", False))),
    "tpu": Platform("tpu", scan_layers_by_default=True, restores_cached_programs=True),
    "gpu": Platform("gpu", scan_layers_by_default=True, restores_cached_programs=True),
}


def platform(name: str | None = None) -> Platform:
    """The platform called `name` ("cuda" and "rocm" are "gpu"), or JAX's default backend's."""
    if name is None:
        import jax

        name = jax.default_backend()
    name = "gpu" if name in ("cuda", "rocm") else name
    if name not in PLATFORMS:
        raise ValueError(f"platform must be one of {list(PLATFORMS)}, got {name!r}")
    return PLATFORMS[name]


def host_jax_platforms() -> str:
    """The JAX platforms this host can run, from its device files: "tpu,cpu", "cuda,cpu",
    "rocm,cpu" or "cpu". The command line sets it (unless `JAX_PLATFORMS` is set) so that a
    CPU machine with the `aot` extra installed does not probe libtpu and the CUDA plugin and
    print their failures, while an accelerator that is present and fails still fails loudly."""
    for name, patterns in DEVICE_FILES:
        if any(glob.glob(pattern) for pattern in patterns):
            return f"{name},cpu"
    return "cpu"


def choose_jax_platforms() -> None:
    """Point JAX at `host_jax_platforms()` unless the user named platforms already."""
    if os.environ.get("JAX_PLATFORMS"):
        return
    os.environ["JAX_PLATFORMS"] = host_jax_platforms()
    jax = sys.modules.get("jax")
    if jax is not None and not jax.config.jax_platforms:  # imported before the choice
        jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])
