"""The Llama-family model: the architecture (`llama`: `LlamaModel`, which calls an attention
function per layer and knows nothing of caches or devices), rotary embeddings (`rope`), the
model config read from a Hugging Face `config.json` (`config`), mixture-of-experts layers
(`moe`, their experts placed on a mesh by `expert_placement`); `contract` says what a forward
takes (`StepContext`) and returns (`ModelOutput`). The dense reference generator the engine's
outputs are tested against is `jaxserve.reference.dense_generation`."""

from jaxserve.model.contract import AttentionFn, ModelOutput, StepContext
from jaxserve.model.llama import LlamaModel

__all__ = ["AttentionFn", "LlamaModel", "ModelOutput", "StepContext"]
