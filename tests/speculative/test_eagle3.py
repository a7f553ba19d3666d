"""EAGLE-3 heads (`speculative_config` method "eagle3"), written by the test in the Hugging
Face layout of the `LlamaForCausalLMEagle3` checkpoints (`midlayer.*`, `fc`, `d2t`, a draft
vocabulary smaller than the target's):

- the loaded head's forward equals a numpy transcription of the EAGLE-3 layer (vLLM's
  arithmetic: norms, [embedding, hidden] attention input, residual from the hidden state,
  draft ids mapped through d2t);
- the engine with the head keeps the target's own tokens (greedy and seeded, beside rows
  that cannot speculate, with the plain decode loop past `disable_by_batch_size`), nothing
  compiles after warm-up, and drafts are proposed;
- a head that cannot draft for the target is refused by name.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxserve import LLM, SamplingParams
from jaxserve.reference.dense_attention import DenseAttention
from jaxserve.model.hf_config import config_from_hf
from tiny_models import SMALL_ENGINE, VOCAB

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, DRAFT_VOCAB = 64, 4, 2, 16, 96, 200
AUX = [0, 1, 1]  # the tiny target has 2 layers
PATTERN = [17, 40, 98, 203, 5, 77]


def write_head(folder, seed: int = 0, **config):
    """A random EAGLE-3 head for the tiny Llama (hidden 64, vocabulary 320): weights of
    spread 0.3 so that its drafts vary with the input; d2t maps 200 draft ids to distinct
    target ids."""
    rng = np.random.default_rng(seed)
    hf = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
          "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE, "num_hidden_layers": 1,
          "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
          "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB,
          "eagle_aux_hidden_state_layer_ids": AUX, **config}
    weight = lambda *shape: (0.3 * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
    targets = np.sort(rng.choice(VOCAB, DRAFT_VOCAB, replace=False))
    tensors = {
        "fc.weight": weight(HIDDEN, 3 * HIDDEN),
        "midlayer.input_layernorm.weight": 1 + weight(HIDDEN),
        "midlayer.hidden_norm.weight": 1 + weight(HIDDEN),
        "midlayer.post_attention_layernorm.weight": 1 + weight(HIDDEN),
        "midlayer.self_attn.q_proj.weight": weight(HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.k_proj.weight": weight(KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.v_proj.weight": weight(KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.o_proj.weight": weight(HIDDEN, HEADS * HEAD_DIM),
        "midlayer.mlp.gate_proj.weight": weight(INTERMEDIATE, HIDDEN),
        "midlayer.mlp.up_proj.weight": weight(INTERMEDIATE, HIDDEN),
        "midlayer.mlp.down_proj.weight": weight(HIDDEN, INTERMEDIATE),
        "norm.weight": 1 + weight(HIDDEN),
        "lm_head.weight": weight(DRAFT_VOCAB, HIDDEN),
        "d2t": (targets - np.arange(DRAFT_VOCAB)).astype(np.int64),
        "t2d": np.isin(np.arange(VOCAB), targets),
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf))
    save_file(tensors, str(folder / "model.safetensors"))
    return tensors


def rms(x, w, eps=1e-5):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def rope(x, positions, theta=10000.0):
    """HF Llama's rotary embedding (rotate-half) of x `[T, H, D]`."""
    half = x.shape[-1] // 2
    freq = theta ** (-np.arange(half) / half)  # [D / 2]
    angle = positions[:, None] * freq[None, :]  # [T, D / 2]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    first, second = x[..., :half], x[..., half:]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def head_numpy(t, embeds, hidden, positions):
    """The EAGLE-3 layer as vLLM computes it, causal over the given tokens: (output before
    the final norm `[T, E]`, drafted target ids `[T]`)."""
    residual = hidden
    x = np.concatenate([rms(embeds, t["midlayer.input_layernorm.weight"]),
                        rms(hidden, t["midlayer.hidden_norm.weight"])], axis=-1)
    q = (x @ t["midlayer.self_attn.q_proj.weight"].T).reshape(-1, HEADS, HEAD_DIM)
    k = (x @ t["midlayer.self_attn.k_proj.weight"].T).reshape(-1, KV_HEADS, HEAD_DIM)
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).reshape(-1, KV_HEADS, HEAD_DIM)
    q, k = rope(q, positions), rope(k, positions)
    k, v = np.repeat(k, HEADS // KV_HEADS, axis=1), np.repeat(v, HEADS // KV_HEADS, axis=1)
    scores = np.einsum("thd,uhd->htu", q, k) / np.sqrt(HEAD_DIM)
    scores = np.where(positions[None, None, :] <= positions[None, :, None], scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    attn = np.einsum("htu,uhd->thd", weights, v).reshape(len(positions), -1)
    x = residual + attn @ t["midlayer.self_attn.o_proj.weight"].T
    mlp_in = rms(x, t["midlayer.post_attention_layernorm.weight"])
    gate = mlp_in @ t["midlayer.mlp.gate_proj.weight"].T
    up = mlp_in @ t["midlayer.mlp.up_proj.weight"].T
    x = x + (gate / (1 + np.exp(-gate)) * up) @ t["midlayer.mlp.down_proj.weight"].T
    logits = rms(x, t["norm.weight"]) @ t["lm_head.weight"].T
    draft = logits.argmax(-1)
    return x, draft + t["d2t"][draft]


@pytest.fixture(scope="module")
def head_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eagle3")
    return folder, write_head(folder)


def spec_config(folder, **extra):
    return {"method": "eagle3", "model": str(folder), "num_speculative_tokens": 3, **extra}


def test_loaded_head_equals_the_numpy_transcription(folder, head_folder):
    from jaxserve.speculative import eagle3
    from jaxserve.config.speculative import SpeculativeConfig

    path, tensors = head_folder
    target = config_from_hf(json.loads((folder / "config.json").read_text()))
    head = eagle3.load_head(SpeculativeConfig.from_dict(spec_config(path)), target,
                            jnp.float32)
    assert head.eagle.aux_layer_ids == tuple(AUX) and head.eagle.draft_vocab_size == 200
    rng = np.random.default_rng(1)
    embeds = rng.standard_normal((7, HIDDEN)).astype(np.float32)
    aux = rng.standard_normal((7, 3 * HIDDEN)).astype(np.float32)
    hidden = aux @ tensors["fc.weight"].T
    positions = np.arange(3, 10)
    np.testing.assert_allclose(np.asarray(head.joined(jnp.asarray(aux))), hidden, rtol=1e-5,
                               atol=1e-5)
    attention = DenseAttention(jnp.asarray(positions)[None])
    out, drafted, _ = head(jnp.asarray(embeds)[None], jnp.asarray(hidden)[None],
                           jnp.asarray(positions)[None], [None], attention)
    want_out, want_drafted = head_numpy(tensors, embeds, hidden, positions)
    np.testing.assert_allclose(np.asarray(out[0]), want_out, rtol=2e-4, atol=2e-4)
    assert np.asarray(drafted[0]).tolist() == want_drafted.tolist()
    assert len(set(want_drafted.tolist())) > 3  # the drafts depend on the input


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_the_head_keeps_the_target_tokens(folder, head_folder):
    path, _ = head_folder
    base = LLM(str(folder), dtype="float32", progress=False, **SMALL_ENGINE)
    llm = LLM(str(folder), dtype="float32", progress=False, strict_compile=True,
              speculative_config=spec_config(path, disable_by_batch_size=3), **SMALL_ENGINE)
    prompts = [{"prompt_token_ids": (PATTERN * 6)[:n]} for n in (9, 14, 23, 31)]
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=4, max_tokens=30,
                            ignore_eos=True, logprobs=2)
    penalized = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                               presence_penalty=0.5)
    for params in (greedy, seeded, [greedy, penalized, greedy, seeded]):
        assert tokens(llm.generate(prompts, params)) == tokens(base.generate(prompts, params))
    # four rows run the plain loop (past disable_by_batch_size), then the last speculate
    mixed = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (5, 40) * 2]
    assert tokens(llm.generate(prompts, mixed)) == tokens(base.generate(prompts, mixed))
    counters = llm.engine.metrics.snapshot()["counters"]
    assert counters["spec_decode_num_draft_tokens"] > 100
    assert llm.engine.replicas[0].allocator.num_free_pages == llm.engine.num_pages - 1


