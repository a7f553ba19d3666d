"""Parametrized sweeps split between the suites: the cases a sweep keeps run in the main
suite (`python -m pytest`), the others are marked `slow` and run in CI's slow step, so the
main suite keeps a representative of every check and CI keeps all of them."""

import pytest


def sweep(cases, keep, ids=None):
    """`cases` for `pytest.mark.parametrize`, each one not in `keep` (indices) marked slow."""
    params = []
    for i, case in enumerate(cases):
        values = case if isinstance(case, tuple) else (case,)
        params.append(pytest.param(*values, id=None if ids is None else ids[i],
                                   marks=() if i in keep else pytest.mark.slow))
    return params
