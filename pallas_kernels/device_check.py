"""One-shot check of the kernels on the attached accelerator: `python -m pallas_kernels.device_check
--out results.json`.

Made for a short rental (all in well under 8 minutes on an H200 or a TPU v6e):
1. correctness: the decode and ragged kernels, compiled for the device (the platform's
   default dispatch, not interpret mode), against the jnp reference over the test grid's
   shapes, with page tables poisoned past each sequence's pages;
2. decode benchmark: first the issue's target rows (batch 1, 2,048 keys, 8 kv / 32 query
   heads, pages of 16 and 32, each with `goal_us` and `meets_goal` against `bench.GOAL_US`),
   then engine shapes: batch 1/8/64/256 x context 512/2k/8k, a page table as
   wide as max_model_len 32k, kv heads 8 (32 query heads) and 1 (4 query heads, an 8B model
   on 8 devices), head_dim 128, bfloat16, page size 16 (the engine's default). Each row gives
   time per call, GB/s of K/V read and the % of the device's peak HBM bandwidth, beside
   JAX's own Pallas kernel on the same inputs as the anchor
   (`jax.experimental.pallas.ops.gpu.paged_attention` on GPU,
   `jax.experimental.pallas.ops.tpu.ragged_paged_attention` on TPU; each gets its own cache
   layout, copied once before timing). Calls are timed on the device (`bench.time_chained`:
   n chained calls in one program, the host's dispatch outside the per-call figure).
Every result is appended to the JSON file as it is measured, so a run cut short keeps what
it had. `--quick` shrinks everything to run on CPU in interpret mode (a test of this script,
not a measurement).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from pallas_kernels import kv_quant, reference
from pallas_kernels.bench import GOAL_SHAPE, GOAL_US, time_chained

# Peak HBM bandwidth, GB/s, by a substring of jax's device_kind (vendors' data sheets).
PEAK_GBPS = {"H200": 4800, "H100": 3350, "A100": 2039, "TPU v6": 1640, "TPU v5 lite": 819,
             "TPU v5e": 819, "TPU v5": 2765, "TPU v4": 1228}
# (q heads, kv heads, head_dim, page size, dtype, soft cap, sliding window): the test grid.
GRID = [(8, 2, 128, 16, "float32", None, None), (4, 4, 64, 32, "bfloat16", None, None),
        (8, 1, 256, 64, "float32", None, None), (6, 2, 128, 128, "bfloat16", None, None),
        (32, 8, 128, 16, "bfloat16", None, None), (8, 2, 64, 16, "float32", 4.0, 21)]
BATCHES, CONTEXTS, KV_HEADS = (1, 8, 64, 256), (512, 2048, 8192), ((8, 32), (1, 4))
MAX_MODEL_LEN, PAGE_SIZE, HEAD_DIM = 32768, 16, 128
GOAL_PAGE_SIZES = (16, 32)



def error_text(err: BaseException, limit: int = 1500) -> str:
    """An exception as a report row records it: its type and message, and when the message is
    long (a child's traceback, an allocator's summary) its start and its end, where the
    cause is."""
    text = f"{type(err).__name__}: {err}"
    return text if len(text) <= limit else f"{text[:300]} ... {text[-(limit - 300):]}"

def peak_gbps(device_kind: str) -> float | None:
    for key, gbps in PEAK_GBPS.items():
        if key in device_kind:
            return gbps
    return None


class Results:
    """The run's results, rewritten to `path` after every addition."""

    def __init__(self, path: Path | None, header: dict):
        self.path, self.data = path, dict(header, correctness=[], decode=[])

    def add(self, section: str, row: dict):
        self.data[section].append(row)
        print(json.dumps(row), flush=True)
        if self.path:
            self.path.write_text(json.dumps(self.data, indent=1))


