"""Train an EAGLE-3 head for a model jaxserve serves (by default the shipped one), and save
it in the Hugging Face layout that `speculative_config={"method": "eagle3", "model": ...}`
reads (`jaxserve.speculative.eagle3`).

    pip install jaxserve[train]               # optax
    python -m jaxserve.training.train_eagle3_head --out /tmp/austen-eagle3

The head learns what the model itself would say: its text is the model's own continuations
of short prompts, greedy for `--greedy-fraction` of them (the text a greedy request sees),
sampled at temperature 1 for the rest. The prompts are cut from `--prompts-file` if given,
else from text the model samples from its start token alone, so that no text a benchmark
prompts with (the shipped model's `heldout.txt`) is trained on. Its label at every
position is the model's greedy next token there. Each step trains `--passes` draft steps as
a round runs them (EAGLE-3's training-time test), for every start position of a text at
once:
1. pass 0 at position c: (token c, the model's joined hidden state at c - 1) → the model's
   next token at c;
2. pass j at position c + j: (the model's token there, the head's own output of pass j - 1)
   → the model's next token at c + j, attending to pass 0's keys up to c and to passes
   1..j's keys of the same chain (`draft_chains.ChainAttention`), as the serving head's cache
   holds them in a round.

The draft vocabulary is the `--draft-vocab-size` tokens the model predicts most often in the
generated text (`d2t` maps them back); progress (loss, accuracy of each pass) is printed.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
from flax import nnx
from safetensors.numpy import save_file

from jaxserve.reference.dense_attention import DenseAttention
from jaxserve.model.contract import StepContext
from jaxserve.speculative.eagle3 import Eagle3Config, Eagle3Head
from jaxserve.training.draft_chains import ChainAttention


def parse_args(argv=None) -> argparse.Namespace:
    shipped = Path(__file__).resolve().parents[1] / "default_model"
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="the head's output folder")
    p.add_argument("--model", type=Path, default=shipped, help="the target model's folder")
    p.add_argument("--prompts-file", type=Path, default=None,
                   help="text to cut prompts from (default: the model's own samples)")
    p.add_argument("--sequences", type=int, default=512, help="generated texts")
    p.add_argument("--greedy-fraction", type=float, default=0.5,
                   help="share of the texts the model continues greedily (the rest: sampled)")
    p.add_argument("--prompt-len", type=int, default=12)
    p.add_argument("--length", type=int, default=128, help="tokens per generated text")
    p.add_argument("--aux-layers", type=int, nargs=3, default=None,
                   help="target layers whose inputs the head reads (default: 1, L/2, L-1)")
    p.add_argument("--draft-vocab-size", type=int, default=1024)
    p.add_argument("--intermediate-size", type=int, default=512)
    p.add_argument("--passes", type=int, default=3,
                   help="draft steps trained per position (a round's num_speculative_tokens)")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def generate_texts(llm, args, rng) -> np.ndarray:
    """`[N, length]` token ids: prompts cut from the prompts file (or from 128 texts the
    model samples from its start token), continued by the model (greedily for the first
    `greedy_fraction` of them)."""
    from jaxserve.sampling_params import SamplingParams

    if args.prompts_file is not None:
        ids = llm.tokenizer.encode(args.prompts_file.read_text())
    else:  # the model's own text, sampled from its start token
        start = [{"prompt_token_ids": llm.tokenizer.encode("")}] * 128
        samples = llm.generate(start, [SamplingParams(temperature=1.0, seed=1_000_000 + i,
                                                      max_tokens=args.length)
                                       for i in range(len(start))])
        ids = [t for o in samples for t in o.outputs[0].token_ids]
    starts = rng.integers(0, len(ids) - args.prompt_len, args.sequences)
    prompts = [{"prompt_token_ids": ids[s:s + args.prompt_len]} for s in starts]
    greedy = int(args.sequences * args.greedy_fraction)
    params = [SamplingParams(temperature=0.0 if i < greedy else 1.0, seed=int(i),
                             ignore_eos=True, max_tokens=args.length - args.prompt_len)
              for i in range(args.sequences)]
    outputs = llm.generate(prompts, params)
    return np.asarray([p["prompt_token_ids"] + list(o.outputs[0].token_ids)
                       for p, o in zip(prompts, outputs)], np.int32)


def target_states(model, tokens: np.ndarray, aux_layers, batch: int = 32):
    """The model's greedy next token at every position `[N, L]` and the inputs of
    `aux_layers` side by side `[N, L, 3E]` (float32), by the dense path."""
    @jax.jit
    def run(chunk):
        positions = jnp.broadcast_to(jnp.arange(chunk.shape[1]), chunk.shape)
        out = model(chunk, positions, [None] * model.config.num_layers,
                    StepContext(DenseAttention(positions)), aux_layers=tuple(aux_layers))
        return jnp.argmax(model.logits(out.hidden), axis=-1).astype(jnp.int32), out.aux

    labels, states = [], []
    for i in range(0, len(tokens), batch):
        label, aux = run(jnp.asarray(tokens[i:i + batch]))
        labels.append(np.asarray(label))
        states.append(np.asarray(aux, np.float32))
    return np.concatenate(labels), np.concatenate(states)


def head_config(target, args, aux_layers) -> tuple[dict, Eagle3Config]:
    """The head's config.json and `Eagle3Config`: the target's attention shape, one layer."""
    from jaxserve.model.hf_config import config_from_hf

    hf = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
          "hidden_size": target.hidden_size, "intermediate_size": args.intermediate_size,
          "num_hidden_layers": 1, "num_attention_heads": target.num_heads,
          "num_key_value_heads": target.num_kv_heads, "head_dim": target.head_dim,
          "rms_norm_eps": target.rms_norm_eps, "rope_theta": target.rope.theta,
          "max_position_embeddings": target.max_position_embeddings,
          "vocab_size": target.vocab_size, "draft_vocab_size": args.draft_vocab_size,
          "eagle_aux_hidden_state_layer_ids": list(aux_layers), "torch_dtype": "bfloat16"}
    layer = config_from_hf({**hf, "tie_word_embeddings": False})
    return hf, Eagle3Config(layer, args.draft_vocab_size, target.hidden_size,
                            tuple(aux_layers), False, False)


def train(head: Eagle3Head, target, tokens, labels, states, draft_of, args, rng):
    """AdamW on the mean of every pass's cross-entropy over the draft vocabulary; labels
    outside it are skipped. Prints loss and each pass's accuracy every 50 steps."""
    embed = jnp.asarray(target.embed[...], jnp.float32)
    optimizer = nnx.Optimizer(head, optax.adamw(optax.warmup_cosine_decay_schedule(
        0.0, args.lr, 50, args.steps, args.lr / 10), weight_decay=0.01), wrt=nnx.Param)

    def loss_fn(head, tok, aux, lab):
        # tok, lab [B, L]; aux [B, L, 3Et]. Pass j's arrays have L - j rows, one per chain.
        positions = jnp.broadcast_to(jnp.arange(tok.shape[1]), tok.shape)
        joined = head.joined(aux)  # [B, L, E]
        state = jnp.concatenate([jnp.zeros_like(joined[:, :1]), joined[:, :-1]], axis=1)
        inputs, cache = tok, ()
        total, right = 0.0, []
        for j in range(args.passes):
            chains = tok.shape[1] - j
            out, _, (cache,) = head(embed[inputs], state, positions[:, j:], [cache],
                                    ChainAttention())  # out [B, L - j, E]
            target_ids = draft_of[lab[:, j:]]  # [B, L - j] (-1: not in the draft vocabulary)
            logits = head.draft_logits(out)
            ce = optax.softmax_cross_entropy_with_integer_labels(
                logits, jnp.maximum(target_ids, 0))
            mask = target_ids >= 0
            total = total + jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1)
            right.append(jnp.mean(jnp.argmax(logits, -1) == target_ids))
            inputs, state = lab[:, j:j + chains - 1], out[:, :-1]  # the next pass's rows
        return total / args.passes, right

    @nnx.jit
    def step(head, optimizer, tok, aux, lab):
        (loss, right), grads = nnx.value_and_grad(loss_fn, has_aux=True)(head, tok, aux, lab)
        optimizer.update(head, grads)
        return loss, right

    started = time.perf_counter()
    for i in range(1, args.steps + 1):
        pick = rng.integers(0, len(tokens), args.batch)
        loss, right = step(head, optimizer, jnp.asarray(tokens[pick]),
                           jnp.asarray(states[pick]), jnp.asarray(labels[pick]))
        if i % 50 == 0 or i == args.steps:
            accuracy = ", ".join(f"draft {j + 1} {float(r):.3f}" for j, r in enumerate(right))
            print(f"step {i}/{args.steps}: loss {float(loss):.3f}, accuracy of {accuracy} "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)


