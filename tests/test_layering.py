"""The layering rules of DESIGN.md, checked by importing in a fresh interpreter and reading
`sys.modules` (so an import anywhere down the chain counts, `__init__` files included):

- the plain-Python core (scheduler, page allocator, sequence, batcher, request and sampling
  parameters, engine options, the chat reply parsers) and `jaxserve --help` start no jax,
  flax or torch;
- `pallas_kernels` and `sharding` import neither `jaxserve` nor each other;
- jaxserve's packages (and top-level modules) import only from layers below their own
  (`PACKAGE_ORDER`, read from the source: every import statement counts, those inside
  functions and `TYPE_CHECKING` blocks too), so the import graph has no upward arrows and no
  loops between packages.
"""

import ast
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
              "jaxserve.engine.sequence", "jaxserve.engine.batcher", "jaxserve.config.engine",
              "jaxserve.config.speculative", "jaxserve.config.window", "jaxserve.sampling.arrays",
              "jaxserve.sampling_params", "jaxserve.outputs", "jaxserve.errors",
              "jaxserve.tool_calling", "jaxserve.lora.slots", "jaxserve.lora.request"]


# jaxserve's packages and top-level modules, bottom layer first; a package may import its
# own modules and those of the layers below it, never one beside or above it.
PACKAGE_ORDER = [
    {"errors", "platforms", "default_model", "fixed_order"},  # fixed_order: jax only
    {"structured_output"},
    {"sampling_params", "tool_calling"},
    {"outputs", "config"},  # config: engine and speculative options, the window layout
    {"model", "sampling"},  # sampling: the on-device sampler
    {"loading"},
    {"lora"},
    {"attention"},
    {"speculative"},
    {"engine"},  # with the async engine and the Prometheus metrics
    {"presets"},
    {"pooling"},  # embeddings and scores: the pooling runner beside the engine
    {"llm"},
    {"fleet"},
    {"server"},
    {"aot", "reference"},  # reference: the eager dense generator and dense attention
    {"training"},
    {"bench"},
    {"cli"},
    {"__init__"},  # `jaxserve` itself: the public API
]


def import_arrows() -> list[tuple[str, str, str]]:
    """(importing package, imported package, file) for every import between two of
    jaxserve's packages or top-level modules."""
    root = ROOT / "jaxserve"
    arrows = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        source = relative.parts[0] if len(relative.parts) > 1 else relative.stem
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            targets = {name.split(".")[1] for name in names
                       if name.startswith("jaxserve.") and len(name.split(".")) > 1}
            arrows += [(source, target, str(relative)) for target in targets
                       if target != source and ((root / target).is_dir()
                                                or (root / f"{target}.py").is_file())]
    return arrows


def test_packages_import_only_the_layers_below():
    layer = {name: rank for rank, names in enumerate(PACKAGE_ORDER) for name in names}
    arrows = import_arrows()
    unplaced = {name for arrow in arrows for name in arrow[:2]} - set(layer)
    assert not unplaced, f"packages missing from PACKAGE_ORDER: {sorted(unplaced)}"
    upward = sorted({f"{path}: {source} -> {target}" for source, target, path in arrows
                     if layer[target] >= layer[source]})
    assert not upward, "imports that do not point down the layers:\n" + "\n".join(upward)


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
