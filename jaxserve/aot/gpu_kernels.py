"""Resources of the Triton kernels in a GPU compile, read from XLA's dump of it.

XLA writes, under `xla_dump_to`, each kernel's PTX (`*.ptx`, one `.entry` per kernel) and the
launch sequence (`*thunk_sequence.txt`: grid, threads and dynamic shared memory per launch).
`ptxas -v` on the PTX gives registers per thread, spills and the stack frame: the numbers
that decide a kernel's occupancy on the card. `triton_kernel_resources` reports only the
Pallas kernels (their names end in `_triton`); `kernel_launches` lists every launch, XLA's
fusions too, in order: what a step costs in launches.

`python -m jaxserve.aot.gpu_kernels --batch 1` compiles the decode attention call
(`pallas_kernels.paged_attention`, Llama-8B's heads by default) for a GPU on this machine
(the `aot` extra) and prints its launches and grids (docs/kernels.md, "Launches per call").
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

KERNEL_SUFFIX = "_triton"
_LAUNCH = re.compile(r"\] (\S+) grid: \[([\d, ]+)\] threads: \[([\d, ]+)\]\s+shared_memory: "
                     r"(\d+) bytes")
_FUNCTION = re.compile(r"Compiling entry function '(\S+)' for '(\S+)'")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill")
_REGISTERS = re.compile(r"Used (\d+) registers")


def ptxas_binary() -> str | None:
    """`ptxas` from PATH or from the nvidia-cuda-nvcc wheel (the `aot` extra)."""
    found = shutil.which("ptxas")
    if found:
        return found
    try:
        import nvidia.cuda_nvcc as nvcc  # type: ignore[import-not-found]
    except ImportError:
        return None
    for root in map(Path, nvcc.__path__):
        candidate = root / "bin" / "ptxas"
        if candidate.is_file():
            return str(candidate)
    return None


def _ptxas_report(ptx: Path, text: str, ptxas: str) -> dict[str, dict]:
    """Entry name → {arch, registers, spill_store_bytes, spill_load_bytes, stack_bytes} of
    the PTX file `ptx` (whose contents are `text`)."""
    arch = re.search(r"^\.target\s+(\S+)", text, re.M)
    done = subprocess.run([ptxas, "-v", f"--gpu-name={arch.group(1) if arch else 'sm_90a'}",
                           str(ptx), "-o", "/dev/null"], capture_output=True, text=True)
    found: dict[str, dict] = {}
    current = None
    for line in (done.stdout + done.stderr).splitlines():
        if m := _FUNCTION.search(line):
            current = found.setdefault(m.group(1), {"arch": m.group(2)})
        elif current is not None and (m := _SPILLS.search(line)):
            current.update(stack_bytes=int(m.group(1)), spill_store_bytes=int(m.group(2)),
                           spill_load_bytes=int(m.group(3)))
        elif current is not None and (m := _REGISTERS.search(line)):
            current["registers"] = int(m.group(1))
    return found


def kernel_launches(dump_dir: str | Path) -> list[dict]:
    """Every kernel launch of the dumped compile, in launch order: name, grid, threads,
    shared_memory_bytes (XLA's fusions and the Pallas kernels alike)."""
    launches = []
    for sequence in sorted(Path(dump_dir).glob("*thunk_sequence.txt")):
        for m in _LAUNCH.finditer(sequence.read_text()):
            launches.append({"name": m.group(1),
                             "grid": [int(x) for x in m.group(2).split(",")],
                             "threads": [int(x) for x in m.group(3).split(",")],
                             "shared_memory_bytes": int(m.group(4))})
    return launches


def triton_kernel_resources(dump_dir: str | Path) -> list[dict]:
    """One entry per Triton kernel launch of the dumped compile: name, grid, threads,
    shared_memory_bytes, and from ptxas registers and spill bytes (absent without ptxas)."""
    dump = Path(dump_dir)
    launches = {k["name"]: k for k in kernel_launches(dump) if k["name"].endswith(KERNEL_SUFFIX)}
    ptxas = ptxas_binary()
    if ptxas:
        for ptx in dump.glob("*.ptx"):
            text = ptx.read_text()
            if any(f".entry {name}" in text for name in launches):
                for name, numbers in _ptxas_report(ptx, text, ptxas).items():
                    if name in launches:
                        launches[name].update(numbers)
    return sorted(launches.values(), key=lambda k: k["name"])


def decode_launches(accelerator: str, batch: int, q_heads: int, kv_heads: int, head_dim: int,
                    page_size: int, max_model_len: int) -> list[dict]:
    """The launches of one bfloat16 decode attention call (`paged_attention`) compiled for
    `accelerator` (a `targets.GPU_KINDS` name) with a page table max_model_len wide."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import pallas_kernels as pk
    from jaxserve.aot.targets import Target, compile_only_devices

    mesh = Mesh(np.array(compile_only_devices(Target("gpu", accelerator, 1))), ("x",))
    sharding = NamedSharding(mesh, PartitionSpec())
    pages_per_seq = -(-max_model_len // page_size)
    pages = jax.ShapeDtypeStruct((batch * pages_per_seq + 1, page_size, kv_heads * head_dim),
                                 jnp.bfloat16, sharding=sharding)  # [N, page_size, Hkv * D]
    args = (jax.ShapeDtypeStruct((batch, q_heads, head_dim), jnp.bfloat16, sharding=sharding),
            pages, pages, jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=sharding),
            jax.ShapeDtypeStruct((batch, pages_per_seq), jnp.int32, sharding=sharding))
    lowered = jax.jit(pk.paged_attention).trace(*args).lower(lowering_platforms=("cuda",))
    with tempfile.TemporaryDirectory(prefix="jaxserve-launches-") as dump:
        lowered.compile({"xla_dump_to": dump})
        return kernel_launches(dump)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Kernel launches of one decode attention call "
                                            "compiled for a GPU (no GPU needed).")
    p.add_argument("--accelerator", default="h100")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=32768)
    a = p.parse_args(argv)
    launches = decode_launches(a.accelerator, a.batch, a.q_heads, a.kv_heads, a.head_dim,
                               a.page_size, a.max_model_len)
    print(f"{len(launches)} launches, batch {a.batch}, {a.q_heads}/{a.kv_heads} heads of "
          f"{a.head_dim}, pages of {a.page_size}, {a.accelerator}:")
    for k in launches:
        programs = k["grid"][0] * k["grid"][1] * k["grid"][2]
        print(f"  {k['name']:32s} grid {k['grid']} = {programs} programs x "
              f"{k['threads'][0]} threads, {k['shared_memory_bytes']} B shared")


if __name__ == "__main__":
    main()