def poisoned_table(rng, kv_lens, pages_per_seq, page_size, num_pages):
    """Distinct random pages for each sequence's keys, -1 past them."""
    table = np.full((len(kv_lens), pages_per_seq), -1, np.int32)
    free = rng.permutation(num_pages)
    used = 0
    for s, kv_len in enumerate(kv_lens):
        n = -(-int(kv_len) // page_size)
        table[s, :n] = free[used:used + n]
        used += n
    return table


def check_correctness(results: Results, interpret: bool, quick: bool):
    rng = np.random.default_rng(0)
    for hq, hkv, d, ps, dtype, soft_cap, window in (GRID[1::4] if quick else GRID):
        pages_per_seq, batch = 8, 6
        kv_lens = np.array([0, 1, ps, 2 * ps + 1, pages_per_seq * ps, 5], np.int32)
        num_pages = batch * pages_per_seq + 1
        k, v = (jnp.asarray(rng.standard_normal(kv_quant.page_shape(num_pages, ps, hkv, d)),
                            dtype) for _ in range(2))  # [N, ps, Hkv * D]
        table = poisoned_table(rng, kv_lens, pages_per_seq, ps, num_pages)
        clean = np.maximum(table, 0)
        opts = dict(soft_cap=soft_cap, sliding_window=window)
        q = jnp.asarray(rng.standard_normal((batch, hq, d)), dtype)
        q_lens = np.array([0, 1, ps, 2, 3, 1], np.int32)  # chunks beside decode rows
        cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        q_ragged = jnp.asarray(rng.standard_normal((int(cu_q_lens[-1]) + 3, hq, d)), dtype)
        ragged_args = (k, v, kv_lens, table, cu_q_lens, np.array([batch], np.int32))
        ragged_clean = (k, v, kv_lens, clean) + ragged_args[4:]
        cases = {
            "decode": (lambda: pk.paged_attention(q, k, v, kv_lens, table, interpret=interpret,
                                                  **opts),
                       lambda: reference.paged_attention(q, k, v, kv_lens, clean, **opts)),
            "ragged": (lambda: pk.ragged_paged_attention(q_ragged, *ragged_args,
                                                         interpret=interpret, **opts),
                       lambda: reference.ragged_paged_attention(q_ragged, *ragged_clean,
                                                                **opts))}
        for kernel, (got, want) in cases.items():
            row = dict(kernel=kernel, shape=[hq, hkv, d, ps, dtype], soft_cap=soft_cap,
                       window=window)
            try:
                err = float(jnp.max(jnp.abs(got().astype(jnp.float32)
                                            - want().astype(jnp.float32))))
                row.update(max_abs_error=err, ok=err <= (2e-5 if dtype == "float32" else 3e-2))
            except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                row.update(ok=False, error=error_text(e))
            results.add("correctness", row)


def anchor_fn(platform, hkv, interpret):
    """JAX's own Pallas kernel for this platform on our inputs, with its cache layout built
    once: returns (prepare(k, v) -> cache, run(q, cache, kv_lens, table)) or None."""
    if platform == "gpu":
        from jax.experimental.pallas.ops.gpu import paged_attention as gpu_pa

        def prepare(k, v):  # [N, ps, Hkv * D] -> [Hkv, N, ps, D]
            return tuple(kv_quant.page_heads(x, HEAD_DIM).transpose(2, 0, 1, 3)
                         for x in (k, v))

        def run(q, cache, kv_lens, table):
            return gpu_pa.paged_attention(q, *cache, table, kv_lens, interpret=interpret)
        return prepare, run
    if platform == "tpu":
        from jax.experimental.pallas.ops.tpu import ragged_paged_attention as rpa

        def prepare(k, v):  # K and V of each head interleaved: [N, ps, 2 * Hkv, D]
            k, v = (kv_quant.page_heads(x, HEAD_DIM) for x in (k, v))  # [N, ps, Hkv, D]
            n, ps, h, d = k.shape
            return jnp.stack([k, v], axis=3).reshape(n, ps, 2 * h, d)

        def run(q, cache, kv_lens, table):
            batch = q.shape[0]
            return rpa.ragged_paged_attention(
                q, cache, kv_lens, table, jnp.arange(batch + 1, dtype=jnp.int32),
                jnp.array([batch], jnp.int32), sm_scale=q.shape[-1] ** -0.5)
        return prepare, run
    return None


def bench_decode(results: Results, platform: str, peak: float | None, quick: bool,
                 interpret: bool, budget_s: float, started: float, iterations: int):
    batches, contexts, heads = ((3,), (40,), ((2, 8), (1, 4))) if quick else (
        BATCHES, CONTEXTS, KV_HEADS)
    max_len = 512 if quick else MAX_MODEL_LEN
    key = jax.random.key(0)
    goal = (1, 40, 2, 8) if quick else tuple(GOAL_SHAPE[k] for k in (
        "batch", "context", "kv_heads", "heads"))  # (batch, context, kv heads, q heads)
    rows = [(goal, page_size, True) for page_size in GOAL_PAGE_SIZES[:1 if quick else None]]
    rows += [((batch, context, hkv, hq), PAGE_SIZE, False) for hkv, hq in heads
             for batch in batches for context in contexts]
    for (batch, context, hkv, hq), page_size, is_goal in rows:
        row = dict(batch=batch, context=context, kv_heads=hkv, q_heads=hq, head_dim=HEAD_DIM,
                   page_size=page_size, max_model_len=max_len, dtype="bfloat16")
        if time.perf_counter() - started > budget_s:
            results.add("decode", dict(row, skipped="time budget spent"))
            continue
        try:
            row.update(measure(batch, context, hkv, hq, max_len // page_size, page_size, key,
                               platform, peak, interpret, iterations))
            if is_goal:
                us = row["jaxserve"]["us"]
                row.update(goal_us=GOAL_US, meets_goal=us <= GOAL_US)
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            row.update(error=error_text(e))
        results.add("decode", row)


def measure(batch, context, hkv, hq, pages_per_seq, page_size, key, platform, peak, interpret,
            iterations):
    pages_used = -(-context // page_size)
    num_pages = batch * pages_used + 1
    k_key, v_key, q_key = jax.random.split(key, 3)
    shape = kv_quant.page_shape(num_pages, page_size, hkv, HEAD_DIM)
    k = jax.random.normal(k_key, shape, jnp.bfloat16)  # [N, ps, Hkv * D]
    v = jax.random.normal(v_key, shape, jnp.bfloat16)
    q = jax.random.normal(q_key, (batch, hq, HEAD_DIM), jnp.bfloat16)  # [B, Hq, D]
    table = np.zeros((batch, pages_per_seq), np.int32)  # page 0 past each sequence
    table[:, :pages_used] = 1 + np.arange(batch * pages_used).reshape(batch, pages_used)
    table = jnp.asarray(table)
    kv_lens = jnp.full((batch,), context, jnp.int32)
    kv_bytes = 2 * batch * context * hkv * HEAD_DIM * 2
    out = dict(kv_bytes=kv_bytes)

    def numbers(seconds):
        gbps = kv_bytes / seconds / 1e9
        return dict(us=round(seconds * 1e6, 1), gbps=round(gbps, 1),
                    pct_peak=round(100 * gbps / peak, 1) if peak else None)

    out["jaxserve"] = numbers(time_chained(
        lambda x, *a: pk.paged_attention(x, *a, interpret=interpret), q, (k, v, kv_lens, table),
        iterations))
    anchor = anchor_fn(platform if not interpret else "gpu", hkv, interpret)
    if anchor is not None:
        prepare, run = anchor
        try:
            cache = jax.block_until_ready(jax.jit(prepare)(k, v))
            theirs = numbers(time_chained(run, q, (cache, kv_lens, table), iterations))
            out["jax_pallas"] = theirs
            out["speedup_vs_jax"] = round(theirs["us"] / out["jaxserve"]["us"], 2)
        except Exception as e:  # noqa: BLE001 - the anchor's failure is recorded
            out["jax_pallas"] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="JSON file for the results")
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes in interpret mode (tests this script on CPU)")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="skip the remaining benchmark rows after this many seconds")
    p.add_argument("--iterations", type=int, default=20)
    a = p.parse_args(argv)
    started = time.perf_counter()
    device = jax.devices()[0]
    platform = {"cuda": "gpu", "rocm": "gpu"}.get(device.platform, device.platform)
    interpret = a.quick or platform == "cpu"
    peak = peak_gbps(device.device_kind)
    results = Results(a.out, dict(device_kind=device.device_kind, platform=platform,
                                  jax=jax.__version__, peak_gbps=peak, interpret=interpret))
    print(f"device_check on {device.device_kind} ({platform}), peak {peak} GB/s", flush=True)
    check_correctness(results, interpret, a.quick)
    bench_decode(results, platform, peak, a.quick, interpret, a.budget_s, started,
                 2 if a.quick else a.iterations)
    ok = all(r.get("ok") for r in results.data["correctness"])
    print(f"correctness {'ok' if ok else 'FAILED'}; {time.perf_counter() - started:.0f} s",
          flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
