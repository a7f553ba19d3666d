"""The Llama-family model: the architecture (`llama`: `LlamaModel`, which calls an attention
function per layer and knows nothing of caches or devices), rotary embeddings (`rope`), the
model config read from a Hugging Face `config.json` (`config`), and the dense reference
generator (`dense_generation`, no pages) the engine's outputs are tested against. `contract`
says what a forward takes (`StepContext`) and returns (`ModelOutput`)."""

from jaxserve.model.contract import AttentionFn, ModelOutput, StepContext
from jaxserve.model.llama import LlamaModel

__all__ = ["AttentionFn", "LlamaModel", "ModelOutput", "StepContext"]
