"""The layering rules of DESIGN.md, checked by importing in a fresh interpreter and reading
`sys.modules` (so an import anywhere down the chain counts, `__init__` files included):

- the plain-Python core (scheduler, page allocator, sequence, batcher, request and sampling
  parameters, engine options, the chat reply parsers) and `jaxserve --help` start no jax,
  flax or torch;
- `pallas_kernels` and `sharding` import neither `jaxserve` nor each other.
"""

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick  # seconds, no engine: `pytest -m quick`

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("jax", "jaxlib", "flax", "torch")
PLAIN_CORE = ["jaxserve.engine.scheduler", "jaxserve.engine.page_allocator",
              "jaxserve.engine.window_pages",
              "jaxserve.engine.sequence", "jaxserve.engine.batcher", "jaxserve.engine.config",
              "jaxserve.sampling_params", "jaxserve.outputs", "jaxserve.errors",
              "jaxserve.tool_calling", "jaxserve.lora.slots", "jaxserve.lora.request"]


def loaded_packages(code: str) -> set[str]:
    """Top-level packages in `sys.modules` after `code` runs in a fresh interpreter."""
    probe = (f"{code}\nimport json, sys\n"
             "print(json.dumps(sorted({name.split('.')[0] for name in sys.modules})))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.splitlines()[-1]))


@pytest.mark.parametrize("module", PLAIN_CORE)
def test_plain_core_starts_no_jax(module):
    assert loaded_packages(f"import {module}") & set(HEAVY) == set()


def test_the_engine_loads_llguidance_only_for_structured_output():
    """A deployment image without llguidance serves unconstrained requests: the engine and
    the Python API import it on the first grammar, not before."""
    loaded = loaded_packages("import jaxserve.engine.engine, jaxserve.llm, "
                             "jaxserve.sampling_params")
    assert "llguidance" not in loaded
    assert "llguidance" in loaded_packages("from jaxserve.structured_output import "
                                           "GrammarCompiler")


def test_cli_help_starts_no_jax():
    code = ("import contextlib, io\nfrom jaxserve.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "    main(['--help'])")
    assert loaded_packages(code) & set(HEAVY) == set()


@pytest.mark.parametrize("package, forbidden", [("pallas_kernels", {"jaxserve", "sharding"}),
                                                ("sharding", {"jaxserve", "pallas_kernels"})])
def test_kernels_and_sharding_stand_alone(package, forbidden):
    modules = [f"{package}.{m.name}" for m in pkgutil.iter_modules([str(ROOT / package)])]
    assert len(modules) > 2
    assert loaded_packages("\n".join(f"import {m}" for m in modules)) & forbidden == set()
