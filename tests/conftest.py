"""Test-wide setup, set before jax initialises: 8 host CPU devices for mesh tests, and
XLA:CPU compiling for speed of compilation. The suite's time is mostly compiling small
programs:
- LLVM at -O0: they compile about a third faster (the engine and speculative tests: 89
  against 131 s on 2 cores) and run about twice as slowly;
- the older elemental emitters instead of XLA:CPU's fusion emitters
  (`--xla_cpu_use_fusion_emitters=false`): a tiny model's two programs compile in 2.5 s,
  not 5.1 s, and the engine's preemption workload takes 11 s, not 18.
No test measures speed (that is the benchmarks' business, and their programs are compiled
as users compile them). TPU and GPU compiles are not affected. The executable store keys
programs by `XLA_FLAGS`, so none compiled here is read by a user's server."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                                   "--xla_backend_optimization_level=0 "
                                   "--xla_cpu_use_fusion_emitters=false")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402  (after the environment above)

from tiny_models import build_model  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random Llama saved as a Hugging Face folder, one per test module (modules that
    need another model define their own `folder`)."""
    path = tmp_path_factory.mktemp("llama")
    build_model("llama", path)
    return path
