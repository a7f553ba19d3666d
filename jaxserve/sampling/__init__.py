"""The on-device sampler (`sampler`), below the engine and speculation, which both sample."""
