"""The eager references the engine is tested against, at the top of the layers: the dense
generator (`dense_generation`, no pages) and its attention over contiguous per-row caches
(`dense_attention`, also what training runs)."""
