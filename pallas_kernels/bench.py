"""Micro-benchmark: `python -m pallas_kernels.bench [flags]`.

Times decode (`paged_attention`), a ragged batch (`ragged_paged_attention`, each
sequence contributing --q-len new tokens) and `write_kv` on the default device
with the default backend dispatch (Mosaic on TPU, Triton on GPU, interpret mode
on CPU: expect CPU numbers to be meaningless for speed, it only proves the path
runs). Reports time per call, achieved GB/s of K/V bytes read (written, for
write_kv) and, with --peak-gbps, the percentage of that peak.

Attention is timed on the device (`time_chained`): one program calls the kernel n times in a
loop, each call's output the next call's query, as a model's layers follow each other, so
the host's dispatch of a program (tens of microseconds, more than a batch-1 call takes) is
not inside the per-call figure. `--kernels goal` times the issue's target row, batch 1 at
2,048 keys with Llama-8B's heads (32 query, 8 kv, head_dim 128), against GOAL_US.
For the issue's targets and an anchor (JAX's own Pallas kernels on the same inputs) run
`python -m pallas_kernels.device_check` instead; this is for one shape at a time.
"""

import argparse
import time

import numpy as np

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from pallas_kernels import kv_quant

GOAL_US = 10.0  # a batch-1, 2,048-key decode attention call per layer on an H100 (issue 57)
GOAL_SHAPE = dict(batch=1, context=2048, heads=32, kv_heads=8, head_dim=128)
CHAIN_UNROLL = 8  # calls per loop iteration, so a loop's own step is shared by 8 calls


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
    p.add_argument("--iterations", type=int, default=32,
                   help="calls per timed program (decode, ragged); host-looped write_kv calls")
    p.add_argument("--peak-gbps", type=float, default=None, help="device peak HBM GB/s")
    p.add_argument("--kernels", default="decode,ragged,write_kv",
                   help="comma-separated: decode, ragged, write_kv, goal (the issue's row: "
                        "batch 1, 2,048 keys, against GOAL_US; device_check times it too)")
    p.add_argument("--backend", choices=pk.BACKENDS, default=None)
    p.add_argument("--interpret", action="store_true", help="force Pallas interpret mode")
    return p.parse_args(argv)


