"""Options that several layers read, below all of them (plain Python, no jax): the engine's
(`engine`: `EngineConfig`), speculative decoding's (`speculative`: `SpeculativeConfig`) and
hybrid KV memory's window pool (`window`: `WindowLayout`)."""
