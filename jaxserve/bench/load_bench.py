"""`jaxserve bench load`: the peak host memory of loading a model's weights, unquantized and
quantized on load (int8, fp8), from a bfloat16 or float32 safetensors folder (Linux: it reads
`/proc/self/status`).

The loader (`jaxserve.loading.weights.load_weights`) reads one tensor at a time so that the
host holds about one tensor beyond what the devices hold; with quantization on load, each
float tensor is also quantized on the host as it is read. This measures how close to that
promise a load stays: the peak of the process's memory beyond the model it ends up holding,
compared with the checkpoint's largest tensor.

Each variant (`--variants`, default none, int8, fp8; compute dtype `--dtype`, default
bfloat16) loads in a fresh Python process of its own, so the peaks do not mix. After
importing jax and jaxserve and starting the runtime, the process records its baseline (and
resets the kernel's high-water mark, `/proc/self/clear_refs`), then loads the folder as
`LLM(..., quantization=...)` would (`load_weights` with `with_quantization(load_config(...),
method)` onto a one-device mesh, each tensor placed shard by shard), blocks until every
parameter is ready, and reports:
- peak RSS: the kernel's high-water mark (`VmHWM` in `/proc/self/status`), or the largest
  RSS sampled if that is more (the kernel updates its mark when memory is unmapped and counts
  RSS per CPU in batches, so the mark can lag by a little). `getrusage`'s `ru_maxrss` is
  in the JSON too, not used: the reset does not clear it (it keeps the marks of exited
  threads, from before the baseline);
- peak anonymous and file-backed RSS (`RssAnon`, `RssFile`), sampled by a thread every
  millisecond or so (a lower bound: a peak shorter than the sampling gap can be missed; the
  sampled total RSS beside the high-water mark shows how much was);
- the model's bytes (every parameter of the loaded model: codes, scales, norms) and the
  seconds the load took.

RSS counts the pages of the memory-mapped safetensors files the loader has touched (page
cache, file-backed): they are clean and the kernel can drop them without swapping, but they
are counted while mapped. So two transients are reported: from the total peak RSS (what
`top` and `ps` show) and from the anonymous peak (the memory the loader really allocates: read
copies, float32 temporaries, codes). The transient is the peak's growth
over the baseline minus the model's bytes when the model lives in host memory (the CPU
platform); on an accelerator the model is in device memory and the host's whole growth is
transient. It is compared with the checkpoint's largest tensor as stored (its float bytes on
disk): "one tensor at a time" means a transient of a small multiple of it, not of the model.
The table's `kept` is the RSS growth still there after the load beyond the model: memory the
allocator keeps for reuse, garbage not yet collected.

The model is `--model` (a Hugging Face Llama-family folder of safetensors) or, by default, a
synthetic Llama written into a temporary folder (random weights in `--source-dtype`, one
safetensors file per layer plus `model.safetensors.index.json`, written one file at a time;
the default sizes make about 1 GB in bfloat16, 2 GB in float32). Files just written sit in the
page cache, so the load reads memory, not the disk: the seconds measure the loader's work.
Progress goes to stderr; stdout gets the table, or with `--json` one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

VARIANTS = ("none", "int8", "fp8")  # quantization on load; "none": the compute dtype
_STATUS = re.compile(rb"^(VmRSS|VmHWM|RssAnon|RssFile):\s+(\d+) kB", re.M)
MiB = 2 ** 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="HF Llama-family folder of safetensors (default: a synthetic "
                             "Llama written into a temporary folder)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                        help="quantization on load to measure, each in its own process "
                             "(default: none int8 fp8)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="compute dtype (unquantized weights, norms)")
    synthetic = parser.add_argument_group("synthetic model (without --model)")
    synthetic.add_argument("--source-dtype", default="bfloat16",
                           choices=["bfloat16", "float32"], help="dtype of the stored weights")
    synthetic.add_argument("--hidden-size", type=int, default=2048)
    synthetic.add_argument("--intermediate-size", type=int, default=5632)
    synthetic.add_argument("--layers", type=int, default=8)
    synthetic.add_argument("--vocab-size", type=int, default=32000)
    synthetic.add_argument("--heads", type=int, default=32, help="attention heads")
    synthetic.add_argument("--kv-heads", type=int, default=4, help="key/value heads")
    synthetic.add_argument("--seed", type=int, default=0)
    synthetic.add_argument("--synthetic-dir", default=None,
                           help="write the synthetic model into this folder and keep it "
                                "(default: a temporary folder, removed after)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---- the synthetic checkpoint ------------------------------------------------------------

def synthetic_config(hidden_size: int = 2048, intermediate_size: int = 5632, layers: int = 8,
                     vocab_size: int = 32000, heads: int = 32, kv_heads: int = 4,
                     source_dtype: str = "bfloat16") -> dict:
    """A Hugging Face `config.json` (as a dict) of a Llama with these sizes."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": hidden_size, "intermediate_size": intermediate_size,
            "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "vocab_size": vocab_size,
            "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1,
            "eos_token_id": 2, "torch_dtype": source_dtype}