def time_call(fn, args, iterations):
    """Seconds per call of jitted fn after one warm-up (compile) call, calls dispatched from
    the host one by one (their dispatch is inside the figure: for calls of milliseconds)."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(iterations):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / iterations


def time_chained(fn, carry, rest, iterations, repeats=3):
    """Seconds per call of fn(carry, *rest) -> next carry (same shape and dtype), timed on
    the device: programs that call fn n and 2n times in a `fori_loop` (CHAIN_UNROLL calls per
    step where n is a multiple of it), each call's output the next one's input so none can
    be skipped or hoisted. Per call: (best time of 2n - best time of n) / n, so one
    program's dispatch, launch and sync cancel out and only the calls remain; where noise
    outweighs the calls (a loaded CPU), best time of 2n / 2n, an upper bound."""
    n = max(1, iterations)

    def best(count):
        unroll = CHAIN_UNROLL if count % CHAIN_UNROLL == 0 else 1
        loop = jax.jit(lambda c, *r: jax.lax.fori_loop(
            0, count, lambda i, c: fn(c, *r), c, unroll=unroll))
        jax.block_until_ready(loop(carry, *rest))  # compile, warm up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(loop(carry, *rest))
            times.append(time.perf_counter() - start)
        return min(times)

    once, twice = best(n), best(2 * n)
    return (twice - once) / n if twice > once else twice / (2 * n)


def decode_inputs(batch, context, heads, kv_heads, head_dim, page_size, dtype, key):
    """Random decode inputs, every sequence `context` keys on its own pages (page 0 unused):
    (q [B, Hq, D], k_pages, v_pages [N, page_size, Hkv * D], kv_lens [B], page_indices
    [B, P]) and the K/V bytes a call reads."""
    pages_per_seq = -(-context // page_size)
    num_pages = batch * pages_per_seq + 1
    keys = jax.random.split(key, 3)
    cache_shape = kv_quant.page_shape(num_pages, page_size, kv_heads, head_dim)
    k_pages = jax.random.normal(keys[0], cache_shape, dtype)  # [N, page_size, Hkv * D]
    v_pages = jax.random.normal(keys[1], cache_shape, dtype)  # [N, page_size, Hkv * D]
    page_indices = (1 + jnp.arange(batch * pages_per_seq, dtype=jnp.int32)).reshape(
        batch, pages_per_seq)  # [B, P]
    kv_lens = jnp.full((batch,), context, jnp.int32)  # [B]
    q = jax.random.normal(keys[2], (batch, heads, head_dim), dtype)  # [B, Hq, D]
    kv_bytes = 2 * batch * context * kv_heads * head_dim * jnp.dtype(dtype).itemsize
    return (q, k_pages, v_pages, kv_lens, page_indices), kv_bytes


def goal_rows(page_sizes=(16, 32), iterations=32, **opts):
    """The issue's target row (GOAL_SHAPE, bfloat16) at each page size: dicts of page_size,
    us, goal_us and meets_goal, the call timed on the device (`time_chained`)."""
    rows = []
    for page_size in page_sizes:
        args, _ = decode_inputs(page_size=page_size, dtype=jnp.bfloat16,
                                key=jax.random.key(0), **GOAL_SHAPE)
        seconds = time_chained(lambda q, *r: pk.paged_attention(q, *r, **opts), args[0],
                               args[1:], iterations)
        us = float(np.round(seconds * 1e6, 2))
        rows.append(dict(GOAL_SHAPE, page_size=page_size, us=us, goal_us=GOAL_US,
                         meets_goal=us <= GOAL_US))
    return rows


def report(name, seconds, nbytes, peak_gbps):
    gbps = nbytes / seconds / 1e9
    line = f"{name:10s} {seconds * 1e6:12.1f} us/call {gbps:10.2f} GB/s"
    if peak_gbps:
        line += f" {100 * gbps / peak_gbps:6.1f}% of {peak_gbps:g} GB/s"
    print(line, flush=True)


def main(argv=None):
    a = parse_args(argv)
    dtype = jnp.dtype(a.dtype)
    key = jax.random.split(jax.random.key(0), 4)
    (q, k_pages, v_pages, kv_lens, page_indices), kv_bytes = decode_inputs(
        a.batch, a.context, a.heads, a.kv_heads, a.head_dim, a.page_size, dtype, key[0])
    opts = dict(backend=a.backend, interpret=a.interpret or None)
    print(f"device={jax.devices()[0].device_kind} batch={a.batch} context={a.context} "
          f"heads={a.heads}/{a.kv_heads} head_dim={a.head_dim} page_size={a.page_size} "
          f"dtype={a.dtype} K/V bytes={kv_bytes / 1e6:.1f} MB", flush=True)
    kernels = a.kernels.split(",")
    if "decode" in kernels:
        seconds = time_chained(lambda x, *r: pk.paged_attention(x, *r, **opts), q,
                               (k_pages, v_pages, kv_lens, page_indices), a.iterations)
        report("decode", seconds, kv_bytes, a.peak_gbps)
    if "ragged" in kernels:
        num_tokens = a.batch * a.q_len
        q = jax.random.normal(key[2], (num_tokens, a.heads, a.head_dim), dtype)  # [T, Hq, D]
        cu_q_lens = jnp.arange(a.batch + 1, dtype=jnp.int32) * a.q_len  # [B + 1]
        num_seqs = jnp.array([a.batch], jnp.int32)  # [1]
        args = (k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)
        seconds = time_chained(lambda x, *r: pk.ragged_paged_attention(x, *r, **opts), q,
                               args, a.iterations)
        report("ragged", seconds, kv_bytes, a.peak_gbps)
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
    if "goal" in kernels:
        for row in goal_rows(iterations=a.iterations, **opts):
            print(f"goal       batch 1, 2,048 keys, 32/8 heads, pages of {row['page_size']}: "
                  f"{row['us']:.2f} us/call against {row['goal_us']:g} us: "
                  f"{'met' if row['meets_goal'] else 'NOT met'}", flush=True)


if __name__ == "__main__":
    main()
