"""jaxserve: an LLM inference runtime in JAX/XLA for TPUs and GPUs.

`from jaxserve import LLM, SamplingParams` is the Python API (shaped like vLLM's).
"""

from jaxserve.llm import LLM
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