def test_heads_that_cannot_draft_are_refused(folder, tmp_path):
    bad = [({"eagle_aux_hidden_state_layer_ids": [0, 1, 5]}, "must be three layers"),
           ({"target_hidden_size": 48}, "reads hidden states of 48"),
           ({"vocab_size": 400}, "vocabulary of 400"),
           ({"num_hidden_layers": 2}, "has 2 layers")]
    for i, (config, message) in enumerate(bad):
        write_head(tmp_path / str(i), **config)
        with pytest.raises(ValueError, match=message):
            LLM(str(folder), progress=False, speculative_config=spec_config(tmp_path / str(i)),
                **SMALL_ENGINE)
    with pytest.raises(ValueError, match="model is required with method 'eagle3'"):
        LLM(str(folder), progress=False, **SMALL_ENGINE,
            speculative_config={"method": "eagle3", "num_speculative_tokens": 2})


@pytest.mark.parametrize("tp", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_the_shipped_head_drafts_for_the_shipped_model(tp):
    """Without a `model`, the shipped model drafts with the head that ships beside it
    (`jaxserve.training.train_eagle3_head`). On Austen's prose its first proposal of a round
    is the model's own next token 72% of the time (measured here); fed the round's hidden
    states one position off it is right 53% of the time, so this checks that the rounds
    hand the head the states it was trained on. At tp=4 (slow step) the target's 2
    kv heads and the head's are each stored twice and the head's attention splits over the
    devices like the target's: as many drafts accepted, and the target's own tokens."""
    from jaxserve.default_model import DEFAULT_MODEL_DIR

    options = dict(max_num_seqs=4, seq_buckets=(4,), token_buckets=(128,),
                   max_num_batched_tokens=128)
    llm = LLM(str(DEFAULT_MODEL_DIR), dtype="float32", progress=False, tensor_parallel_size=tp,
              speculative_config={"method": "eagle3", "num_speculative_tokens": 2}, **options)
    assert llm.engine.runner.draft_config.num_kv_heads == (2 if tp == 1 else 4)
    text = (DEFAULT_MODEL_DIR / "heldout.txt").read_text()
    prompts = [text[i * 900:i * 900 + 300] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    counters = llm.engine.metrics.snapshot()["counters"]
    first = counters["spec_decode_num_accepted_tokens_per_pos:0"]
    assert first / counters["spec_decode_num_drafts"] > 0.65, counters
    # both proposals kept in 59% of rounds (the loop that feeds the head its own drafts)
    both = counters["spec_decode_num_accepted_tokens_per_pos:1"]
    assert both / counters["spec_decode_num_drafts"] > 0.4, counters
    if tp > 1:
        plain = LLM(str(DEFAULT_MODEL_DIR), dtype="float32", progress=False, **options)
        assert tokens(outputs) == tokens(plain.generate(prompts, params))