def save_head(head: Eagle3Head, hf: dict, folder: Path) -> None:
    """config.json and model.safetensors (bfloat16, d2t int64) in the HF layout."""
    cfg = head.config
    e, hq, hkv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    value = lambda param: np.asarray(param[...], np.float32)  # noqa: E731
    tensors = {
        "fc.weight": value(head.fc).T,
        "midlayer.input_layernorm.weight": value(head.input_norm.weight),
        "midlayer.hidden_norm.weight": value(head.hidden_norm.weight),
        "midlayer.post_attention_layernorm.weight": value(head.post_attention_norm.weight),
        "midlayer.self_attn.q_proj.weight": value(head.attn.q_proj).reshape(2 * e, hq * d).T,
        "midlayer.self_attn.k_proj.weight": value(head.attn.k_proj).reshape(2 * e, hkv * d).T,
        "midlayer.self_attn.v_proj.weight": value(head.attn.v_proj).reshape(2 * e, hkv * d).T,
        "midlayer.self_attn.o_proj.weight": value(head.attn.o_proj).reshape(hq * d, e).T,
        "midlayer.mlp.gate_proj.weight": value(head.mlp.gate_proj).T,
        "midlayer.mlp.up_proj.weight": value(head.mlp.up_proj).T,
        "midlayer.mlp.down_proj.weight": value(head.mlp.down_proj).T,
        "norm.weight": value(head.final_norm.weight),
        "lm_head.weight": value(head.lm_head).T,
    }
    tensors = {k: np.ascontiguousarray(v).astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    tensors["d2t"] = np.asarray(head.d2t[...], np.int64)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def main(argv=None) -> int:
    from jaxserve import LLM

    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    llm = LLM(str(args.model), dtype="float32", progress=False)
    layers = llm.config.num_layers
    aux_layers = args.aux_layers or (1, layers // 2, layers - 1)
    print(f"generating {args.sequences} texts of {args.length} tokens ...", flush=True)
    tokens = generate_texts(llm, args, rng)
    print("the model's hidden states and greedy tokens ...", flush=True)
    from jaxserve.loading.weights import load_weights
    dense = load_weights(args.model, llm.config, jnp.float32, progress=False)
    labels, states = target_states(dense, tokens, aux_layers)
    counts = np.bincount(labels.reshape(-1), minlength=dense.config.vocab_size)
    kept = np.sort(np.argsort(-counts)[:args.draft_vocab_size])  # target ids, ascending
    draft_of = np.full(dense.config.vocab_size, -1, np.int32)
    draft_of[kept] = np.arange(len(kept))
    print(f"draft vocabulary of {len(kept)} covers "
          f"{counts[kept].sum() / counts.sum():.1%} of the model's next tokens", flush=True)
    hf, eagle = head_config(dense.config, args, aux_layers)
    head = Eagle3Head(eagle, jnp.float32, nnx.Rngs(args.seed))
    head.d2t.set_value(jnp.asarray(kept - np.arange(len(kept)), jnp.int32))
    train(head, dense, tokens, labels, states, jnp.asarray(draft_of), args, rng)
    save_head(head, hf, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
