"""Training a small model with JAX and optax: the default model that ships with jaxserve.

Needs the `train` extra (`pip install jaxserve[train]`, i.e. optax); inference never imports it.
"""
