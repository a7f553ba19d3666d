"""The layouts the compiled programs take the weights in, and the audit that no program copies
a weight.

XLA decides how an array lies in memory: which axis is minor, and its tiles. An input takes the
platform's default layout unless the program says otherwise, and a program that reads a weight
in another layout copies the whole array first, at every call. For a stack of layers the copy
depends only on the weights, so XLA hoists it out of the decode loop and every layer's copy is
alive at once. XLA:TPU did this for a mixture of experts split column-wise: Qwen3-30B-A3B on
v6e-8 (tp 8) gave each device gate and up stacks 96 columns wide, took them in layout
{2,3,1,0} and read them in the loop in {3,2,1,0}, 3.00 GiB a stack per device, 36 GiB of
temporaries in the decode programs (docs/models.md).

So on TPU the runner lets XLA choose the model's weight layouts for the decode loop, the hot
program (`Layout.AUTO`, in one probe compile of the smallest decode program: `chosen_layouts`),
pins every program to them (`pinned`), and the engine moves the weights into them before the
first runs (`donation_guard.placed_for`). The executable store keeps the probe's result
(`layouts_to_json`), so a warm restart does not compile it again. On CPU and GPU every program
reads the default (row-major) layouts, so nothing is pinned. `weight_copies` counts the copies
a compiled program makes of a whole weight: `jaxserve plan` reports it per program, and the
tests hold it at zero.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.experimental.layout import Format, Layout

from jaxserve.engine.cache_audit import hlo_type, unfused_instructions

# Platforms whose compiler chooses an input's layout by its shape (tiles of 128 lanes), so
# that the default can differ from what a program reads.
PINNED_PLATFORMS = ("tpu",)
_RELAYOUTS = ("copy", "transpose")


def weight_copies(hlo_text: str, weights) -> int:
    """Instructions of a compiled program (its optimized HLO, fused or not: XLA:CPU fuses a
    relayout, XLA:TPU leaves it alone) that copy or transpose an array shaped like one of
    `weights` (a pytree of arrays or `ShapeDtypeStruct`s with shardings, read per device) whole:
    relayouts of a weight. Vectors are not counted (a norm's scale, a bias: one layout)."""
    signatures = {(hlo_type(np.dtype(w.dtype).name), tuple(w.sharding.shard_shape(w.shape)))
                  for w in jax.tree.leaves(weights) if w.ndim >= 2}
    return sum(1 for element, shape, opcode in unfused_instructions(hlo_text, with_fused=True)
               if opcode in _RELAYOUTS and (element, shape) in signatures)


def chosen_layouts(function: Callable, out_shardings, args: list, count: int,
                   platform: str) -> list[Layout | None]:
    """The layouts XLA chooses for the first `count` leaves of `args[0]` (the model's
    weights) when free to choose them, from one compile of `function` (a program, its
    argument 1 donated) for `platform`; None for a leaf the program does not read. `args`
    may be live arrays (a serving engine's) or abstract ones (a plan's): the probe lowers
    against their shapes, as a live array already has a layout and jit refuses AUTO for it."""
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                        args)
    weights = [Format(Layout.AUTO, leaf.sharding) if i < count else leaf.sharding
               for i, leaf in enumerate(args[0])]
    rest = [jax.tree.map(lambda leaf: leaf.sharding, arg) for arg in args[1:]]
    jitted = jax.jit(function, donate_argnums=(1,), out_shardings=out_shardings,
                     in_shardings=(weights, *rest))
    compiled = jitted.trace(*args).lower(lowering_platforms=(platform,)).compile()
    formats = jax.tree.leaves(compiled.input_formats[0][0],
                              is_leaf=lambda node: isinstance(node, Format))
    return [f.layout if f.sharding is not None else None for f in formats[:count]]


def layouts_to_json(layouts: Sequence[Layout | None]) -> list:
    """`layouts` as JSON values (the executable store keeps a probe's result beside the
    programs, so a warm restart does not compile the probe again)."""
    return [None if layout is None else
            {"major_to_minor": list(layout.major_to_minor),
             "tiling": None if layout.tiling is None else [list(t) for t in layout.tiling],
             "sub_byte_element_size_in_bits": layout.sub_byte_element_size_in_bits}
            for layout in layouts]


def layouts_from_json(values: list) -> list[Layout | None]:
    """The inverse of `layouts_to_json` (`ValueError` for a value that is not one)."""
    try:
        return [None if v is None else Layout(
            tuple(v["major_to_minor"]),
            None if v["tiling"] is None else tuple(tuple(t) for t in v["tiling"]),
            int(v["sub_byte_element_size_in_bits"])) for v in values]
    except (KeyError, TypeError) as err:
        raise ValueError(f"not a list of layouts: {err}") from None


def pinned(weights: Sequence, layouts: Sequence[Layout | None]) -> list:
    """`weights` as abstract values carrying `layouts` (per leaf, None: the default) in their
    shardings: what a program is lowered with so that it takes them in those layouts."""
    out = list(weights)
    for i, layout in enumerate(layouts):
        if layout is not None:
            leaf = weights[i]
            out[i] = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                          sharding=Format(layout, leaf.sharding))
    return out
