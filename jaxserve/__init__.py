"""jaxserve: an LLM inference runtime in JAX/XLA for TPUs and GPUs.

`from jaxserve import LLM, SamplingParams` is the Python API (shaped like vLLM's). The names
are imported on first use, so the plain-Python parts (`jaxserve.engine.scheduler`, the command
line's `--help`) start without jax.
"""

import importlib

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "LoRARequest",
           "PoolingParams", "__version__"]

# public name → the module that defines it
_MODULES = {"LLM": "jaxserve.llm", "SamplingParams": "jaxserve.sampling_params",
            "RequestOutput": "jaxserve.outputs", "CompletionOutput": "jaxserve.outputs",
            "LoRARequest": "jaxserve.lora.request", "PoolingParams": "jaxserve.pooling.outputs"}


def __getattr__(name: str):
    if name in _MODULES:
        return getattr(importlib.import_module(_MODULES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
