"""`jaxserve bench lora-products`: three ways to compute a batch's LoRA delta, side by side.

A step's tokens each name an adapter slot (or none, -1); a projection adds
`delta[t] = (x[t] @ A[slot[t]]) @ B[slot[t]]`. The candidates, for one projection
(`x [T, in]`, `A [S, in, R]`, `B [S, R, out]`):
- `masked` (`jaxserve.model.lora.masked_delta`, for programs of more than one token):
  every token through every slot's A, the `[T, S, R]` result keeping only the token's own
  slot's columns, contracted with B. Work T·S·R·(in + out); no gather, no sort.
- `gathered` (`gathered_delta`, for one-token programs; punica's and sglang-jax's bgmv):
  each token's A and B gathered, `[T, in, R]` and `[T, R, out]`, then a batched matvec.
  Work T·R·(in + out), but the gathered copies are T times an adapter's bytes.
- `grouped` (sgmv): tokens sorted by slot, one `jax.lax.ragged_dot` per matrix over the
  slots' row groups, scattered back. Work T·R·(in + out) where the grouped matmul is native.

Each variant is checked against a float64 numpy transcription first. Then, per token count,
its CPU time (median of `--repeats`), and for each compile-only target (`--targets`, with
the `aot` extra) what XLA's compiled program reports: flops, bytes accessed and temporary
bytes. Step time on a TPU or GPU is not measurable here; those three are what the compiler
plans to do.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--in-features", type=int, default=4096, help="projection input")
    parser.add_argument("--out-features", type=int, default=4096, help="projection output")
    parser.add_argument("--max-loras", type=int, default=8, help="slots S")
    parser.add_argument("--max-lora-rank", type=int, default=16, help="rank R")
    parser.add_argument("--tokens", default="1,32,256,2048",
                        help="comma-separated token counts T (a decode batch, a prompt chunk)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--targets", default="tpu:v6e,gpu:h100",
                        help="compile-only targets, platform:kind (empty: CPU only)")


def masked(x, a, b, slots):
    from jaxserve.model.lora import masked_delta

    return masked_delta(x, a, b, slots)


def gathered(x, a, b, slots):
    from jaxserve.model.lora import gathered_delta

    return gathered_delta(x, a, b, slots)


def grouped(x, a, b, slots):
    """Tokens sorted by slot (those without an adapter last, in no group), a grouped matmul
    per matrix, then back to the tokens' order."""
    import jax
    import jax.numpy as jnp

    num_slots = a.shape[0]
    key = jnp.where(slots >= 0, slots, num_slots)  # [T]
    order = jnp.argsort(key, stable=True)  # [T]
    sizes = jnp.bincount(key, length=num_slots + 1)[:num_slots].astype(jnp.int32)  # [S]
    down = jax.lax.ragged_dot(x[order], a, sizes)  # [T, R]; rows past the groups: 0
    out = jax.lax.ragged_dot(down, b, sizes)  # [T, out]
    return jnp.zeros_like(out).at[order].set(out)


VARIANTS = {"masked": masked, "gathered": gathered, "grouped": grouped}


def reference(x, a, b, slots) -> np.ndarray:
    """The delta in float64 numpy, token by token."""
    x, a, b = (np.asarray(v, np.float64) for v in (x, a, b))
    out = np.zeros((x.shape[0], b.shape[2]))
    for t, slot in enumerate(np.asarray(slots)):
        if slot >= 0:
            out[t] = x[t] @ a[slot] @ b[slot]
    return out