def checkpoint_files(hf_config: dict) -> dict[str, dict[str, tuple[int, ...]]]:
    """File name → {HF tensor name → shape}: the embedding in the first file, one file per
    decoder layer, the final norm and lm head in the last; names and shapes are the ones
    `jaxserve.loading.weights.hf_tensor_map` expects of this config."""
    from jaxserve.loading.weights import hf_tensor_map
    from jaxserve.model.hf_config import config_from_hf

    groups: dict[str, dict[str, tuple[int, ...]]] = {"embed": {}}
    groups.update({f"layer{i}": {} for i in range(hf_config["num_hidden_layers"])})
    groups["head"] = {}
    for name, (_, _, shape) in hf_tensor_map(config_from_hf(hf_config)).items():
        if name.startswith("model.layers."):
            group = f"layer{name.split('.')[2]}"
        else:
            group = "embed" if name == "model.embed_tokens.weight" else "head"
        groups[group][name] = tuple(shape)
    count = len(groups)
    return {f"model-{index:05d}-of-{count:05d}.safetensors": tensors
            for index, tensors in enumerate(groups.values(), start=1)}


def write_synthetic_model(folder: Path, hf_config: dict, seed: int = 0,
                          progress=_progress) -> Path:
    """Write a Llama folder of random weights: `config.json`, one safetensors file per group
    of `checkpoint_files` (only one file's tensors in memory at a time) and
    `model.safetensors.index.json`. Linear weights are N(0, 0.02), norms near 1."""
    import ml_dtypes
    from safetensors.numpy import save_file

    dtype = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[hf_config["torch_dtype"]]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2))
    rng = np.random.default_rng(seed)
    files = checkpoint_files(hf_config)
    weight_map, total = {}, 0
    for index, (file_name, shapes) in enumerate(files.items(), start=1):
        tensors = {}
        for name, shape in shapes.items():
            value = rng.standard_normal(shape, dtype=np.float32)
            if name.endswith("norm.weight"):
                value = 1.0 + 0.1 * value
            else:
                value *= 0.02
            tensors[name] = value.astype(dtype)
            del value
            weight_map[name] = file_name
        save_file(tensors, folder / file_name)
        file_bytes = sum(t.nbytes for t in tensors.values())
        total += file_bytes
        del tensors
        progress(f"  wrote {file_name} ({index}/{len(files)}, {file_bytes / MiB:.0f} MiB)")
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return folder


def stored_tensors(model_dir: Path) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """HF tensor name → (safetensors dtype, shape, bytes on disk), read from the headers of
    the folder's safetensors files (no tensor is read)."""
    from jaxserve.loading.weights import safetensors_files, safetensors_header

    tensors = {}
    for file in safetensors_files(model_dir):
        for name, entry in safetensors_header(file)[1].items():
            begin, end = entry["data_offsets"]
            tensors[name] = (entry["dtype"], tuple(entry["shape"]), end - begin)
    return tensors


# ---- one load, in a process of its own ---------------------------------------------------

def _status() -> dict[str, int]:
    """`VmRSS`, `VmHWM`, `RssAnon`, `RssFile` of this process in bytes (empty without
    `/proc`, off Linux)."""
    try:
        with open("/proc/self/status", "rb") as handle:
            text = handle.read()
    except OSError:
        return {}
    return {name.decode(): int(kib) * 1024 for name, kib in _STATUS.findall(text)}


