"""On-device sampling against hand-computed distributions."""

import jax
import numpy as np
import pytest

from jaxserve.sampler import SamplingArrays, sample
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


def test_mixed_rows_in_one_batch_and_seed_reproducibility():
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=7),
              SamplingParams(temperature=1.0, top_k=1, seed=8)]
    logits = np.tile(LOGITS[::-1], (3, 1))  # argmax is token 4 in every row
    arrays = SamplingArrays.from_params(params, [0, 7, 8], 4)
    padded = np.concatenate([logits, logits[:1]])
    positions = np.full(4, 11, np.int32)
    first = np.asarray(sample(padded, arrays, positions))
    again = np.asarray(sample(padded, arrays, positions))
    assert first[0] == 4 and first[2] == 4
    assert np.array_equal(first, again)


@pytest.mark.parametrize("field, value", [
    ("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 2.0),
    ("max_tokens", 0), ("seed", 1.5), ("stop", [""]), ("stop_token_ids", ["a"]),
    ("presence_penalty", 3.0), ("frequency_penalty", -2.5), ("repetition_penalty", 0.0),
    ("logprobs", 21),
])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
