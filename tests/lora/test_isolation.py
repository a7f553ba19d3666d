"""One adapter cannot change another row's output: the LoRA products select each token's own
slot (`jaxserve.model.lora`), the slot write keeps the slots finite
(`jaxserve.lora.stacks.write_slot`), and an unloaded adapter's slot is zeroed once nobody
uses it (`jaxserve.lora.slots`). The engine test runs one step mixing the base model, a
good adapter, an adapter whose `x @ A` overflows (finite weights: it passes the load checks)
and a NaN adapter put in the registry past the checks; the base and good rows must be the
tokens of transformers + peft."""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from jaxserve import LLM, LoRARequest, SamplingParams
from jaxserve.lora.adapter import LoRAAdapter
from jaxserve.lora.slots import Adapter, SlotTable
from peft_adapters import ADAPTERS, reference_tokens, write_adapter
from tiny_models import SMALL_ENGINE

MAX_TOKENS = 8
PROMPTS = [[5 + (7 * i + 3 * p) % 300 for i in range(20 + p)] for p in range(2)]


@pytest.mark.quick
def test_an_unloaded_adapters_slot_is_zeroed_once_idle():
    a, b = (Adapter.loaded(name, i, weights=None) for i, name in enumerate("ab", 1))
    table = SlotTable(2)
    assert table.acquire(a) == 0 and table.acquire(b) == 1
    table.take_loads()
    table.release(0)
    table.forget(a)  # idle: zeroed now
    assert table.adapters == [None, b] and table.take_loads() == [(0, None)]
    table.forget(b)  # in use: kept until released, then zeroed
    assert table.adapters == [None, b] and table.take_loads() == []
    table.release(1)
    assert table.adapters == [None, None] and table.take_loads() == [(1, None)]
    assert table.acquire(b) == 0 and table.take_loads() == [(0, b)]  # a request queued
    table.release(0)  # before the unload still runs with it; its slot is zeroed after
    assert table.take_loads() == [(0, None)]


def numpy_delta(x, a, b, slots):
    """Each token's own slot's `x @ A @ B` in float64 (zeros without one)."""
    return np.stack([x[t].astype(np.float64) @ a[s] @ b[s] if s >= 0 else np.zeros(b.shape[2])
                     for t, s in enumerate(slots)])


@pytest.mark.quick
@pytest.mark.parametrize("slots", [[-1], [2], [-1, 2], [-1, 2, 1, 0, 2, -1, 1, 2, -1]],
                         ids=["gathered-base", "gathered-own", "masked-2", "masked-9"])
@pytest.mark.parametrize("nan_b", [False, True])
def test_a_non_finite_slot_reaches_only_its_own_tokens(slots, nan_b):
    """Slot 0 holds NaN in A (and B), slot 1's A overflows `x @ A` to inf (huge but
    finite): a token without an adapter gets exactly zero (a one-token program reads slot
    0's weights for it), a slot-2 token its own delta (with finite B in the other slots:
    the masked contraction multiplies them by zeros, and the slot write keeps them
    finite)."""
    import jax.numpy as jnp

    from jaxserve.model.lora import LoRABatch

    slots = np.array(slots, np.int32)
    rng = np.random.default_rng(len(slots))
    a = rng.normal(size=(3, 6, 4)).astype(np.float32)  # [S, in, R]
    b = rng.normal(size=(3, 4, 5)).astype(np.float32)  # [S, R, out]
    a[0], a[1] = np.nan, 3e38
    if nan_b:
        b[0] = np.nan
    x = rng.normal(size=(len(slots), 6)).astype(np.float32)
    batch = LoRABatch.of({"q_proj": (jnp.asarray(a[None]), jnp.asarray(b[None]))},
                         jnp.asarray(slots)).layer(0)
    got = np.asarray(batch.delta("q_proj", jnp.asarray(x)))
    assert not got[slots == -1].any()
    own = np.flatnonzero(slots == 2)
    if own.size and (not nan_b or len(slots) == 1):
        np.testing.assert_allclose(got[own], numpy_delta(x[own], a, b, slots[own]),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.quick
def test_the_slot_write_zeroes_what_is_not_finite():
    import jax.numpy as jnp

    from jaxserve.lora.stacks import write_slot

    stacks = [jnp.ones((2, 3, 4), jnp.float16)]  # [L, S, n]
    new = np.array([[1.0, np.nan, np.inf, 7e4], [-np.inf, 2.0, 3.0, -1e5]],
                   np.float32)  # [L, n]; 7e4 and -1e5: beyond float16
    written = np.asarray(write_slot(stacks, jnp.int32(1), [jnp.asarray(new)])[0])
    np.testing.assert_array_equal(written[:, 1], [[1, 0, 0, 0], [0, 2, 3, 0]])
    np.testing.assert_array_equal(written[:, [0, 2]], 1)


def test_poisoned_adapters_leave_the_other_rows_of_a_step_alone(folder, tmp_path):
    """"huge" adapts the first layer's down_proj with A at 3e38: `x @ A` overflows for
    every token the masked product computes it for, so its own rows' hidden states, and
    their keys and values in the next layer, go non-finite; attention must not carry them to
    the other rows of the step (0 x NaN is NaN), nor a page they wrote to its next owner.
    "nan" is NaN throughout, past the checks."""
    base = folder
    write_adapter(base, tmp_path / "attn", 0, **ADAPTERS["attn"])
    write_adapter(base, tmp_path / "huge", 1, r=2, lora_alpha=2, target_modules=["down_proj"],
                  layers_to_transform=[0])
    weights = tmp_path / "huge" / "adapter_model.safetensors"
    save_file({k: torch.full_like(v, 3e38) if ".lora_A." in k else v
               for k, v in load_file(weights).items()}, weights)
    expected = {name: reference_tokens(base, None if name is None else tmp_path / name,
                                       PROMPTS, MAX_TOKENS) for name in (None, "attn")}
    assert expected[None] != expected["attn"]
    llm = LLM(str(base), dtype="float32", progress=False, enable_lora=True, max_loras=3,
              max_lora_rank=8, **SMALL_ENGINE)
    good = llm.engine.load_lora(LoRARequest("attn", 1, str(tmp_path / "attn")))
    huge = llm.engine.load_lora(LoRARequest("huge", 2, str(tmp_path / "huge")))
    nan = LoRAAdapter("nan", 8, {m: tuple(np.full_like(w, np.nan) for w in pair)
                                 for m, pair in good.weights.stacks.items()})
    llm.engine.loras._adapters["nan"] = Adapter.loaded("nan", 3, nan)  # past the checks
    requests = {"attn": LoRARequest("attn", 1, good.weights.path),
                "huge": LoRARequest("huge", 2, huge.weights.path),
                "nan": LoRARequest("nan", 3, "nan")}
    order = [None, "attn", "huge", "nan", None, "attn"]
    outputs = llm.generate([{"prompt_token_ids": PROMPTS[i % 2]} for i in range(len(order))],
                           SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                          ignore_eos=True),
                           lora_request=[requests.get(name) for name in order])
    for i, (name, output) in enumerate(zip(order, outputs)):
        if name in expected:
            assert output.outputs[0].token_ids == expected[name][i % 2], (i, name)
