"""What the kernels accept, as plain Python: configuration (jaxserve's `EngineConfig`) checks
its options against these without starting jax. `validation` holds the checks of actual
calls; `kv_quant` maps the KV cache dtype names to dtypes."""

SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_PAGE_SIZES = (16, 32, 64, 128)
# the kv_cache_dtype option's values: the compute dtype, int8 with scales, fp8 e4m3
KV_CACHE_DTYPE_NAMES = ("auto", "int8", "fp8")


def check_kv_cache_dtype(name: str) -> None:
    """`ValueError` naming kv_cache_dtype unless `name` is one of `KV_CACHE_DTYPE_NAMES`."""
    if name not in KV_CACHE_DTYPE_NAMES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPE_NAMES)}, got "
                         f"{name!r}")
