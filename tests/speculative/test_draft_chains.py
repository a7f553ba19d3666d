"""The attention a draft head trains its later passes with (`jaxserve.training.draft_chains`)
against a numpy transcription of what a serving round shows each pass."""

import numpy as np
import jax.numpy as jnp

from jaxserve.training.draft_chains import ChainAttention


def _numpy_chain_attention(qs, ks, vs, group):
    """Pass j's output at row c: softmax over pass 0's keys at rows 0..c and passes 1..j's
    keys at row c, loop by loop."""
    outs = []
    for j, q in enumerate(qs):
        batch, chains, heads, dim = q.shape
        out = np.zeros(q.shape, np.float64)
        for b in range(batch):
            for c in range(chains):
                for h in range(heads):
                    kv = h // group
                    keys = [ks[0][b, s, kv] for s in range(c + 1)]
                    values = [vs[0][b, s, kv] for s in range(c + 1)]
                    keys += [ks[m][b, c, kv] for m in range(1, j + 1)]
                    values += [vs[m][b, c, kv] for m in range(1, j + 1)]
                    scores = np.array([q[b, c, h] @ key for key in keys]) / np.sqrt(dim)
                    weights = np.exp(scores - scores.max())
                    out[b, c, h] = (weights / weights.sum()) @ np.array(values)
        outs.append(out)
    return outs


def test_each_pass_sees_the_first_pass_causally_and_its_own_chain():
    rng = np.random.default_rng(0)
    batch, length, heads, kv_heads, dim, passes = 2, 6, 4, 2, 8, 3
    shape = lambda j, h: (batch, length - j, h, dim)  # noqa: E731
    qs = [rng.standard_normal(shape(j, heads)) for j in range(passes)]
    ks = [rng.standard_normal(shape(j, kv_heads)) * 2 for j in range(passes)]
    vs = [rng.standard_normal(shape(j, kv_heads)) for j in range(passes)]
    cache, got = (), []
    for j in range(passes):
        out, cache = ChainAttention()(0, *(jnp.asarray(a[j], jnp.float32) for a in (qs, ks, vs)),
                                      cache)
        got.append(np.asarray(out))
    want = _numpy_chain_attention(qs, ks, vs, heads // kv_heads)
    for j in range(passes):
        np.testing.assert_allclose(got[j], want[j], rtol=1e-4, atol=1e-5, err_msg=f"pass {j}")
