"""On-device sampling against hand-computed distributions."""

import jax
import numpy as np
import pytest

from jaxserve.sampling.arrays import SamplingArrays
from jaxserve.sampling.sampler import (TokenCounts, _rank_filtered, allowed_tokens, sample,
                                     sample_with_logprobs, target_logprobs)
from jaxserve.sampling_params import MAX_LOGPROBS
from jaxserve.sampling_params import SamplingParams

# Row logits whose softmax is [0.5, 0.25, 0.125, 0.0625, 0.0625].
LOGITS = np.log(np.array([0.5, 0.25, 0.125, 0.0625, 0.0625], np.float32))
DRAWS = 4000


def _frequencies(params: SamplingParams) -> np.ndarray:
    """Empirical token frequencies over DRAWS positions of one seeded request."""
    arrays = SamplingArrays.from_params([params] * DRAWS, [params.seed or 0] * DRAWS, DRAWS)
    logits = np.tile(LOGITS, (DRAWS, 1))
    tokens = jax.jit(sample)(logits, arrays, np.arange(DRAWS, dtype=np.int32))
    return np.bincount(np.asarray(tokens), minlength=5) / DRAWS


@pytest.mark.parametrize("params, expected", [
    (SamplingParams(temperature=1.0, seed=1), [0.5, 0.25, 0.125, 0.0625, 0.0625]),
    (SamplingParams(temperature=1.0, top_k=2, seed=2), [2 / 3, 1 / 3, 0, 0, 0]),
    # top_p 0.7: 0.5 then 0.25 reaches 0.75 >= 0.7, so two tokens stay.
    (SamplingParams(temperature=1.0, top_p=0.7, seed=3), [2 / 3, 1 / 3, 0, 0, 0]),
    # min_p 0.2: keep probabilities >= 0.1, i.e. the first three.
    (SamplingParams(temperature=1.0, min_p=0.2, seed=4), [4 / 7, 2 / 7, 1 / 7, 0, 0]),
    # temperature 0.5 squares the probabilities: [16, 4, 1, 1/4, 1/4] / 21.5.
    (SamplingParams(temperature=0.5, seed=5), np.array([16, 4, 1, 0.25, 0.25]) / 21.5),
    (SamplingParams(temperature=0.0), [1, 0, 0, 0, 0]),
])
def test_distribution_matches_hand_computed(params, expected):
    freq = _frequencies(params)
    assert np.abs(freq - np.asarray(expected)).max() < 0.03, freq


def test_greedy_and_top_k_1_rows_beside_a_sampled_row():
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=7),
              SamplingParams(temperature=1.0, top_k=1, seed=8)]
    logits = np.tile(LOGITS[::-1], (4, 1))  # argmax is token 4 in every row
    arrays = SamplingArrays.from_params(params, [0, 7, 8], 4)
    tokens = np.asarray(jax.jit(sample)(logits, arrays, np.full(4, 11, np.int32)))
    assert tokens[0] == 4 and tokens[2] == 4 and tokens[3] == 4  # row 3: greedy padding


POSITIONS = 64


def _seeded_run(seed: int) -> np.ndarray:
    """Tokens of one seeded request at positions 0..POSITIONS-1, one row per position."""
    params = SamplingParams(temperature=1.0, seed=seed)
    arrays = SamplingArrays.from_params([params] * POSITIONS, [seed] * POSITIONS, POSITIONS)
    logits = np.tile(LOGITS, (POSITIONS, 1))
    return np.asarray(jax.jit(sample)(logits, arrays, np.arange(POSITIONS, dtype=np.int32)))


def test_seeded_tokens_do_not_depend_on_the_rest_of_the_batch():
    alone = _seeded_run(7)
    assert len(set(alone.tolist())) > 1  # really sampled, not greedy
    # The same request (seed 7, same positions, same logits) at other row indices of a
    # larger batch, in reverse position order, between unrelated rows: other seeds and
    # settings, other logits, other positions.
    others = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=8),
              SamplingParams(temperature=0.5, top_k=3, seed=9)]
    rows, seeds, logits, positions = [], [], [], []
    for i, pos in enumerate(range(POSITIONS - 1, -1, -1)):
        other = others[i % 3]
        rows += [other, SamplingParams(temperature=1.0, seed=7)]
        seeds += [other.seed or 0, 7]
        logits += [LOGITS[::-1], LOGITS]
        positions += [pos + 100, pos]
    arrays = SamplingArrays.from_params(rows, seeds, len(rows) + 3)  # 3 padding rows
    logits = np.concatenate([np.stack(logits), np.tile(LOGITS, (3, 1))])
    positions = np.asarray(positions + [0, 0, 0], np.int32)
    batched = np.asarray(jax.jit(sample)(logits, arrays, positions))
    np.testing.assert_array_equal(batched[1:2 * POSITIONS:2][::-1], alone)


def test_different_seeds_give_different_tokens():
    runs = [_seeded_run(seed) for seed in (7, 8, 2**31 + 7)]
    for a in range(3):
        for b in range(a + 1, 3):
            assert not np.array_equal(runs[a], runs[b]), (a, b)
    # A seed is taken mod 2**32, so 7 and 2**32 + 7 are the same seed.
    np.testing.assert_array_equal(_seeded_run(2**32 + 7), runs[0])


