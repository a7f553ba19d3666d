"""Load time of a few-hundred-MB random Llama: Hugging Face safetensors vs orbax checkpoint,
both straight onto a 1- and a 4-device mesh. Prints numbers:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \
        python benchmarks/orbax_load_time.py
"""

import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import torch
import transformers

import sharding
from jaxserve.loading.checkpoint import convert, restore
from jaxserve.model.hf_config import load_config
from jaxserve.loading.weights import load_weights

def timed(fn):
    start = time.perf_counter()
    model = fn()
    jax.block_until_ready(jax.tree.leaves(model))
    return time.perf_counter() - start


def main(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(  # ~166M parameters, ~333 MB in bfloat16
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048)
    hf = tmp_path / "hf"
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(hf)
    ckpt = tmp_path / "orbax"
    start = time.perf_counter()
    convert(hf, ckpt, progress=False)
    print(f"\nconvert: {time.perf_counter() - start:.2f}s")
    cfg = load_config(hf)
    size = sum(f.stat().st_size for f in hf.glob("*.safetensors")) / 2**20
    for tp in (1, 4):
        mesh = sharding.make_mesh(tp)
        for label, fn in (
                ("hf safetensors", lambda: load_weights(hf, cfg, jnp.bfloat16, progress=False,
                                                        mesh=mesh)),
                ("orbax", lambda: restore(ckpt, cfg, jnp.bfloat16, mesh))):
            times = [timed(fn) for _ in range(3)]
            print(f"tp={tp} {label:15s} {size:.0f} MB: best {min(times):.2f}s "
                  f"(runs {', '.join(f'{t:.2f}' for t in times)})")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as scratch:
        main(Path(scratch))
