"""The ways (token, expert) pairs run through a mixture's experts
(`jaxserve.model.expert_mixtures`) against a numpy loop over the pairs: each mixture alone
on one device's share of the experts (pairs routed elsewhere add nothing, one expert held
here gets no pair), plain and int8; and `default_mixture` in each regime its rule names
(each case's busiest expert checked against the capacities counted by hand)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.model.expert_mixtures import (ExpertKernels, blocked_mixture, capacity_mixture,
                                            default_mixture, gathered_mixture, sort_pairs)
from jaxserve.model.quantization import dequantize, quantize

pytestmark = pytest.mark.quick

HIDDEN, WIDTH, TOP_K, FIRST = 16, 24, 2, 2  # experts 2, 3, .. held here


def routing(tokens: int, num_experts: int, case: str, rng) -> np.ndarray:
    """`[T, 2]` distinct experts a token: "spread" draws both; "one_takes_all" gives expert 3
    (held) every token's first choice; expert 5 (held) never appears."""
    others = [e for e in range(num_experts) if e not in (3, 5)]
    first = (np.full(tokens, 3) if case == "one_takes_all"
             else rng.choice(others, tokens))
    second = np.array([rng.choice([e for e in others if e != f]) for f in first])
    return np.stack([first, second], axis=1).astype(np.int32)


def numpy_mixture(x, weights, experts, gate, up, down) -> np.ndarray:
    """Each token's pairs held here (experts FIRST .. FIRST + len(gate)), one at a time."""
    out = np.zeros_like(x)
    for t in range(len(x)):
        for w, e in zip(weights[t], experts[t]):
            j = e - FIRST
            if 0 <= j < len(gate):
                g, u = x[t] @ gate[j], x[t] @ up[j]
                out[t] += w * ((g / (1 + np.exp(-g)) * u) @ down[j])
    return out


def layer(tokens: int, case: str, held: int, num_experts: int, method=None, seed=0):
    """(x, weights, experts, kernels of the `held` experts here, the float weights they
    stand for)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(tokens, HIDDEN)).astype(np.float32)
    weights = rng.uniform(size=(tokens, TOP_K)).astype(np.float32)
    experts = routing(tokens, num_experts, case, rng)
    floats = [rng.normal(size=shape).astype(np.float32) * 0.3 for shape in (
        (held, HIDDEN, WIDTH), (held, HIDDEN, WIDTH), (held, WIDTH, HIDDEN))]
    if method is None:
        kernels = ExpertKernels(*map(jnp.asarray, floats))
    else:
        quantized = [quantize(w, method, (1,)) for w in floats]
        floats = [dequantize(codes, scale, (1,)) for codes, scale in quantized]
        kernels = ExpertKernels(*(jnp.asarray(c) for c, _ in quantized),
                                *(jnp.asarray(s) for _, s in quantized))
    return x, weights, experts, kernels, floats


@pytest.mark.parametrize("method", [None, "int8"])
@pytest.mark.parametrize("mixture", ["gathered", "capacity", "blocked"])
def test_each_mixture_matches_the_pair_loop(mixture, method):
    """30 tokens routed over 8 experts, 4 of them held here, expert 3 every token's first
    choice and 5 nobody's. The capacity is exactly the busiest held expert's rows (30)."""
    x, weights, experts, kernels, floats = layer(30, "one_takes_all", 4, 8, method)
    args = (jnp.asarray(x), jnp.asarray(weights))
    pairs = sort_pairs(jnp.asarray(experts), 4, FIRST)
    np.testing.assert_array_equal(np.asarray(pairs.group_sizes), [
        np.sum(experts == e) for e in range(FIRST, FIRST + 4)])
    run = {"gathered": lambda: gathered_mixture(*args, jnp.asarray(experts), kernels, FIRST),
           "capacity": lambda: capacity_mixture(*args, pairs, kernels, capacity=30),
           "blocked": lambda: blocked_mixture(*args, pairs, kernels)}[mixture]
    np.testing.assert_allclose(np.asarray(jax.jit(run)()),
                               numpy_mixture(x, weights, experts, *floats),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tokens, case, held, shards, busiest", [
    # 2 pairs, 2 * 4 <= 16 experts in all: gathered weights
    (1, "spread", 4, 4, None),
    # m = 48 pairs / 8 experts = 6; capacities 12 and 24 (4m = T): 2m holds the busiest
    (24, "spread", 4, 2, range(0, 13)),
    # the same capacities, expert 3 in every token: 4m
    (24, "one_takes_all", 4, 2, [24]),
    # m = 3; capacities 6, 12, and T = 24 (4 experts x 24 rows <= 2 x 48 pairs): T
    (24, "one_takes_all", 4, 4, [24]),
    # m = 2; capacities 4 and 8; 6 x 24 rows > 2 x 48 pairs, so no T: blocks
    (24, "one_takes_all", 6, 4, [24]),
])
def test_default_mixture_in_each_regime(tokens, case, held, shards, busiest):
    x, weights, experts, kernels, floats = layer(tokens, case, held, held * shards, seed=3)
    if busiest is not None:
        assert max(np.sum(experts == e) for e in range(FIRST, FIRST + held)) in busiest
    got = jax.jit(default_mixture, static_argnums=(4, 5))(
        jnp.asarray(x), jnp.asarray(weights), jnp.asarray(experts), kernels, FIRST, shards)
    np.testing.assert_allclose(np.asarray(got), numpy_mixture(x, weights, experts, *floats),
                               rtol=1e-4, atol=1e-4)
