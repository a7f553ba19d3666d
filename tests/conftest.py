"""Test-wide setup: 8 host CPU devices for mesh tests, set before jax initialises."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
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
