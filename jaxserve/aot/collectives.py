"""The collectives of a compiled program, read from its HLO text: how many instructions of
each kind (all-reduce, all-gather, all-to-all, reduce-scatter, collective-permute) and the
bytes their results hold per device.

A plan reports them per program so a sharding choice can be compared without the hardware
(e.g. tensor-parallel against expert-parallel experts). Counts are static: an instruction
inside a loop body (the scanned layers, the decode loop) is counted once, though it runs on
every iteration.
"""

from __future__ import annotations

import re

KINDS = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute")

# bytes per element of HLO's element types
_ELEMENT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2,
                  "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8,
                  "u64": 8, "f64": 8}
# `%name = <result shape(s)> <kind>(` or its async `<kind>-start(`
_INSTRUCTION = re.compile(r"=\s*(.*?)\s(" + "|".join(KINDS) + r")(?:-start)?\(")
_SHAPE = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")


def _bytes(shapes: str) -> int:
    """Bytes of every array shape written in `shapes` (`f32[8,128]{1,0}`, or a tuple)."""
    total = 0
    for element, dims in _SHAPE.findall(shapes):
        size = _ELEMENT_BYTES.get(element)
        if size is None:
            continue
        for dim in filter(None, dims.split(",")):
            size *= int(dim)
        total += size
    return total


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """`{kind: {"count": n, "bytes": b}}` for each collective kind the program has (an async
    pair counts once, at its start; its result tuple may repeat the operand, so the bytes
    are an upper bound there)."""
    found: dict[str, dict[str, int]] = {}
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.search(line)
        if match is None:
            continue
        shapes, kind = match.groups()
        entry = found.setdefault(kind, {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += _bytes(shapes)
    return found
