"""Micro-benchmark: `python -m pallas_kernels.bench [flags]`.

Times decode (`paged_attention`), a ragged batch (`ragged_paged_attention`, each
sequence contributing --q-len new tokens) and `write_kv` on the default device
with the default backend dispatch (Mosaic on TPU, Triton on GPU, interpret mode
on CPU: expect CPU numbers to be meaningless for speed, it only proves the path
runs). Reports time per call, achieved GB/s of K/V bytes read (written, for
write_kv) and, with --peak-gbps, the percentage of that peak.
For the issue's targets and an anchor (JAX's own Pallas kernels on the same inputs) run
`python -m pallas_kernels.device_check` instead; this is for one shape at a time.
"""

import argparse
import time

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from pallas_kernels import kv_quant


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4, help="sequences")
    p.add_argument("--context", type=int, default=256, help="kv length of every sequence")
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--q-len", type=int, default=4, help="new tokens per sequence (ragged)")
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--peak-gbps", type=float, default=None, help="device peak HBM GB/s")
    p.add_argument("--kernels", default="decode,ragged,write_kv")
    p.add_argument("--backend", choices=pk.BACKENDS, default=None)
    p.add_argument("--interpret", action="store_true", help="force Pallas interpret mode")
    return p.parse_args(argv)


def time_call(fn, args, iterations):
    """Seconds per call of jitted fn after one warm-up (compile) call."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(iterations):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / iterations


def report(name, seconds, nbytes, peak_gbps):
    gbps = nbytes / seconds / 1e9
    line = f"{name:10s} {seconds * 1e6:12.1f} us/call {gbps:10.2f} GB/s"
    if peak_gbps:
        line += f" {100 * gbps / peak_gbps:6.1f}% of {peak_gbps:g} GB/s"
    print(line, flush=True)


def main(argv=None):
    a = parse_args(argv)
    dtype = jnp.dtype(a.dtype)
    pages_per_seq = -(-a.context // a.page_size)
    num_pages = a.batch * pages_per_seq + 1  # page 0: padding page
    key = jax.random.split(jax.random.key(0), 4)
    cache_shape = kv_quant.page_shape(num_pages, a.page_size, a.kv_heads, a.head_dim)
    k_pages = jax.random.normal(key[0], cache_shape, dtype)  # [N, page_size, Hkv * D]
    v_pages = jax.random.normal(key[1], cache_shape, dtype)  # [N, page_size, Hkv * D]
    page_indices = (1 + jnp.arange(a.batch * pages_per_seq, dtype=jnp.int32)).reshape(
        a.batch, pages_per_seq)  # [B, P]
    kv_lens = jnp.full((a.batch,), a.context, jnp.int32)  # [B]
    kv_bytes = 2 * a.batch * a.context * a.kv_heads * a.head_dim * dtype.itemsize
    opts = dict(backend=a.backend, interpret=a.interpret or None)
    print(f"device={jax.devices()[0].device_kind} batch={a.batch} context={a.context} "
          f"heads={a.heads}/{a.kv_heads} head_dim={a.head_dim} page_size={a.page_size} "
          f"dtype={a.dtype} K/V bytes={kv_bytes / 1e6:.1f} MB", flush=True)
    kernels = a.kernels.split(",")
    if "decode" in kernels:
        q = jax.random.normal(key[2], (a.batch, a.heads, a.head_dim), dtype)  # [B, Hq, D]
        fn = jax.jit(lambda *x: pk.paged_attention(*x, **opts))
        seconds = time_call(fn, (q, k_pages, v_pages, kv_lens, page_indices), a.iterations)
        report("decode", seconds, kv_bytes, a.peak_gbps)
    if "ragged" in kernels:
        num_tokens = a.batch * a.q_len
        q = jax.random.normal(key[2], (num_tokens, a.heads, a.head_dim), dtype)  # [T, Hq, D]
        cu_q_lens = jnp.arange(a.batch + 1, dtype=jnp.int32) * a.q_len  # [B + 1]
        num_seqs = jnp.array([a.batch], jnp.int32)  # [1]
        fn = jax.jit(lambda *x: pk.ragged_paged_attention(*x, **opts))
        args = (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
        report("ragged", time_call(fn, args, a.iterations), kv_bytes, a.peak_gbps)
    if "write_kv" in kernels:
        new = jax.random.normal(key[3], (a.batch, a.kv_heads, a.head_dim), dtype)  # [B, Hkv, D]
        slots = page_indices[:, -1] * a.page_size  # [B] first slot of each last page
        # Donated, as in serving: each call updates the cache it was given in place.
        fn = jax.jit(pk.write_kv, donate_argnums=(0, 1))
        caches = jax.block_until_ready(fn(k_pages, v_pages, new, new, slots))
        start = time.perf_counter()
        for _ in range(a.iterations):
            caches = fn(*caches, new, new, slots)
        jax.block_until_ready(caches)
        seconds = (time.perf_counter() - start) / a.iterations
        report("write_kv", seconds, 2 * new.size * dtype.itemsize, a.peak_gbps)


if __name__ == "__main__":
    main()