def _numpy_top_k_top_p(row: np.ndarray, top_k: int, top_p: float) -> set[int]:
    """The tokens top-k then top-p keep, by sorting (float64): the k most likely, then the
    fewest of those, most likely first, whose renormalized mass reaches top_p."""
    order = np.argsort(-row, kind="stable")
    if 0 < top_k < len(row):
        order = order[:top_k]
    probs = np.exp(row[order].astype(np.float64) - row[order].max())
    probs /= probs.sum()
    mass_before = np.cumsum(probs) - probs
    return set(order[(mass_before < top_p) | (np.arange(len(order)) == 0)].tolist())


def test_top_k_and_top_p_cutoffs_equal_a_sorting_reference():
    vocab = 1000
    rng = np.random.default_rng(3)
    cases = [(0, 0.9), (1, 1.0), (5, 1.0), (vocab - 1, 1.0), (0, 0.01), (50, 0.5), (3, 0.999),
             (0, 1.0), (200, 0.95), (0, 0.3)]
    logits = (rng.normal(size=(len(cases), vocab)) * rng.uniform(0.5, 4, (len(cases), 1)))
    logits = logits.astype(np.float32)
    logits[1, ::3] = -np.inf  # a grammar's forbidden tokens
    params = [SamplingParams(temperature=1.0, top_k=k, top_p=p, seed=i)
              for i, (k, p) in enumerate(cases)]
    arrays = SamplingArrays.from_params(params, list(range(len(cases))), len(cases))
    kept = np.isfinite(np.asarray(jax.jit(_rank_filtered)(logits, arrays)))
    for row, (k, p) in enumerate(cases):
        expected = _numpy_top_k_top_p(logits[row], k, p) if (0 < k < vocab or p < 1) else \
            set(np.flatnonzero(np.isfinite(logits[row])).tolist())
        assert set(np.flatnonzero(kept[row]).tolist()) == expected, (row, k, p)


@pytest.mark.parametrize("field, value", [
    ("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("top_k", 2**31),
    ("min_p", 2.0),
    ("max_tokens", 0), ("seed", 1.5), ("stop", [""]), ("stop_token_ids", ["a"]),
    ("presence_penalty", 3.0), ("frequency_penalty", -2.5), ("repetition_penalty", 0.0),
    ("logprobs", 21),
])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def _bitmask(rows_allowed: list[list[int]], words: int) -> np.ndarray:
    """`[B, words]` int32 bitmask with the listed tokens set (bit j of word i: 32 i + j)."""
    mask = np.zeros((len(rows_allowed), words), np.uint32)
    for row, tokens in enumerate(rows_allowed):
        for token in tokens:
            mask[row, token // 32] |= np.uint32(1 << (token % 32))
    return mask.view(np.int32)


def test_grammar_masks_restrict_sampling_to_allowed_tokens():
    vocab, words = 70, 3
    rng = np.random.default_rng(0)
    logits = jax.numpy.asarray(rng.normal(size=(3, vocab)).astype(np.float32))
    allowed_sets = [[5, 40, 69], [0, 1, 2, 3], list(range(vocab))]
    allowed = _bitmask(allowed_sets, words)
    allowed[2] = -1  # a free row: all bits set
    params = [SamplingParams(temperature=0.0, structured_outputs={"choice": ["a"]}),
              SamplingParams(temperature=1.0, seed=3, structured_outputs={"choice": ["a"]}),
              SamplingParams(temperature=0.0)]
    arrays = SamplingArrays.from_params(params, [0, 3, 0], 3)
    np.testing.assert_array_equal(np.asarray(allowed_tokens(jax.numpy.asarray(allowed), vocab))
                                  .nonzero()[1][:3], [5, 40, 69])
    counts = TokenCounts(jax.numpy.zeros((3, vocab), jax.numpy.int32),
                         jax.numpy.zeros((3, vocab), bool))
    sample = jax.jit(sample_with_logprobs)  # one compile, not 20 eager passes of every op
    for position in range(20):
        result = sample(logits, arrays, jax.numpy.full((3,), position), counts,
                        jax.numpy.asarray(allowed))
        tokens = np.asarray(result.tokens)
        raw = np.asarray(logits)
        assert tokens[0] == max(allowed_sets[0], key=lambda t: raw[0, t])
        assert tokens[1] in allowed_sets[1]
        assert tokens[2] == raw[2].argmax()


def test_target_logprobs_equal_numpy_log_softmax_over_tiles():
    tokens, embed, vocab = 300, 8, 50  # three tiles of TARGET_TILE, the last one partial
    rng = np.random.default_rng(1)
    hidden = rng.normal(size=(tokens, embed)).astype(np.float32)
    weights = rng.normal(size=(embed, vocab)).astype(np.float32)
    targets = rng.integers(0, vocab, size=tokens).astype(np.int32)
    targets[::7] = -1  # positions that score nothing
    out = target_logprobs(jax.numpy.asarray(hidden), jax.numpy.asarray(targets),
                          lambda h: h @ weights)
    logits = (hidden @ weights).astype(np.float64)
    reference = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    scored = targets >= 0
    np.testing.assert_allclose(np.asarray(out.logprob)[scored],
                               reference[scored, targets[scored]], atol=1e-4)
    top = np.argsort(-reference, axis=-1)[:, :MAX_LOGPROBS]
    np.testing.assert_array_equal(np.asarray(out.top_ids), top)
    np.testing.assert_allclose(np.asarray(out.top_logprobs),
                               np.take_along_axis(reference, top, -1), atol=1e-4)
    none = target_logprobs(jax.numpy.asarray(hidden), jax.numpy.full((tokens,), -1),
                           lambda h: h @ weights)
    assert not np.asarray(none.logprob).any()