def inputs(tokens: int, in_f: int, out_f: int, slots: int, rank: int, dtype, seed: int = 0):
    """Random x, A, B and a mix of slots: every slot used, a quarter of tokens on the base."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (tokens, in_f)).astype(dtype)
    a = rng.normal(0, in_f ** -0.5, (slots, in_f, rank)).astype(dtype)
    b = rng.normal(0, rank ** -0.5, (slots, rank, out_f)).astype(dtype)
    token_slots = rng.integers(-1, slots, tokens) if tokens > 1 else np.array([slots - 1])
    token_slots = np.where(rng.random(tokens) < 0.25, -1, token_slots).astype(np.int32)
    return x, a, b, token_slots


def check_variants(args: argparse.Namespace) -> None:
    """Every variant equals the numpy transcription (small shapes, float32)."""
    import jax

    case = inputs(37, 64, 48, args.max_loras, args.max_lora_rank, np.float32, seed=1)
    want = reference(*case)
    for name, variant in VARIANTS.items():
        got = np.asarray(jax.jit(variant)(*case))
        error = float(np.max(np.abs(got - want)))
        if error > 1e-4 * max(1.0, float(np.max(np.abs(want)))):
            raise AssertionError(f"{name} differs from the numpy reference by {error}")
    print(f"every variant equals the numpy reference (T=37, S={args.max_loras}, "
          f"R={args.max_lora_rank})", flush=True)


def cpu_times(args: argparse.Namespace, token_counts: list[int]) -> dict:
    """Median seconds of each variant at each T on the host CPU (float32)."""
    import jax

    times = {}
    for tokens in token_counts:
        case = [jax.device_put(v) for v in inputs(tokens, args.in_features,
                                                   args.out_features, args.max_loras,
                                                   args.max_lora_rank, np.float32)]
        for name, variant in VARIANTS.items():
            compiled = jax.jit(variant).lower(*case).compile()
            jax.block_until_ready(compiled(*case))
            samples = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                jax.block_until_ready(compiled(*case))
                samples.append(time.perf_counter() - started)
            times[(name, tokens)] = float(np.median(samples))
        print(f"  cpu T={tokens}: " + ", ".join(
            f"{n} {times[(n, tokens)] * 1e3:.2f} ms" for n in VARIANTS), flush=True)
    return times


def compiled_costs(target_name: str, args: argparse.Namespace, token_counts: list[int]
                   ) -> dict:
    """flops, bytes accessed and temporary bytes of each variant compiled for one device of
    `target_name` ("tpu:v6e", "gpu:h100"), bfloat16."""
    import jax
    import jax.numpy as jnp

    from jaxserve.aot.targets import Target, compile_only_devices

    platform, kind = target_name.split(":")
    target = Target(platform, kind, 1)
    device = compile_only_devices(target)[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    costs = {}
    for tokens in token_counts:
        shapes = [(tokens, args.in_features), (args.max_loras, args.in_features,
                                               args.max_lora_rank),
                  (args.max_loras, args.max_lora_rank, args.out_features)]
        abstract = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding) for s in shapes]
        abstract.append(jax.ShapeDtypeStruct((tokens,), jnp.int32, sharding=sharding))
        for name, variant in VARIANTS.items():
            compiled = jax.jit(variant).trace(*abstract).lower(
                lowering_platforms=(target.lowering_platform,)).compile()
            cost = compiled.cost_analysis() or {}
            cost = cost[0] if isinstance(cost, list) else cost
            costs[(name, tokens)] = (float(cost.get("flops", 0.0)),
                                     float(cost.get("bytes accessed", 0.0)),
                                     compiled.memory_analysis().temp_size_in_bytes)
        print(f"  {target.name} T={tokens}: " + ", ".join(
            f"{n} {costs[(n, tokens)][0] / 1e9:.2f} GFLOP" for n in VARIANTS), flush=True)
    return costs


def run_from_args(args: argparse.Namespace) -> int:
    token_counts = [int(t) for t in args.tokens.split(",")]
    print(f"LoRA delta of one projection: in {args.in_features}, out {args.out_features}, "
          f"S={args.max_loras} slots, R={args.max_lora_rank}", flush=True)
    check_variants(args)
    times = cpu_times(args, token_counts)
    targets = [t for t in args.targets.split(",") if t]
    costs = {}
    for target in targets:
        try:
            costs[target] = compiled_costs(target, args, token_counts)
        except RuntimeError as err:  # no aot extra
            print(f"  {target}: not compiled ({err})", flush=True)
    print(f"\n{'variant':<10}{'T':>6}{'cpu ms':>10}" + "".join(
        f"{t + ' GFLOP':>16}{'MB moved':>10}{'temp MB':>9}" for t in costs))
    for tokens in token_counts:
        for name in VARIANTS:
            row = f"{name:<10}{tokens:>6}{times[(name, tokens)] * 1e3:>10.2f}"
            for target in costs:
                flops, moved, temp = costs[target][(name, tokens)]
                row += f"{flops / 1e9:>16.3f}{moved / 1e6:>10.1f}{temp / 1e6:>9.1f}"
            print(row)
    return 0
