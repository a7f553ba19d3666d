"""The Llama-family model: architecture (`llama`) and rotary embeddings (`rope`)."""

from jaxserve.model.llama import AttentionFn, LlamaModel

__all__ = ["AttentionFn", "LlamaModel"]
