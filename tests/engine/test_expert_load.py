"""`jaxserve.engine.expert_load`: the host total of many programs' `[L, X]` counts equals
their sum, across the folds that keep the waiting list short; the imbalance is max / mean
per layer, 0 for a layer that ran nothing (hand-computed)."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.engine.expert_load import ExpertLoad, imbalance

pytestmark = pytest.mark.quick


def test_total_sums_every_program_across_folds():
    load = ExpertLoad()
    assert load.total() is None
    arrays = [np.arange(6).reshape(2, 3) * (i % 5) for i in range(ExpertLoad.FOLD * 2 + 3)]
    for array in arrays:
        load.add(jnp.asarray(array, jnp.int32))
    assert len(load._pending) < ExpertLoad.FOLD
    np.testing.assert_array_equal(load.total(), np.sum(arrays, axis=0))
    assert load.total().dtype == np.int64


def test_imbalance_is_the_busiest_over_the_mean():
    np.testing.assert_allclose(imbalance(np.array([[4, 4, 4, 4], [8, 0, 0, 0], [0, 0, 0, 0]])),
                               [1.0, 4.0, 0.0])
