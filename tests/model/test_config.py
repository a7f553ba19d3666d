"""Reading Hugging Face config.json: both rope layouts, architecture flags, clear errors."""

import json

import numpy as np
import pytest

from jaxserve.model.hf_config import config_from_hf, load_config
from jaxserve.model.rope import inverse_frequencies

pytestmark = pytest.mark.quick  # seconds, no engine: `pytest -m quick`

BASE = dict(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
LLAMA3_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                      high_freq_factor=4.0, original_max_position_embeddings=8192)


def test_defaults_and_derived_head_dim():
    cfg = config_from_hf(BASE)
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.rope.theta) == (16, 2, 10000.0)
    assert not (cfg.qkv_bias or cfg.o_bias or cfg.qk_norm or cfg.tie_word_embeddings)


def test_rope_layouts_of_transformers_4_and_5_agree():
    legacy = config_from_hf({**BASE, "rope_theta": 500000.0, "rope_scaling": LLAMA3_SCALING})
    modern = config_from_hf({**BASE, "rope_parameters": {**LLAMA3_SCALING,
                                                        "rope_theta": 500000.0}})
    assert legacy == modern
    assert modern.rope.rope_type == "llama3" and modern.rope.theta == 500000.0


def test_llama3_frequencies_hand_computed():
    """Wavelengths above 8192/1 are divided by 8; below 8192/4 kept; between, blended."""
    cfg = config_from_hf({**BASE, "rope_parameters": {**LLAMA3_SCALING, "rope_theta": 500000.0}})
    plain = 1.0 / 500000.0 ** (np.arange(0, 16, 2) / 16)
    scaled = inverse_frequencies(cfg.rope, 16)
    wavelen = 2 * np.pi / plain
    assert np.allclose(scaled[wavelen < 2048], plain[wavelen < 2048])
    assert np.allclose(scaled[wavelen > 8192], plain[wavelen > 8192] / 8)
    middle = (wavelen >= 2048) & (wavelen <= 8192)
    smooth = (8192 / wavelen[middle] - 1) / 3
    assert np.allclose(scaled[middle], (1 - smooth) * plain[middle] / 8 + smooth * plain[middle])


@pytest.mark.parametrize("yarn", [
    dict(factor=4.0, original_max_position_embeddings=32),
    dict(factor=8.0, original_max_position_embeddings=64, beta_fast=16.0, beta_slow=2.0,
         truncate=False),
    dict(factor=16.0, original_max_position_embeddings=128, mscale=1.0, mscale_all_dim=0.5),
    dict(factor=2.0, original_max_position_embeddings=32, attention_factor=1.5),
    dict(factor=4.0),  # the original length: max_position_embeddings
], ids=["plain", "betas-untruncated", "mscales", "attention-factor", "no-original"])
def test_yarn_frequencies_and_scale_equal_transformers(yarn):
    """inv_freq and the cos/sin scale equal transformers' `_compute_yarn_parameters` on the
    same config.json (gpt-oss, Qwen and DeepSeek-style fields)."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jaxserve.model.rope import rope_scale

    params = {"rope_type": "yarn", "rope_theta": 10000.0, **yarn}
    hf = {**BASE, "head_dim": 32, "max_position_embeddings": 256, "rope_parameters": params}
    want_freq, want_scale = ROPE_INIT_FUNCTIONS["yarn"](transformers.LlamaConfig(**hf), "cpu")
    rope = config_from_hf(hf).rope
    np.testing.assert_allclose(inverse_frequencies(rope, 32), want_freq.numpy(), rtol=1e-6)
    assert rope_scale(rope) == pytest.approx(want_scale, rel=1e-9)
    assert rope_scale(rope) != 1.0 or "attention_factor" in yarn


def test_architecture_flags():
    assert config_from_hf({**BASE, "model_type": "qwen2"}).qkv_bias
    assert not config_from_hf({**BASE, "model_type": "qwen2"}).o_bias
    qwen3 = config_from_hf({**BASE, "model_type": "qwen3", "head_dim": 32})
    assert qwen3.qk_norm and qwen3.head_dim == 32
    llama = config_from_hf({**BASE, "attention_bias": True, "tie_word_embeddings": True})
    assert llama.qkv_bias and llama.o_bias and llama.tie_word_embeddings
    assert config_from_hf({**BASE, "model_type": "mistral", "sliding_window": 4096}
                          ).sliding_window == 4096
    assert config_from_hf({**BASE, "eos_token_id": [7, 9]}).eos_token_ids == (7, 9)


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gpt2"}, "model_type 'gpt2'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "rope_type 'dynamic'"),
    ({"rope_scaling": {"rope_type": "yarn"}}, "'yarn' needs a 'factor'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"vocab_size": 0}, "vocab_size"),
    ({"layer_types": ["sliding_attention", "full_attention"]},
     "sliding_window must be a positive integer"),
    ({"layer_types": ["full_attention", "chunked_attention"]}, "layer_types must name"),
    ({"model_type": "gemma3_text", "sliding_window": 8,
      "rope_parameters": {"full_attention": {}}},
     "lacks \\['sliding_attention'\\]"),
])
def test_unsupported_settings_name_the_setting(change, message):
    with pytest.raises(ValueError, match=message):
        config_from_hf({**BASE, **change})


def test_each_family_says_which_layers_slide():
    """Without `layer_types` (transformers 4.x files), each family's own rule, counted by
    hand; with it, as written. Layers stack by the period their kinds repeat with, if
    they repeat at all (`scan_period`, `scan_groups`)."""
    def windows(**hf):
        return config_from_hf({**BASE, "num_hidden_layers": 6, "sliding_window": 8, **hf})

    gemma2 = windows(model_type="gemma2")
    assert gemma2.layer_windows == (8, None, 8, None, 8, None)
    assert (gemma2.scan_period, gemma2.scan_groups) == (2, 3)
    assert gemma2.tie_word_embeddings and gemma2.gemma.query_pre_attn_scalar == 16  # head_dim
    gemma3 = windows(model_type="gemma3_text", sliding_window_pattern=3, rope_theta=1e6,
                     rope_local_base_freq=1e4)
    assert gemma3.layer_windows == (8, 8, None, 8, 8, None)
    assert (gemma3.scan_period, gemma3.scan_groups) == (3, 2) and gemma3.scannable
    assert (gemma3.layer_rope(0).theta, gemma3.layer_rope(2).theta) == (1e4, 1e6)
    # transformers' Gemma 3 never applies an attention cap, whatever its config says
    assert windows(model_type="gemma3_text", attn_logit_softcapping=50.0
                   ).gemma.attn_logit_softcap is None
    qwen2 = windows(model_type="qwen2", use_sliding_window=True, max_window_layers=4)
    assert qwen2.layer_windows == (None,) * 4 + (8, 8)
    assert qwen2.scan_period == 6 and not qwen2.scannable  # the kinds never repeat
    assert windows(model_type="qwen2").layer_windows == (None,) * 6  # use_sliding_window off
    mistral = windows(model_type="mistral")
    assert mistral.layer_windows == (8,) * 6 and mistral.scan_period == 1
    assert windows(model_type="mistral", sliding_window=None).layer_windows == (None,) * 6
    written = windows(layer_types=["full_attention"] * 5 + ["sliding_attention"])
    assert written.layer_windows == (None,) * 5 + (8,)


def test_missing_field_and_bad_files(tmp_path):
    with pytest.raises(ValueError, match="num_hidden_layers"):
        config_from_hf({k: v for k, v in BASE.items() if k != "num_hidden_layers"})
    with pytest.raises(ValueError, match="no config.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    assert load_config(tmp_path).num_layers == 2
