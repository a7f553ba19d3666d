"""An EAGLE-3 head (`method` "eagle3"): one decoder layer that drafts from the target's own
hidden states, in the Hugging Face layout of the `LlamaForCausalLMEagle3` checkpoints
(`yuhuili/EAGLE3-...`, and the ones vLLM and SGLang serve).

What the head is (its `config.json` is a Llama config of one layer, plus `draft_vocab_size`,
optionally `target_hidden_size` and `eagle_aux_hidden_state_layer_ids`):
- `fc` `[3 Et → E]` joins three of the target's hidden states: the inputs of its layers
  `eagle_aux_hidden_state_layer_ids` (default 2, L // 2 and L - 3, as vLLM picks them);
- one layer whose attention reads `[input_layernorm(embedding of the token),
  hidden_norm(hidden)]` (`2E` wide) and whose residual stream starts at `hidden` (or at its
  norm with `norm_before_residual`), then the MLP; `norm` after it;
- `lm_head` over a draft vocabulary of `draft_vocab_size` tokens, and `d2t`: the target id
  of draft token i is i + d2t[i].
Tokens are embedded with the target's embedding unless the head has its own
`embed_tokens`.

How it drafts for a token x_t at position t: its input is (x_t, the target's `fc`-joined
hidden state at t - 1), and its output predicts x_{t+1}; its own output before `norm` is the
hidden input of the next draft step. Its K/V go to a one-layer pool of its own with the
target's page ids, as a draft model's do (`jaxserve.speculative.draft`). Step programs run it
over every prompt token (the target's hidden states of the same step, shifted by one; a
row's first token of the step has none and gets zeros); `jaxserve.engine.speculative_rounds` feeds
it, each round, the tokens the last round kept with the target's hidden states from that
round's verification, then its own drafts.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from safetensors.numpy import load_file

import sharding

from jaxserve.attention import PagedBatch
from jaxserve.loading.hub import resolve_model
from jaxserve.model.config import ModelConfig
from jaxserve.model.hf_config import config_from_hf
from jaxserve.model.llama import MLP, Attention, norm, random_param
from jaxserve.model.quantization import embedding_rows
from jaxserve.speculative.windows import page_slots


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """The head's shape: `layer` (a one-layer Llama config over the target's vocabulary),
    the draft vocabulary, the target's hidden size, the target layers it reads."""

    layer: ModelConfig
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, int, int]
    norm_before_residual: bool
    own_embedding: bool


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default: the inputs of layers 2, L // 2 and L - 3."""
    return (2, num_layers // 2, num_layers - 3)


def with_head(spec, model_dir: Path):
    """`spec` with its head's folder: as given, or for the shipped model the head that ships
    beside it; `ValueError` when there is none."""
    from jaxserve.default_model import DEFAULT_EAGLE3_DIR, DEFAULT_MODEL_DIR

    if spec.model is not None:
        return spec
    if Path(model_dir).resolve() != DEFAULT_MODEL_DIR or not DEFAULT_EAGLE3_DIR.is_dir():
        raise ValueError("speculative_config.model is required with method 'eagle3': the "
                         "head's folder or Hub id (a head ships for the shipped model only)")
    return dataclasses.replace(spec, model=str(DEFAULT_EAGLE3_DIR))


def read_config(spec, target: ModelConfig, config_only: bool = False
                ) -> tuple[Path, Eagle3Config]:
    """The head's folder and `Eagle3Config`; `ValueError` naming `speculative_config.model`
    when it cannot draft for `target`."""
    folder = resolve_model(spec.model, config_only=config_only)
    name = f"speculative_config.model {spec.model!r}"
    try:
        hf = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{name}: cannot read its config.json ({err})") from err
    if hf.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{name} has {hf['num_hidden_layers']} layers; an EAGLE-3 head has 1")
    if target.gemma is not None or target.moe is not None:
        raise ValueError(f"speculative_config.method 'eagle3' supports Llama, Mistral and "
                         f"Qwen targets for now, not {target.model_type!r}")
    layer = config_from_hf({**hf, "model_type": "llama", "num_hidden_layers": 1,
                            "vocab_size": target.vocab_size, "tie_word_embeddings": False})
    ids = hf.get("eagle_aux_hidden_state_layer_ids") or (hf.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids") or default_aux_layers(target.num_layers)
    if len(ids) != 3 or not all(0 <= i < target.num_layers for i in ids):
        raise ValueError(f"{name}: eagle_aux_hidden_state_layer_ids {list(ids)} must be three "
                         f"layers of the target's {target.num_layers}")
    target_hidden = int(hf.get("target_hidden_size") or hf["hidden_size"])
    if target_hidden != target.hidden_size:
        raise ValueError(f"{name} reads hidden states of {target_hidden}; the target's are "
                         f"{target.hidden_size} wide")
    if hf.get("vocab_size", target.vocab_size) != target.vocab_size:
        raise ValueError(f"{name} has a vocabulary of {hf['vocab_size']} tokens; the target's "
                         f"has {target.vocab_size} (a draft must share the target's tokenizer)")
    own = any("embed_tokens" in key for key in _tensor_names(folder)) if not config_only \
        else False
    return folder, Eagle3Config(layer, int(hf.get("draft_vocab_size") or target.vocab_size),
                                target_hidden, tuple(int(i) for i in ids),
                                bool(hf.get("norm_before_residual", False)), own)


class Eagle3Head(nnx.Module):
    """The head's weights and its forward (module docstring). `config` is its one-layer
    config, so that the runner sizes and pages its KV pool as a draft model's."""

    def __init__(self, eagle: Eagle3Config, dtype, rngs: nnx.Rngs):
        cfg = eagle.layer
        e, hq, hkv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.eagle = eagle
        self.config = cfg
        self.scan_layers = False
        self.compute_dtype = jnp.dtype(dtype)
        self.fc = random_param(rngs, (3 * eagle.target_hidden_size, e), dtype, ("embed", "embed"))
        self.input_norm = norm(cfg, e, dtype)
        self.hidden_norm = norm(cfg, e, dtype)
        self.attn = Attention(cfg, dtype, rngs)
        # q, k and v read the embedding and the hidden state side by side: [2E, heads, D]
        self.attn.q_proj = random_param(rngs, (2 * e, hq, d), dtype, ("embed", "heads", "head_dim"))
        self.attn.k_proj = random_param(rngs, (2 * e, hkv, d), dtype,
                                  ("embed", "kv_heads", "head_dim"))
        self.attn.v_proj = random_param(rngs, (2 * e, hkv, d), dtype,
                                  ("embed", "kv_heads", "head_dim"))
        self.post_attention_norm = norm(cfg, e, dtype)
        self.mlp = MLP(cfg, dtype, rngs)
        self.final_norm = norm(cfg, e, dtype)
        self.lm_head = random_param(rngs, (e, eagle.draft_vocab_size), dtype, ("embed", "vocab"))
        self.d2t = nnx.Variable(jnp.zeros((eagle.draft_vocab_size,), jnp.int32))
        self.embed = (random_param(rngs, (cfg.vocab_size, e), dtype, ("vocab", "embed"))
                      if eagle.own_embedding else None)

    def joined(self, aux: jax.Array) -> jax.Array:
        """The target's three hidden states `[..., 3 Et]` → the head's hidden input `[..., E]`."""
        return aux.astype(self.compute_dtype) @ self.fc[...]

    def on_mesh(self, mesh) -> "Eagle3Head":
        """This head with every parameter replicated on `mesh`, its kv heads repeated as the
        target's are where the mesh splits the heads finer than it has kv heads (the
        attention and the head's KV pool split over the same devices as the target's)."""
        repeats = _kv_repeats(self.config, mesh)
        if repeats > 1:
            for proj in (self.attn.k_proj, self.attn.v_proj):  # [2E, Hkv, D]
                proj.set_value(jnp.repeat(proj[...], repeats, axis=1))
            self.config = _with_repeats(self.config, repeats)
            self.eagle = dataclasses.replace(self.eagle, layer=self.config)
        graphdef, state = nnx.split(self)
        replicated = NamedSharding(mesh, PartitionSpec())
        return nnx.merge(graphdef, jax.tree.map(lambda a: jax.device_put(a, replicated),
                                                state))

    def embeddings(self, target, token_ids: jax.Array) -> jax.Array:
        """`[..., E]` embeddings of `token_ids`: the head's own table, else the target's."""
        if self.embed is not None:
            return embedding_rows(self.embed[...], None, token_ids, self.compute_dtype)
        scale = None if target.embed_scale is None else target.embed_scale[...]
        return embedding_rows(target.embed[...], scale, token_ids, self.compute_dtype)

    def __call__(self, embeds, hidden, positions, cache, attention):
        """Token embeddings `[T, E]` with their hidden inputs `[T, E]` (joined target states
        or the head's own earlier outputs) at `positions [T]` → (output before the final norm
        `[T, E]`, drafted target token ids `[T]`, the head's cache (a one-layer list))."""
        hidden = hidden.astype(self.compute_dtype)
        normed_hidden = self.hidden_norm(hidden)
        residual = normed_hidden if self.eagle.norm_before_residual else hidden
        x = jnp.concatenate([self.input_norm(embeds), normed_hidden], axis=-1)  # [T, 2E]
        out, layer_cache = self.attn(0, x, positions, attention, cache[0])
        x = residual + out
        x = x + self.mlp(self.post_attention_norm(x))  # [T, E]
        logits = self.draft_logits(x)  # [T, Vd]
        peak = jnp.max(logits, axis=-1, keepdims=True)
        draft = jnp.min(jnp.where(logits == peak, jnp.arange(logits.shape[-1]),
                                  logits.shape[-1]), axis=-1)  # [T] first argmax
        return x, (draft + self.d2t[...][draft]).astype(jnp.int32), [layer_cache]

    def draft_logits(self, out: jax.Array) -> jax.Array:
        """The head's outputs before its final norm `[..., E]` → float32 logits over the
        draft vocabulary `[..., Vd]`."""
        return self.final_norm(out).astype(jnp.float32) @ self.lm_head[...].astype(
            jnp.float32)


def _tensor_names(folder: Path) -> list[str]:
    from safetensors import safe_open

    names = []
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "np") as f:
            names += list(f.keys())
    return names


def _hf_tensors(folder: Path) -> dict[str, np.ndarray]:
    """The head's tensors by their Hugging Face names, `midlayer.` (or `layers.0.`) and any
    `model.` prefix removed; `t2d` dropped (the mapping back is not needed)."""
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        for name, array in load_file(file).items():
            name = name.removeprefix("model.")
            for prefix in ("midlayer.", "layers.0."):
                name = name.replace(prefix, "layer.", 1) if name.startswith(prefix) else name
            if name != "t2d":
                tensors[name] = array
    return tensors


def _converted(eagle: Eagle3Config, tensors: dict[str, np.ndarray]) -> dict[tuple, np.ndarray]:
    """Parameter path → array in the head's layout (kernels `[in, out]`, heads split)."""
    cfg = eagle.layer
    hq, hkv, d, e = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size

    def heads(name, count):  # HF [count * D, 2E] → [2E, count, D]
        return tensors[name].T.reshape(2 * e, count, d)

    table = {
        ("fc",): lambda: tensors["fc.weight"].T,
        ("input_norm", "weight"): lambda: tensors["layer.input_layernorm.weight"],
        ("hidden_norm", "weight"): lambda: tensors["layer.hidden_norm.weight"],
        ("post_attention_norm", "weight"):
            lambda: tensors["layer.post_attention_layernorm.weight"],
        ("final_norm", "weight"): lambda: tensors["norm.weight"],
        ("attn", "q_proj"): lambda: heads("layer.self_attn.q_proj.weight", hq),
        ("attn", "k_proj"): lambda: heads("layer.self_attn.k_proj.weight", hkv),
        ("attn", "v_proj"): lambda: heads("layer.self_attn.v_proj.weight", hkv),
        ("attn", "o_proj"): lambda: tensors["layer.self_attn.o_proj.weight"].T.reshape(
            hq, d, e),
        ("mlp", "gate_proj"): lambda: tensors["layer.mlp.gate_proj.weight"].T,
        ("mlp", "up_proj"): lambda: tensors["layer.mlp.up_proj.weight"].T,
        ("mlp", "down_proj"): lambda: tensors["layer.mlp.down_proj.weight"].T,
        ("lm_head",): lambda: tensors["lm_head.weight"].T,
        ("d2t",): lambda: tensors.get("d2t", np.zeros(eagle.draft_vocab_size, np.int64)),
    }
    if eagle.own_embedding:
        table[("embed",)] = lambda: tensors["embed_tokens.weight"]
    try:
        return {path: make() for path, make in table.items()}
    except KeyError as err:
        raise ValueError(f"the EAGLE-3 head lacks tensor {err.args[0]!r}") from err


def load_head(spec, target: ModelConfig, dtype) -> Eagle3Head:
    """The head of `speculative_config.model`, its weights in `dtype` (`d2t` int32)."""
    folder, eagle = read_config(spec, target)
    head = nnx.eval_shape(lambda: Eagle3Head(eagle, dtype, nnx.Rngs(0)))
    graphdef, state = nnx.split(head)
    variables = dict(nnx.to_flat_state(state))
    for path, array in _converted(eagle, _hf_tensors(folder)).items():
        want = variables[path].get_value()
        if tuple(array.shape) != tuple(want.shape):
            raise ValueError(f"speculative_config.model {spec.model!r}: tensor for "
                             f"{'.'.join(path)} has shape {array.shape}, expected {want.shape}")
        variables[path].set_value(jnp.asarray(array, want.dtype))
    return nnx.merge(graphdef, nnx.from_flat_state(variables))


def _kv_repeats(config: ModelConfig, mesh) -> int:
    """Copies of each kv head the head stores on `mesh` (`sharding.kv_head_repeats`)."""
    return sharding.kv_head_repeats(config.num_kv_heads, config.num_heads,
                                    sharding.tensor_parallel_size(mesh))


def _with_repeats(config: ModelConfig, repeats: int) -> ModelConfig:
    return dataclasses.replace(config, num_kv_heads=config.num_kv_heads * repeats)


def abstract_head(spec, target: ModelConfig, dtype, mesh) -> Eagle3Head:
    """The head's shapes, replicated on `mesh` (`jaxserve plan`: its config.json is all that
    is read)."""
    _, eagle = read_config(spec, target, config_only=True)
    eagle = dataclasses.replace(eagle, layer=_with_repeats(
        eagle.layer, _kv_repeats(eagle.layer, mesh)))  # as `on_mesh` stores them
    head = nnx.eval_shape(lambda: Eagle3Head(eagle, dtype, nnx.Rngs(0)))
    graphdef, state = nnx.split(head)
    replicated = NamedSharding(mesh, PartitionSpec())
    return nnx.merge(graphdef, jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), state))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Pending:
    """What each row's head has not read yet with the target's hidden states: the tokens the
    last round kept (or the current token alone), each with the target's joined state at the
    position before it."""

    tokens: jax.Array  # [S, W] int32
    hidden: jax.Array  # [S, W, E]
    count: jax.Array  # [S] int32, leading columns that are pending


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class State:
    """Every row's `Pending` between programs, kept beside the head's KV pool (so it is
    donated and updated in place like the cache), indexed like the runner's `last_tokens`:
    a row of the next program reads the one of the row its current token came from. Flat
    1-D arrays (never mistaken for a page pool)."""

    tokens: jax.Array  # [R * W] int32
    hidden: jax.Array  # [R * W * E]
    count: jax.Array  # [R] int32

    @classmethod
    def zeros(cls, rows: int, width: int, hidden: int, dtype, sharding=None,
              abstract: bool = False) -> "State":
        shapes = (((rows * width,), jnp.int32), ((rows * width * hidden,), dtype),
                  ((rows,), jnp.int32))
        if abstract:
            return cls(*(jax.ShapeDtypeStruct(shape, t, sharding=sharding)
                         for shape, t in shapes))
        return cls(*(jax.device_put(jnp.zeros(shape, t), sharding) for shape, t in shapes))

    def pending(self, source: jax.Array, current: jax.Array, width: int) -> Pending:
        """The `Pending` of rows whose current token `[S]` came from row `source [S]` of the
        last program (-1: from the host; then the current token alone, with no state)."""
        rows = self.count.shape[0]
        tokens = self.tokens.reshape(rows, width)[jnp.maximum(source, 0)]
        hidden = self.hidden.reshape(rows, width, -1)[jnp.maximum(source, 0)]
        known = (source >= 0)[:, None]
        fresh = jnp.zeros_like(tokens).at[:, 0].set(current)
        return Pending(jnp.where(known, tokens, fresh),
                       jnp.where(known[..., None], hidden, 0),
                       jnp.where(source >= 0, self.count[jnp.maximum(source, 0)], 1))

    def last_hidden(self, source: jax.Array, width: int) -> jax.Array:
        """`[S, E]` the joined state before each row's current token (zeros: unknown)."""
        rows = self.count.shape[0]
        row = jnp.maximum(source, 0)  # [S]
        column = jnp.maximum(self.count[row] - 1, 0)  # [S] the last kept token's
        last = self.hidden.reshape(rows, width, -1)[row, column]  # [S, E]
        return jnp.where((source >= 0)[:, None], last, 0)

    def stored(self, pending: Pending) -> "State":
        """This state with rows `0..S-1` replaced by `pending` (the next program's sources)."""
        rows, width = pending.tokens.shape
        total = self.count.shape[0]
        pad = total - rows
        return State(
            jnp.pad(pending.tokens, ((0, pad), (0, 0))).reshape(-1),
            jnp.pad(pending.hidden.astype(self.hidden.dtype),
                    ((0, pad), (0, 0), (0, 0))).reshape(-1),
            jnp.pad(pending.count, (0, pad)))


