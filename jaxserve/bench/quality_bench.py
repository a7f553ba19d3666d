"""`jaxserve bench quality`: what quantization costs in accuracy and saves in bytes.

Every variant of one model — the unquantized baseline (bfloat16 by default), int8 weights,
fp8 weights, int8 weights with int8 activations, an int8 KV cache, an fp8 KV cache with
scales of 1 and with scales calibrated on the first window (`calculate_kv_scales`) — reads
the same held-out text (the shipped model's `heldout.txt`, or `--text`) in windows,
teacher-forced, and reports:
- the perplexity of the text's next tokens;
- greedy agreement: how often its most likely next token is the baseline's;
- the bytes of its weights, and their ratio to the baseline's; the KV cache's bytes per token
  (all layers, keys and values, scales included).

Each variant loads the folder as `LLM(..., quantization=...)` would (quantized on load, one
tensor at a time) and runs the dense path (`jaxserve.reference.dense_generation`), which shares
every weight and matmul with the serving engine; its keys and values are read back as a
paged cache of `kv_cache_dtype` would give them (the engine's own quantized reads are
tested against the same definition in tests/engine/test_kv_quantization.py).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

# (name, weight quantization, quantized activations, kv_cache_dtype, calculate_kv_scales)
VARIANTS = (("baseline", None, False, "auto", False),
            ("int8 weights", "int8", False, "auto", False),
            ("fp8 weights", "fp8", False, "auto", False),
            ("int8 weights + activations", "int8", True, "auto", False),
            ("int8 KV cache", None, False, "int8", False),
            ("fp8 KV cache", None, False, "fp8", False),
            ("fp8 KV cache, calibrated", None, False, "fp8", True))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="HF model folder (default: the shipped model)")
    parser.add_argument("--text", default=None,
                        help="held-out text file (default: the shipped model's heldout.txt)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="compute dtype of every variant; the baseline's weights too")
    parser.add_argument("--tokens", type=int, default=4096,
                        help="tokens of the text to read (default 4096)")
    parser.add_argument("--window", type=int, default=256,
                        help="tokens per teacher-forced window (default 256)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def text_windows(tokenizer, text: str, tokens: int, window: int) -> list[list[int]]:
    """The text's first `tokens` tokens cut into windows of `window` (the last may be short;
    one of fewer than 2 tokens is dropped)."""
    ids = tokenizer.encode(text)[:tokens]
    windows = [ids[start:start + window] for start in range(0, len(ids), window)]
    return [w for w in windows if len(w) >= 2]


def score(logits: list[np.ndarray], windows: list[list[int]]) -> tuple[float, np.ndarray]:
    """(summed negative log-likelihood of each window's next tokens, the argmax predictions
    concatenated): logits `[T, V]` per window."""
    nll, predictions = 0.0, []
    for window_logits, ids in zip(logits, windows):
        scores = window_logits[:-1].astype(np.float64)  # [T-1, V]
        top = scores.max(axis=-1, keepdims=True)
        log_z = top[:, 0] + np.log(np.exp(scores - top).sum(axis=-1))
        nll += float((log_z - scores[np.arange(len(ids) - 1), ids[1:]]).sum())
        predictions.append(window_logits[:-1].argmax(axis=-1))
    return nll, np.concatenate(predictions)


def weight_bytes(model) -> int:
    from flax import nnx

    return sum(leaf.size * leaf.dtype.itemsize for leaf in
               (var.get_value() for _, var in nnx.to_flat_state(nnx.state(model))))


def run(model_dir: Path, text: str, dtype: str, tokens: int, window: int,
        progress=print, model_name: str | None = None) -> dict:
    import jax.numpy as jnp

    from jaxserve.loading.tokenizer import Tokenizer
    from jaxserve.loading.weights import load_weights
    from jaxserve.model.config import with_quantization
    from jaxserve.model.hf_config import load_config
    from jaxserve.engine.kv_cache import page_bytes
    from jaxserve.reference.dense_generation import DenseGenerator
    from pallas_kernels.kv_quant import page_dtype

    windows = text_windows(Tokenizer(model_dir), text, tokens, window)
    predicted = sum(len(w) - 1 for w in windows)
    config = load_config(model_dir)
    rows, baseline = [], None
    for name, method, activations, kv_cache_dtype, calibrated in VARIANTS:
        started = time.perf_counter()
        model = load_weights(model_dir, with_quantization(config, method, activations),
                             jnp.dtype(dtype), progress=False)
        generator = DenseGenerator(model, kv_cache_dtype)
        if calibrated:  # scales from the first window, as the engine's first step sets them
            generator = DenseGenerator(model, kv_cache_dtype,
                                       generator.calibrated_head_scales(windows[0]))
        logits = generator.logits(windows)
        nll, predictions = score(logits, windows)
        row = {"variant": name, "quantization": method, "activations": activations,
               "kv_cache_dtype": kv_cache_dtype, "calculate_kv_scales": calibrated,
               # per token as stored off TPU (on TPU int8 scale runs may be padded)
               "kv_bytes_per_token": page_bytes(config, 1, page_dtype(kv_cache_dtype, dtype),
                                                platform="cpu"),
               "weight_bytes": weight_bytes(model), "perplexity": math.exp(nll / predicted),
               "seconds": time.perf_counter() - started}
        if baseline is None:
            baseline = {"predictions": predictions, "bytes": row["weight_bytes"]}
        row["agreement"] = float((predictions == baseline["predictions"]).mean())
        row["bytes_ratio"] = row["weight_bytes"] / baseline["bytes"]
        rows.append(row)
        progress(f"  {name}: perplexity {row['perplexity']:.3f}, agreement "
                 f"{row['agreement']:.4f} ({row['seconds']:.1f} s)")
    return {"model": model_name or model_dir.name, "dtype": dtype, "tokens": predicted,
            "windows": len(windows), "variants": rows}


def format_table(result: dict) -> str:
    lines = [f"{result['model']}, {result['dtype']} compute, {result['tokens']} predicted "
             f"tokens in {result['windows']} windows",
             f"  {'variant':<28} {'weights MiB':>11} {'x baseline':>10} "
             f"{'KV B/token':>10} {'perplexity':>10} {'agreement':>9}"]
    for row in result["variants"]:
        lines.append(f"  {row['variant']:<28} {row['weight_bytes'] / 2 ** 20:>11.2f} "
                     f"{row['bytes_ratio']:>10.3f} {row['kv_bytes_per_token']:>10} "
                     f"{row['perplexity']:>10.3f} {row['agreement']:>9.4f}")
    return "\n".join(lines)


def run_from_args(args: argparse.Namespace) -> int:
    from jaxserve.default_model import DEFAULT_MODEL_DIR, DEFAULT_MODEL_NAME

    model_dir = Path(args.model) if args.model else DEFAULT_MODEL_DIR
    text_file = Path(args.text) if args.text else DEFAULT_MODEL_DIR / "heldout.txt"
    if not text_file.is_file():
        raise ValueError(f"--text {str(text_file)!r} is not a file")
    if args.tokens < 2 or args.window < 2:
        raise ValueError("--tokens and --window must be at least 2")
    say = (lambda _: None) if args.json else print
    name = DEFAULT_MODEL_NAME if model_dir == DEFAULT_MODEL_DIR else model_dir.name
    say(f"quality of {name}'s quantized variants on {text_file.name}")
    result = run(model_dir, text_file.read_text(), args.dtype, args.tokens, args.window, say,
                 name)
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0
