"""Start-up checks, on the device itself, that a compiled program updates the KV cache in place.

The compile-only plan reads donation from `memory_analysis()` (`cache_audit`): the cache's
input is aliased to its output. That holds for the executable, not for the call: if the
arrays handed to it are placed otherwise than it expects (another sharding, another layout),
JAX may copy them before the call, and the copy is what gets donated, so every step holds a
second cache (the first lent H100 ran out of memory this way, one page pool short). So before
the first runs the engine moves the cache into the layout the programs take (`with_layouts`)
and checks every argument's placement (`check_placement`), and around each program's first
run that the cache really went (`check_donated`). A failed check stops start-up, naming the
program and the argument.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax


def _leaves_with_names(name: str, tree) -> list[tuple[str, object]]:
    """(`name` plus the leaf's path, leaf) for every leaf of `tree`."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(name + jax.tree_util.keystr(path), leaf) for path, leaf in flat]


def check_placement(program: str, compiled: jax.stages.Compiled, args: Sequence,
                    checked: dict[int, str]) -> None:
    """Raise `RuntimeError` naming `program` and the argument when a device array in
    `args[i]` (for each `i` of `checked`, named `checked[i]`) has a sharding or a layout other
    than `compiled`'s input sharding and format for it. Host arrays and abstract values
    (placed by the call itself) and arrays the program does not read (no sharding: XLA
    dropped the parameter) are not checked."""
    formats = compiled.input_formats[0]  # per positional argument, a pytree like it
    for index, name in checked.items():
        wanted = jax.tree.leaves(formats[index])
        given = _leaves_with_names(name, args[index])
        if len(wanted) != len(given):
            raise RuntimeError(f"the {program} program takes {len(wanted)} arrays as "
                               f"{name}, and {len(given)} were allocated")
        for (path, array), expected in zip(given, wanted):
            if not isinstance(array, jax.Array) or expected.sharding is None:
                continue  # placed by the call, or not used by the program
            if not array.sharding.is_equivalent_to(expected.sharding, array.ndim):
                raise RuntimeError(
                    f"{path} is placed as {array.sharding}, and the {program} program "
                    f"expects {expected.sharding}: JAX would copy it at every call")
            layout = array.format.layout
            if expected.layout is not None and layout != expected.layout:
                raise RuntimeError(
                    f"{path} has the layout {layout}, and the {program} program expects "
                    f"{expected.layout}: JAX would copy it at every call")


def with_layouts(compiled: jax.stages.Compiled, index: int, tree):
    """`tree`, `compiled`'s argument `index` (device arrays), with every array whose layout
    differs from the program's input format moved into that format (the old array donated).
    XLA may choose a parameter's layout itself (XLA:TPU did for a mixture of experts'
    weights 96 columns wide a device, docs/plans.md): an array allocated in the default
    layout would then be refused, or copied before every call."""
    formats = jax.tree.leaves(compiled.input_formats[0][index])
    leaves, treedef = jax.tree.flatten(tree)
    placed = [jax.device_put(array, wanted, donate=True)
              if wanted.layout is not None and array.format.layout != wanted.layout else array
              for array, wanted in zip(leaves, formats)]
    return jax.tree.unflatten(treedef, placed)


def placed_for(programs: dict[tuple[str, int, int], jax.stages.Compiled], weights, caches):
    """(`weights`, `caches`) in the layouts the compiled `programs` (by bucket) take
    (`with_layouts`, after the first; on TPU the weights' are pinned, see
    `jaxserve.engine.weight_layouts`), checked against every program (`check_placement`:
    the programs' arguments 0 and 1)."""
    if programs:
        first = next(iter(programs.values()))
        weights = with_layouts(first, 0, weights)
        caches = with_layouts(first, 1, caches)
    for (kind, tokens, rows), compiled in programs.items():
        check_placement(f"{kind} ({tokens} tokens, {rows} rows)", compiled, [weights, caches],
                        {0: "weights", 1: "caches"})
    return weights, caches


def _live_bytes(signatures: set[tuple[tuple[int, ...], str]]) -> int:
    """Bytes of the process's live device arrays of the given (shape, dtype)s."""
    return sum(a.nbytes for a in jax.live_arrays()
               if (a.shape, str(a.dtype)) in signatures)


def read_arrays(compiled: jax.stages.Compiled, index: int) -> list[bool]:
    """Per leaf of `compiled`'s argument `index`, whether the program reads it (XLA drops a
    parameter it does not read, and JAX then leaves a donated array of it alive)."""
    return [f.sharding is not None for f in jax.tree.leaves(compiled.input_formats[0][index])]


def check_donated(program: str, run: Callable[[], object], name: str, donated,
                  read: Sequence[bool] | None = None) -> None:
    """`run()` (one call of `program` with `donated`, a pytree of device arrays given as its
    argument `name`, and everything it returns waited on), then raise `RuntimeError` naming
    `program` and the array when a donated array it reads (`read`, per leaf; default all)
    is still alive afterwards, or when the live arrays shaped like them grew by one of them
    or more (a copy kept beside the cache)."""
    leaves = _leaves_with_names(name, donated)
    if read is not None:
        leaves = [leaf for leaf, used in zip(leaves, read) if used]
    arrays = [leaf for _, leaf in leaves]
    signatures = {(a.shape, str(a.dtype)) for a in arrays}
    before = _live_bytes(signatures)
    run()
    kept = [path for path, array in leaves if not array.is_deleted()]
    if kept:
        device = next(iter(arrays[0].sharding.device_set))
        raise RuntimeError(
            f"the {program} program did not update {name} in place on {device.device_kind} "
            f"(jax {jax.__version__}): {len(kept)} of its {len(leaves)} donated arrays "
            f"survived its first run, e.g. {kept}; every step would allocate a second "
            "cache")
    grown = _live_bytes(signatures) - before
    smallest = min(a.nbytes for a in arrays)
    if grown >= smallest:
        raise RuntimeError(
            f"after the first run of the {program} program, {grown} more bytes of arrays "
            f"shaped like {name} are alive (one of them is {smallest} bytes): it keeps a copy "
            "of the cache")
