"""What differs between the platforms jaxserve runs on, as properties the engine reads,
instead of `if platform == "cpu"` where a choice is made. Plain Python: the platform's name
comes from the caller or, when asked for, from JAX's default backend.

The attention backend's choice per platform is `jaxserve.attention.make_backend`'s, and how
KV rows fold into TPU lanes is `pallas_kernels.kv_quant.tokens_per_row`'s.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

PRESETS = Path(__file__).with_name("presets")


@dataclasses.dataclass(frozen=True)
class Platform:
    """`scan_layers_by_default`: run the layers as a scan over stacked weights unless the
    user says otherwise (off on CPU, where XLA copies each layer's weights out of the stack
    and a step runs ~2x slower). `restores_cached_programs`: a program JAX's persistent
    compilation cache answered can be serialized into the executable store and run when read
    back (not on CPU, so there the store alone caches programs). `default_preset`: the preset
    used when none is named."""

    name: str
    scan_layers_by_default: bool
    restores_cached_programs: bool
    default_preset: Path | None = None


PLATFORMS = {
    "cpu": Platform("cpu", scan_layers_by_default=False, restores_cached_programs=False,
                    default_preset=PRESETS / "cpu.toml"),
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