def _reset_peak() -> bool:
    """Reset the kernel's high-water mark of RSS (`VmHWM`) to the current RSS (Linux 4.0+)."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


class _Sampler(threading.Thread):
    """Reads `/proc/self/status` every `interval` seconds; keeps the peak of each field."""

    def __init__(self, interval: float):
        super().__init__(daemon=True, name="rss-sampler")
        self.interval, self.samples = interval, 0
        self.peak = {field: 0 for field in ("VmRSS", "RssAnon", "RssFile")}
        self._done = threading.Event()

    def run(self) -> None:
        with open("/proc/self/status", "rb", buffering=0) as handle:
            while True:
                handle.seek(0)
                for name, kib in _STATUS.findall(handle.readall()):
                    field = name.decode()
                    if field in self.peak:
                        self.peak[field] = max(self.peak[field], int(kib) * 1024)
                self.samples += 1
                if self._done.wait(self.interval):
                    return

    def stop(self) -> dict[str, int]:
        self._done.set()
        self.join()
        return self.peak


def measure(model_dir: str, method: str | None, dtype: str = "bfloat16",
            progress: bool = True, interval: float = 0.001) -> dict:
    """Load `model_dir` in this process with quantization `method` (None: none) and report
    its memory (bytes) and seconds; meant to run in a fresh process (`measure_variant`)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import sharding
    from jaxserve.loading.weights import load_weights
    from jaxserve.model.config import with_quantization
    from jaxserve.model.hf_config import load_config

    cfg = with_quantization(load_config(model_dir), method)
    jax.block_until_ready(jax.device_put(np.zeros(8, np.float32)))  # start the runtime
    gc.collect()
    peak_reset = _reset_peak()
    baseline = _status()
    if not baseline:
        raise RuntimeError("jaxserve bench load reads /proc/self/status (Linux only)")
    sampler = _Sampler(interval)
    sampler.start()
    started = time.perf_counter()
    mesh = sharding.make_mesh()  # one device: placed shard by shard, as `LLM` places it
    model = load_weights(model_dir, cfg, jnp.dtype(dtype), progress=progress, mesh=mesh)
    values = [var.get_value() for _, var in nnx.to_flat_state(nnx.state(model))]
    jax.block_until_ready(values)
    seconds = time.perf_counter() - started
    sampled = sampler.stop()
    after = _status()
    return {"quantization": method, "dtype": dtype, "platform": jax.default_backend(),
            "model_bytes": sum(v.size * v.dtype.itemsize for v in values),
            "parameters": len(values), "seconds": seconds,
            "baseline": baseline, "after": after, "sampled_peak": sampled,
            "samples": sampler.samples, "peak_reset": peak_reset,
            "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


_CHILD = ("import json, sys\n"
          "from jaxserve.bench.load_bench import measure\n"
          "result = measure(*json.loads(sys.argv[1]))\n"
          "print('\\n' + json.dumps(result), flush=True)\n")


def measure_variant(model_dir: Path, method: str | None, dtype: str = "bfloat16",
                    progress: bool = True, timeout: float = 3600.0) -> dict:
    """`measure` in a fresh Python process (its stderr, with the loader's progress bar, goes
    to this one's); a failed load raises with the child's exit status."""
    done = subprocess.run([sys.executable, "-c", _CHILD,
                           json.dumps([str(model_dir), method, dtype, progress])],
                          stdout=subprocess.PIPE, text=True, timeout=timeout,
                          env={**os.environ, "TQDM_MININTERVAL": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"loading {str(model_dir)!r} with quantization={method!r} failed "
                           f"(exit {done.returncode}); its error is above")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(raw: dict, largest_bytes: int) -> dict:
    """The row of one variant: growths over the baseline and transients (bytes), from
    `measure`'s report and the checkpoint's largest tensor."""
    base, after, sampled = raw["baseline"], raw["after"], raw["sampled_peak"]
    peak = max(after["VmHWM"], sampled["VmRSS"])
    on_host = raw["model_bytes"] if raw["platform"] == "cpu" else 0
    growth = peak - base["VmRSS"]
    anon_growth = sampled["RssAnon"] - base["RssAnon"]
    transient, anon_transient = growth - on_host, anon_growth - on_host
    return {"variant": raw["quantization"] or "none", "dtype": raw["dtype"],
            "platform": raw["platform"], "model_bytes": raw["model_bytes"],
            "largest_tensor_bytes": largest_bytes, "baseline_rss": base["VmRSS"],
            "peak_rss": peak, "vm_hwm": after["VmHWM"], "ru_maxrss": raw["ru_maxrss"],
            "peak_growth": growth, "transient": transient,
            "transient_x_largest": transient / largest_bytes,
            "sampled_peak_rss": sampled["VmRSS"], "peak_anon_growth": anon_growth,
            "anon_transient": anon_transient,
            "anon_transient_x_largest": anon_transient / largest_bytes,
            "peak_file_growth": sampled["RssFile"] - base["RssFile"],
            "retained": after["VmRSS"] - base["VmRSS"] - on_host,
            "seconds": raw["seconds"], "samples": raw["samples"],
            "peak_reset": raw["peak_reset"]}


def run(model_dir: Path, variants=VARIANTS, dtype: str = "bfloat16", progress=_progress,
        child_progress: bool = True) -> dict:
    """Measure each variant of `model_dir` in its own process; the result `format_table`
    prints."""
    tensors = stored_tensors(model_dir)
    largest = max(tensors, key=lambda name: tensors[name][2])
    rows = []
    for variant in variants:
        progress(f"loading with quantization={variant} ({dtype} compute) in a new process")
        raw = measure_variant(model_dir, None if variant == "none" else variant, dtype,
                              child_progress)
        rows.append(summarize(raw, tensors[largest][2]))
        progress(f"  peak RSS +{rows[-1]['peak_growth'] / MiB:.0f} MiB, "
                 f"{rows[-1]['seconds']:.1f} s")
    dtypes = sorted({stored for stored, _, _ in tensors.values()})
    return {"model": str(model_dir), "dtype": dtype, "source_dtypes": dtypes,
            "tensors": len(tensors),
            "checkpoint_bytes": sum(size for _, _, size in tensors.values()),
            "largest_tensor": {"name": largest, "dtype": tensors[largest][0],
                               "shape": list(tensors[largest][1]),
                               "bytes": tensors[largest][2]},
            "variants": rows}


def format_table(result: dict) -> str:
    largest = result["largest_tensor"]
    lines = [f"{result['model']}: {result['tensors']} tensors, "
             f"{result['checkpoint_bytes'] / MiB:.0f} MiB in {'/'.join(result['source_dtypes'])}"
             f"; largest {largest['name']} {largest['shape']} {largest['dtype']}, "
             f"{largest['bytes'] / MiB:.1f} MiB; {result['dtype']} compute",
             "MiB; peak: VmHWM (the kernel's high-water mark); anon: RssAnon sampled every "
             "~1 ms (a lower bound); transient = growth - model bytes",
             f"  {'variant':<8} {'model':>8} {'largest':>8} {'peak +':>8} {'transient':>9} "
             f"{'x lrg':>6} {'anon +':>8} {'anon tr.':>8} {'x lrg':>6} {'file +':>7} "
             f"{'kept':>6} {'s':>6}"]
    for row in result["variants"]:
        lines.append(
            f"  {row['variant']:<8} {row['model_bytes'] / MiB:>8.1f} "
            f"{row['largest_tensor_bytes'] / MiB:>8.1f} {row['peak_growth'] / MiB:>8.1f} "
            f"{row['transient'] / MiB:>9.1f} {row['transient_x_largest']:>6.2f} "
            f"{row['peak_anon_growth'] / MiB:>8.1f} {row['anon_transient'] / MiB:>8.1f} "
            f"{row['anon_transient_x_largest']:>6.2f} {row['peak_file_growth'] / MiB:>7.1f} "
            f"{row['retained'] / MiB:>6.1f} {row['seconds']:>6.1f}")
    lines.append("  anon +: peak anonymous RSS growth; file +: peak file-backed (mmapped "
                 "safetensors) growth; kept: RSS growth after the load beyond the model")
    return "\n".join(lines)


def run_from_args(args: argparse.Namespace) -> int:
    if args.model:
        result = run(Path(args.model), args.variants, args.dtype)
    else:
        hf_config = synthetic_config(args.hidden_size, args.intermediate_size, args.layers,
                                     args.vocab_size, args.heads, args.kv_heads,
                                     args.source_dtype)
        with tempfile.TemporaryDirectory(prefix="jaxserve-load-") as scratch:
            folder = Path(args.synthetic_dir) if args.synthetic_dir else Path(scratch)
            _progress(f"writing a synthetic {args.source_dtype} Llama into {folder}")
            write_synthetic_model(folder, hf_config, args.seed)
            result = run(folder, args.variants, args.dtype)
            result["model"] = (f"synthetic Llama (E={args.hidden_size}, M="
                               f"{args.intermediate_size}, L={args.layers}, "
                               f"V={args.vocab_size}, H={args.heads}/{args.kv_heads})")
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0
