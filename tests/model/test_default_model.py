"""The model shipped in `jaxserve/default_model`, and the export that wrote it.

- `transformers` loads the shipped folder and greedy-decodes the same tokens as jaxserve.
- On held-out text (`heldout.txt`, never trained on) its loss is well below a uniform guess.
- `save_hf_folder` round-trips a random model through `load_weights` bit for bit, and
  `transformers` computes the same logits from the exported folder.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from jaxserve import LLM, SamplingParams
from jaxserve.model.config import ModelConfig
from jaxserve.model.hf_config import load_config
from jaxserve.default_model import DEFAULT_MODEL_DIR
from jaxserve.model import LlamaModel
from jaxserve.reference.dense_attention import DenseAttention, empty_dense_cache
from jaxserve.model.contract import StepContext
from jaxserve.loading.tokenizer import Tokenizer
from jaxserve.training.export import save_hf_folder
from jaxserve.loading.weights import load_weights

PROMPTS = ["Once upon a time", "It is a truth universally acknowledged that"]
NEW_TOKENS = 32
MAX_FOLDER_BYTES = 8 * 2**20
UNIFORM_MARGIN = 0.6  # held-out loss must be below this fraction of ln(vocab_size)


@pytest.fixture(scope="module")
def hf_model():
    return transformers.LlamaForCausalLM.from_pretrained(
        DEFAULT_MODEL_DIR, dtype=torch.float32).eval()


def test_folder_is_small_and_complete():
    names = {p.name for p in DEFAULT_MODEL_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "heldout.txt", "README.md"} <= names
    assert sum(p.stat().st_size for p in DEFAULT_MODEL_DIR.iterdir()) <= MAX_FOLDER_BYTES


def test_greedy_tokens_match_transformers(hf_model):
    """On a one-rung ladder (the default engine's programs are compiled and audited by
    tests/engine/test_cache_audit.py; the buckets do not change greedy tokens)."""
    llm = LLM(str(DEFAULT_MODEL_DIR), dtype="float32", progress=False, max_num_seqs=2,
              max_num_batched_tokens=64, token_buckets=(64,), seq_buckets=(2,),
              num_decode_steps=8)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for prompt, output in zip(PROMPTS, llm.generate(PROMPTS, params)):
        ids = torch.tensor([output.prompt_token_ids])
        with torch.no_grad():
            reference = hf_model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                do_sample=False, eos_token_id=None, pad_token_id=2)[0, ids.shape[1]:].tolist()
        print(f"\n{prompt!r} -> {output.outputs[0].text!r}")
        assert output.outputs[0].token_ids == reference
        assert len(output.outputs[0].text.split()) > 10  # words, not byte soup


def _heldout_windows(length: int) -> np.ndarray:
    """heldout.txt as `<s> paragraph </s>` tokens, cut into windows `[N, length]`."""
    tok = Tokenizer(DEFAULT_MODEL_DIR)
    lines = (DEFAULT_MODEL_DIR / "heldout.txt").read_text().splitlines()
    stream = [t for line in lines if line for t in tok.encode(line) + [tok.eos_token_id]]
    count = len(stream) // length
    assert count >= 2, "heldout.txt is too short"
    return np.asarray(stream[:count * length], np.int32).reshape(count, length)


def test_heldout_loss_is_far_below_a_uniform_guess():
    cfg = load_config(DEFAULT_MODEL_DIR)
    model = load_weights(DEFAULT_MODEL_DIR, cfg, jnp.float32, progress=False)
    tokens = _heldout_windows(257)  # [N, T+1]
    positions = np.broadcast_to(np.arange(256), (len(tokens), 256))  # [N, T]
    hidden = model(tokens[:, :-1], positions, [None] * cfg.num_layers,
                   StepContext(DenseAttention(positions))).hidden
    logp = jax.nn.log_softmax(model.logits(hidden), axis=-1)  # [N, T, V]
    loss = -float(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean())
    print(f"\nheld-out loss {loss:.3f} nats/token, uniform {math.log(cfg.vocab_size):.3f}")
    assert loss < UNIFORM_MARGIN * math.log(cfg.vocab_size)


def test_dense_attention_with_and_without_a_cache_equals_numpy():
    """Without a cache (training) queries see the step's own earlier keys; with one, the
    cache's keys up to their position. Both against a numpy softmax written out here."""
    rng = np.random.default_rng(0)
    q = rng.normal(size=(2, 7, 4, 16)).astype(np.float32)  # [B, T, Hq, D]
    k, v = rng.normal(size=(2, 2, 7, 2, 16)).astype(np.float32)  # [B, T, Hkv, D]
    want = np.zeros_like(q)
    for b, t, h in np.ndindex(2, 7, 4):
        scores = k[b, :t + 1, h // 2] @ q[b, t, h] / 4.0  # D ** 0.5 = 4
        weights = np.exp(scores - scores.max())
        want[b, t, h] = weights @ v[b, :t + 1, h // 2] / weights.sum()
    dense = DenseAttention(jnp.broadcast_to(jnp.arange(7), (2, 7)))
    out, cache = dense(0, q, k, v, None)
    assert cache is None
    np.testing.assert_allclose(out, want, atol=1e-5)
    out, _ = dense(0, q, k, v, empty_dense_cache(1, 2, 9, 2, 16, jnp.float32)[0])
    np.testing.assert_allclose(out, want, atol=1e-5)


def _random_model(cfg: ModelConfig) -> LlamaModel:
    """A model with every parameter random (norms and biases too), so no layout hides."""
    model = LlamaModel(cfg, jnp.float32, rngs=nnx.Rngs(1))
    for i, (_, var) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.Param))):
        noise = 0.1 * jax.random.normal(jax.random.key(i), var.get_value().shape)
        var.set_value(var.get_value() + noise)
    return model


def test_save_hf_folder_round_trip(tmp_path):
    cfg = ModelConfig(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=80,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                      max_position_embeddings=64, qkv_bias=True, o_bias=True, mlp_bias=True,
                      bos_token_id=0, eos_token_ids=(1,))
    model = _random_model(cfg)
    save_hf_folder(model, cfg, tmp_path)
    assert load_config(tmp_path) == dataclasses.replace(cfg, checkpoint_dtype="float32")
    loaded = load_weights(tmp_path, cfg, jnp.float32, progress=False)
    ours = dict(nnx.to_flat_state(nnx.state(model)))
    theirs = dict(nnx.to_flat_state(nnx.state(loaded)))
    assert ours.keys() == theirs.keys()
    for path in ours:
        assert np.array_equal(ours[path].get_value(), theirs[path].get_value()), path

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = np.arange(3, 40, dtype=np.int32)[None]  # [1, T]
    positions = np.arange(ids.shape[1])[None]
    hidden = model(ids, positions, [None] * cfg.num_layers,
                   StepContext(DenseAttention(positions))).hidden
    with torch.no_grad():
        reference = hf(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(model.logits(hidden), reference, atol=1e-4)
