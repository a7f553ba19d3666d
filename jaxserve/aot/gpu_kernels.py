"""Resources of the Triton kernels in a GPU compile, read from XLA's dump of it.

XLA writes, under `xla_dump_to`, each kernel's PTX (`*.ptx`, one `.entry` per kernel) and the
launch sequence (`*thunk_sequence.txt`: grid, threads and dynamic shared memory per launch).
`ptxas -v` on the PTX gives registers per thread, spills and the stack frame: the numbers
that decide a kernel's occupancy on the card. Only the Pallas kernels are reported (their
names end in `_triton`); XLA's own fusions are XLA's business.
"""

from __future__ import annotations

import re
import shutil
import subprocess
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


def triton_kernel_resources(dump_dir: str | Path) -> list[dict]:
    """One entry per Triton kernel launch of the dumped compile: name, grid, threads,
    shared_memory_bytes, and from ptxas registers and spill bytes (absent without ptxas)."""
    dump = Path(dump_dir)
    launches = {}
    for sequence in dump.glob("*thunk_sequence.txt"):
        for m in _LAUNCH.finditer(sequence.read_text()):
            if m.group(1).endswith(KERNEL_SUFFIX):
                launches[m.group(1)] = {
                    "name": m.group(1),
                    "grid": [int(x) for x in m.group(2).split(",")],
                    "threads": [int(x) for x in m.group(3).split(",")],
                    "shared_memory_bytes": int(m.group(4))}
    ptxas = ptxas_binary()
    if ptxas:
        for ptx in dump.glob("*.ptx"):
            text = ptx.read_text()
            if any(f".entry {name}" in text for name in launches):
                for name, numbers in _ptxas_report(ptx, text, ptxas).items():
                    if name in launches:
                        launches[name].update(numbers)
    return sorted(launches.values(), key=lambda k: k["name"])
