"""Options that several layers read, below all of them (plain Python, no jax): the engine's
(`engine`: `EngineConfig`) and speculative decoding's (`speculative`: `SpeculativeConfig`)."""