def single(tokens: jax.Array, hidden: jax.Array, width: int) -> Pending:
    """One pending token a row `[S]`, with its joined state `[S, E]`."""
    rows = tokens.shape[0]
    return Pending(jnp.zeros((rows, width), jnp.int32).at[:, 0].set(tokens),
                   jnp.zeros((rows, width, hidden.shape[-1]), hidden.dtype).at[:, 0].set(
                       hidden), jnp.ones((rows,), jnp.int32))


def step_hidden(head: Eagle3Head, aux: jax.Array, cu_q_lens: jax.Array,
                carried: jax.Array) -> jax.Array:
    """A step's head inputs: for each token `[T]`, the joined target state of the token
    before it (`aux [T, 3 Et]` shifted by one); a row's first token of the step gets the
    state carried from the program before (`carried [T, E]`, zeros where unknown)."""
    joined = head.joined(aux)  # [T, E]
    shifted = jnp.concatenate([jnp.zeros_like(joined[:1]), joined[:-1]])
    first = jnp.zeros((joined.shape[0],), jnp.bool_).at[cu_q_lens[:-1]].set(True,
                                                                          mode="drop")
    return jnp.where(first[:, None], carried.astype(joined.dtype), shifted)


def propose(head: Eagle3Head, head_attention, target, caches, pending: Pending, k: int,
            position, active, page_indices, num_seqs, page_size: int):
    """k drafts a row `[S, k]` and the head's cache, in one loop of one-token steps (one
    cache write in the program): first the pending tokens (positions `position - count + 1
    .. position`) with the target's states, writing their K/V; the head's output at the last
    of them drafts the first token; then each draft is fed back with the head's own output,
    k - 1 times. The loop runs as many steps as the row with the most pending tokens needs
    (k of them after a round that kept one token per row, 2k after one that kept k + 1)."""
    rows, width = pending.tokens.shape
    row = jnp.arange(rows)
    start = position - pending.count + 1  # [S]
    valid = row < num_seqs[0]
    cu_q_lens = jnp.minimum(jnp.arange(rows + 1), num_seqs[0]).astype(jnp.int32)
    columns = page_indices.shape[1]

    def step(j, carry):
        token, hidden, drafts, caches = carry  # the head's last draft `[S]` and output
        feeding = j < pending.count  # [S]
        column = jnp.minimum(j, width - 1)
        token = jnp.where(feeding, pending.tokens[row, column], token)
        hidden = jnp.where(feeding[:, None], pending.hidden[row, column], hidden)
        at = start + j  # [S]
        drafted_index = j - pending.count + 1  # the draft this step's output is
        writes = active & (feeding | (drafted_index < k))
        slots = page_slots(page_indices, at[:, None], page_size, writes[:, None])[:, 0]
        seen = jnp.minimum(at + 1, columns * page_size)
        batch = PagedBatch(slots, jnp.where(valid, seen, 0), page_indices, cu_q_lens,
                           num_seqs, decode_only=True)
        hidden, token, caches = head(head.embeddings(target, token), hidden, at, caches,
                                     head_attention.for_step(batch))
        kept = (drafted_index >= 0) & (drafted_index < k)
        drafts = drafts.at[row, jnp.where(kept, drafted_index, k)].set(token, mode="drop")
        return token, hidden, drafts, caches

    zeros = jnp.zeros((rows,), jnp.int32)
    hidden = jnp.zeros((rows, head.config.hidden_size), head.compute_dtype)
    drafts = jnp.zeros((rows, k), jnp.int32)
    steps = jnp.max(jnp.where(active, pending.count, 1)) + k - 1  # <= width + k - 1
    _, _, drafts, caches = jax.lax.fori_loop(0, steps, step, (zeros, hidden, drafts, caches))
    return drafts, caches
