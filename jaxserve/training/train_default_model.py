"""Train the small model that ships with jaxserve (`jaxserve/default_model`).

    apt-get install r-cran-janeaustenr        # the text (or see jaxserve.training.corpus)
    pip install jaxserve[train]               # optax
    python -m jaxserve.training.train_default_model --out jaxserve/default_model

The defaults reproduce the shipped model. head_dim is 64 because the paged-attention kernels
support 64, 128 and 256 only. It is a Llama-shaped decoder of a few million
parameters, built from jaxserve's own `LlamaModel` and trained in float32 on CPU with optax
AdamW, on Jane Austen's six novels.

Text: Debian package `r-cran-janeaustenr` 1.0.0-1 (CRAN package janeaustenr by Julia Silge,
MIT licence), whose novels are Project Gutenberg texts in the public domain. Nothing is
downloaded at run time: the text is read from the installed package (`--package-dir`).

Split: the last `--val-fraction` of each novel's paragraphs is held out for validation and never
seen by the tokenizer or the model; the first few KB of it are written to `heldout.txt` so that
tests can measure the shipped model's loss on text it was not trained on.

Every paragraph becomes `<s> paragraph </s>`; paragraphs are concatenated and training samples
random windows of `--seq-len + 1` tokens. Progress (step, loss, tokens/s, validation loss) is
printed as it trains. Output is an ordinary Hugging Face folder (config.json, model.safetensors,
tokenizer files, generation_config.json) that both jaxserve and `transformers` load.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxserve.model.config import ModelConfig, RopeConfig
from jaxserve.model import LlamaModel
from jaxserve.reference.dense_attention import DenseAttention
from jaxserve.model.contract import StepContext
from jaxserve.training.corpus import DEFAULT_PACKAGE_DIR, paragraphs, read_novels
from jaxserve.training.export import save_hf_folder
from jaxserve.training.tokenizer import BOS, EOS, save_tokenizer, train_tokenizer

HELDOUT_CHARS = 4096


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="output model folder")
    p.add_argument("--package-dir", type=Path, default=DEFAULT_PACKAGE_DIR,
                   help="installed janeaustenr R package folder")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--intermediate-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--val-fraction", type=float, default=0.04)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--save-dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def model_config(args, vocab_size: int) -> ModelConfig:
    return ModelConfig(
        model_type="llama", vocab_size=vocab_size, hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size, num_layers=args.num_layers,
        num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
        head_dim=args.hidden_size // args.num_heads, rms_norm_eps=1e-5,
        rope=RopeConfig(theta=10000.0), max_position_embeddings=args.seq_len * 2,
        tie_word_embeddings=True, bos_token_id=0, eos_token_ids=(1,))


def split_paragraphs(novels: list[list[str]], val_fraction: float):
    """(train, validation) paragraphs: the tail of every novel is held out."""
    train, val = [], []
    for lines in novels:
        paras = paragraphs(lines)
        cut = len(paras) - max(1, int(len(paras) * val_fraction))
        train += paras[:cut]
        val += paras[cut:]
    return train, val


def token_stream(tok, texts: list[str]) -> np.ndarray:
    """`<s> text </s>` for every text, concatenated: int32 `[N]`."""
    eos = tok.token_to_id(EOS)
    ids = [e.ids + [eos] for e in tok.encode_batch(texts)]  # encode prepends <s>
    return np.fromiter((t for row in ids for t in row), dtype=np.int32)


def loss_fn(model: LlamaModel, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross entropy (nats/token) over tokens `[B, T+1]`."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # [B, T] each
    positions = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)  # [B, T]
    hidden = model(inputs, positions, [None] * len(model.layers),
                   StepContext(DenseAttention(positions))).hidden  # [B, T, E]
    logits = model.logits(hidden)  # [B, T, V]
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def make_optimizer(args) -> optax.GradientTransformation:
    """AdamW with linear warm-up then cosine decay to a tenth of the peak rate."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, args.warmup_steps, args.steps, end_value=args.lr * 0.1)

    def decay_matrices(params):  # weight decay on matrices only, not on norm scales
        return jax.tree.map(lambda p: p.ndim >= 2, params)

    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=args.weight_decay,
                    mask=decay_matrices))


