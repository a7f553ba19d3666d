"""Sampling below the engine and speculation, which both sample: each row's settings as
arrays (`arrays`, plain numpy) and the on-device sampler (`sampler`)."""
