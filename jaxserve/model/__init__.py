"""The Llama-family model: the architecture (`llama`: `LlamaModel`, which calls an attention
function per layer and knows nothing of caches or devices), rotary embeddings (`rope`), the
model config read from a Hugging Face `config.json` (`config`), and the dense reference
generator (`dense_generation`, no pages) the engine's outputs are tested against."""

from jaxserve.model.llama import AttentionFn, LlamaModel

__all__ = ["AttentionFn", "LlamaModel"]