def windows(stream: np.ndarray, length: int) -> np.ndarray:
    """Non-overlapping windows `[N, length]` covering the stream (the tail is dropped)."""
    count = len(stream) // length
    return stream[:count * length].reshape(count, length)


def main(argv=None) -> None:
    args = parse_args(argv)
    novels = read_novels(args.package_dir)
    train_text, val_text = split_paragraphs(novels, args.val_fraction)
    tok = train_tokenizer(train_text, args.vocab_size)
    train_ids, val_ids = token_stream(tok, train_text), token_stream(tok, val_text)
    val_windows = windows(val_ids, args.seq_len + 1)  # [Nv, T+1]
    print(f"corpus: {len(train_text)} train / {len(val_text)} validation paragraphs, "
          f"{len(train_ids)} / {len(val_ids)} tokens, vocab {tok.get_vocab_size()}")

    cfg = model_config(args, tok.get_vocab_size())
    model = LlamaModel(cfg, jnp.float32, rngs=nnx.Rngs(args.seed))
    graphdef, params = nnx.split(model)
    n_params = sum(p.size for p in jax.tree.leaves(params))
    print(f"model: {n_params / 1e6:.2f}M parameters, {cfg.num_layers} layers, "
          f"hidden {cfg.hidden_size}")
    tx = make_optimizer(args)
    opt_state = tx.init(params)

    @jax.jit
    def eval_loss(params, tokens):
        return loss_fn(nnx.merge(graphdef, params), tokens)

    @jax.jit(donate_argnums=(0, 1))
    def train_step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(eval_loss)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def validation_loss(limit=None):
        rows = val_windows[:limit]
        losses = [eval_loss(params, rows[i:i + args.batch_size])
                  for i in range(0, len(rows) - args.batch_size + 1, args.batch_size)]
        return float(np.mean(losses))

    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    tick, recent = start, []
    for step in range(1, args.steps + 1):
        offsets = rng.integers(0, len(train_ids) - args.seq_len - 1, args.batch_size)
        batch = np.stack([train_ids[o:o + args.seq_len + 1] for o in offsets])  # [B, T+1]
        params, opt_state, loss = train_step(params, opt_state, batch)
        recent.append(loss)
        if step % args.log_every == 0:
            jax.block_until_ready(loss)
            now = time.perf_counter()
            rate = args.log_every * args.batch_size * args.seq_len / (now - tick)
            print(f"step {step:5d}  loss {float(np.mean(recent)):.3f}  "
                  f"{rate:,.0f} tokens/s  {(now - start) / 60:.1f} min", flush=True)
            tick, recent = time.perf_counter(), []
        if step % args.eval_every == 0 and step < args.steps:
            print(f"step {step:5d}  validation loss {validation_loss(64):.3f}", flush=True)
    final = validation_loss()
    print(f"final validation loss {final:.4f} nats/token (uniform guess: "
          f"{math.log(cfg.vocab_size):.3f}); trained in {(time.perf_counter() - start) / 60:.1f}"
          " min", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    save_hf_folder(nnx.merge(graphdef, params), cfg, args.out, dtype=args.save_dtype)
    save_tokenizer(tok, args.out, max_length=cfg.max_position_embeddings)
    generation = {"bos_token_id": tok.token_to_id(BOS), "eos_token_id": tok.token_to_id(EOS),
                  "do_sample": False}
    (args.out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    heldout = "\n".join(val_text)[:HELDOUT_CHARS].rsplit(" ", 1)[0]
    (args.out / "heldout.txt").write_text(heldout + "\n")
    print(f"saved to {args.out}")


if __name__ == "__main__":
    main()
