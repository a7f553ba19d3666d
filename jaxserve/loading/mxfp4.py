"""MXFP4 checkpoints (gpt-oss as OpenAI publishes it): the experts' weights as 4-bit floats
in blocks of 32 with a shared power-of-two scale, dequantized as they load.

A weight `W` (gpt-oss keeps experts `[X, in, out]`) is stored as two tensors:
- `<name>_blocks` `[X, out, in / 32, 16]` uint8: two FP4 (e2m1) codes a byte, the low nibble
  the even element, the high nibble the odd one;
- `<name>_scales` `[X, out, in / 32]` uint8: each block's exponent, biased by 127 (e8m0).
An element is `FP4_VALUES[code] * 2 ** (scale - 127)`.

The result is exact in bfloat16 (FP4 values have two significant bits; the scales are
powers of two), so weights are returned in bfloat16 and cast to the model's dtype by the
loader, or quantized again when the model stores int8/fp8 weights. No kernel reads FP4
here: TPUs have no FP4 arithmetic, and a GPU kernel for it is not built.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
SUFFIXES = ("_blocks", "_scales")


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """`blocks` `[X, out, G, 16]` uint8 and `scales` `[X, out, G]` uint8 → the weight
    `[X, G * 32, out]` (in, out) in bfloat16, one expert at a time (the float32 temporaries
    are one expert's)."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.dtype} {list(blocks.shape)} and scales "
                         f"{scales.dtype} {list(scales.shape)} do not pair (uint8 "
                         "[..., G, 16] and [..., G])")
    experts, out_size, groups, _ = blocks.shape
    weight = np.empty((experts, groups * 32, out_size), ml_dtypes.bfloat16)
    for expert in range(experts):
        codes = blocks[expert]  # [out, G, 16]
        values = np.empty(codes.shape[:-1] + (32,), np.float32)  # [out, G, 32]
        values[..., 0::2] = FP4_VALUES[codes & 0x0F]
        values[..., 1::2] = FP4_VALUES[codes >> 4]
        values = np.ldexp(values, scales[expert].astype(np.int32)[..., None] - 127)
        weight[expert] = values.reshape(out_size, -1).T.astype(ml_dtypes.bfloat16)
    return weight


class PackedPairs:
    """Collects each weight's `_blocks` and `_scales` tensors (in whatever order the files
    hold them) and gives the dequantized weight once both arrived."""

    def __init__(self):
        self.parts: dict[str, dict[str, np.ndarray]] = {}

    @staticmethod
    def base_name(name: str) -> str | None:
        """The weight `name` is half of (`...gate_up_proj` for `...gate_up_proj_blocks`),
        or None if it is not an MXFP4 part."""
        return next((name[:-len(s)] for s in SUFFIXES if name.endswith(s)), None)

    def add(self, name: str, array: np.ndarray) -> np.ndarray | None:
        """Keep part `name`; the dequantized weight when its pair is complete, else None."""
        base = self.base_name(name)
        parts = self.parts.setdefault(base, {})
        parts[name[len(base):]] = array
        if len(parts) < 2:
            return None
        del self.parts[base]
        return dequantize(parts["_blocks"], parts["_scales"])
