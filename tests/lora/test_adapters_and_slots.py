"""Reading PEFT folders (`jaxserve.lora.adapter`) and sharing the device slots
(`jaxserve.lora.slots`), against hand-computed cases: the stacks are the folder's tensors
transposed, zero-padded and scaled as PEFT scales them (read back with safetensors' torch
reader, not jaxserve's); what jaxserve does not serve is refused naming the field; slots go
to the least recently released adapter nobody uses."""

import dataclasses
import json
import math

import numpy as np
import pytest
from safetensors.torch import load_file

from jaxserve.loading.checkpoint import model_config
from jaxserve.lora.adapter import load_adapter
from jaxserve.lora.slots import Adapter, SlotTable
from peft_adapters import ADAPTERS, write_adapter
from tiny_models import build_model

PREFIX = "base_model.model.model.layers"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora_base")
    build_model("llama", folder)
    return folder


@pytest.fixture(scope="module")
def everything(base, tmp_path_factory):
    folder = tmp_path_factory.mktemp("everything")
    write_adapter(base, folder, 0, **ADAPTERS["everything"])
    return folder


def test_stacks_are_the_peft_tensors_transposed_padded_and_scaled(base, everything):
    config = ADAPTERS["everything"]
    adapter = load_adapter(everything, model_config(base), max_lora_rank=12)
    tensors = {k: v.numpy() for k, v in load_file(everything / "adapter_model.safetensors")
               .items()}
    r = config["r"]
    scale = config["lora_alpha"] / math.sqrt(r)  # use_rslora
    assert adapter.rank == r
    for module in config["target_modules"]:
        a_stack, b_stack = adapter.stacks[module]
        part = "self_attn" if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) \
            else "mlp"
        for layer in range(2):
            key = f"{PREFIX}.{layer}.{part}.{module}"
            a, b = tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"]
            np.testing.assert_array_equal(a_stack[layer, :, :r], a.T)
            np.testing.assert_allclose(b_stack[layer, :r, :], b.T * scale, rtol=1e-6)
            assert not a_stack[layer, :, r:].any() and not b_stack[layer, r:, :].any()


def test_modules_an_adapter_leaves_alone_are_zero(base, tmp_path):
    write_adapter(base, tmp_path, 1, **ADAPTERS["attn"])
    adapter = load_adapter(tmp_path, model_config(base), max_lora_rank=8)
    assert adapter.rank == 4
    for module in ("k_proj", "gate_proj", "up_proj", "down_proj"):
        assert not any(stack.any() for stack in adapter.stacks[module])
    assert adapter.stacks["q_proj"][1].any()


def _edited(folder, tmp_path, **fields):
    """A copy of adapter `folder` with `fields` set in its adapter_config.json."""
    config = json.loads((folder / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, **fields}))
    (tmp_path / "adapter_model.safetensors").write_bytes(
        (folder / "adapter_model.safetensors").read_bytes())
    return tmp_path


@pytest.mark.parametrize("fields, named", [
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"use_dora": True}, "use_dora"),
    ({"bias": "all"}, "bias"),
    ({"alpha_pattern": {"q_proj": 3}}, "alpha_pattern"),
    ({"lora_alpha": 0}, "lora_alpha"),
    ({"peft_type": "IA3"}, "peft_type"),
])
def test_what_is_not_served_is_refused_by_name(base, everything, tmp_path, fields, named):
    with pytest.raises(ValueError, match=named):
        load_adapter(_edited(everything, tmp_path, **fields), model_config(base), 8)


def test_bad_folders_are_refused_with_the_reason(base, everything, tmp_path):
    cfg = model_config(base)
    with pytest.raises(ValueError, match="max_lora_rank=4"):
        load_adapter(everything, cfg, 4)
    with pytest.raises(ValueError, match="adapter_config.json"):
        load_adapter(tmp_path, cfg, 8)
    (tmp_path / "adapter_config.json").write_text(
        (everything / "adapter_config.json").read_text())
    with pytest.raises(ValueError, match="adapter_model.safetensors"):
        load_adapter(tmp_path, cfg, 8)
    wider = dataclasses.replace(cfg, hidden_size=2 * cfg.hidden_size)
    with pytest.raises(ValueError, match="another model"):
        load_adapter(everything, wider, 8)
    (tmp_path / "lm_head").mkdir()
    write_adapter(base, tmp_path / "lm_head", 0, r=2, lora_alpha=2,
                  target_modules=["lm_head"])
    with pytest.raises(ValueError, match="not a LoRA weight of a decoder layer"):
        load_adapter(tmp_path / "lm_head", cfg, 8)


def test_slots_go_to_the_least_recently_released_adapter_nobody_uses():
    a, b, c = (Adapter.loaded(name, i, weights=None) for i, name in enumerate("abc", 1))
    table = SlotTable(2)
    assert table.acquire(a) == 0 and table.acquire(b) == 1 and table.acquire(a) == 0
    assert table.take_loads() == [(0, a), (1, b)] and table.take_loads() == []
    assert table.acquire(c) is None  # both slots in use
    table.release(1)  # b idle: its slot is the one to take
    assert table.running_and_waiting([c, a]) == (["a"], ["c"])
    assert table.acquire(c) == 1 and table.take_loads() == [(1, c)]
    table.release(0)
    table.release(0)  # a idle (no user left); c still in use
    assert table.acquire(b) == 0 and table.take_loads() == [(0, b)]
    table.release(1)
    table.release(0)  # c released before b: its slot goes first
    assert table.acquire(a) == 1 and table.acquire(b) == 0 and table.take_loads() == [(1, a)]
    table.forget(b)  # b in use: it keeps its slot until released
    assert table.adapters == [b, a]
    table.release(0)
    table.forget(b)
    assert table.adapters == [None, a]
    with pytest.raises(RuntimeError, match="released more often"):
        table.release(0)


@pytest.mark.parametrize("tokens", [1, 9])  # one token: gathered; more: masked
def test_the_delta_is_each_tokens_own_adapter(tokens):
    """`LoRABatch.delta` against a numpy loop over tokens: a token adds its slot's
    `x @ A @ B`, a token without an adapter (-1) adds exactly nothing."""
    import jax.numpy as jnp

    from jaxserve.model.lora import LoRABatch

    rng = np.random.default_rng(tokens)
    a = rng.normal(size=(3, 6, 4)).astype(np.float32)  # [S, in, R]
    b = rng.normal(size=(3, 4, 5)).astype(np.float32)  # [S, R, out]
    x = rng.normal(size=(tokens, 6)).astype(np.float32)
    slots = np.array([2] if tokens == 1 else [0, -1, 2, 1, 1, -1, 0, 2, -1], np.int32)
    stacks = {"q_proj": (jnp.asarray(a[None]), jnp.asarray(b[None]))}  # one layer
    batch = LoRABatch.of(stacks, jnp.asarray(slots)).layer(0)
    want = np.stack([x[t] @ a[s] @ b[s] if s >= 0 else np.zeros(5)
                     for t, s in enumerate(slots)])
    got = np.asarray(batch.delta("q_proj", jnp.asarray(x)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not got[slots < 0].any()
