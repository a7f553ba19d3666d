"""The n-gram proposer and the acceptance arithmetic, against hand-built cases and a plain
Python statement of vLLM's prompt-lookup rule (`jaxserve.speculative.ngram`,
`jaxserve.engine.speculative_rounds.acceptance`)."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.speculative.ngram import NO_DRAFT, propose
from jaxserve.engine.speculative_rounds import acceptance

pytestmark = pytest.mark.quick  # seconds, no engine: `pytest -m quick`


def lookup(tokens: list[int], k: int, min_n: int, max_n: int, max_model_len: int) -> list[int]:
    """vLLM's rule, by brute force: the longest n in [min_n, max_n] whose last-n tokens occur
    earlier (ending before the last token), its earliest occurrence, then up to k tokens
    after it (no more than the context holds, nor past max_model_len)."""
    total = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n > total:
            continue
        suffix = tokens[total - n:]
        for start in range(0, total - n):  # the occurrence ends at start + n - 1 <= total - 2
            if tokens[start:start + n] == suffix:
                follow = start + n
                count = min(k, total - follow, max_model_len - total)
                return tokens[follow:follow + max(count, 0)]
    return []


def run(rows: list[list[int]], k: int, min_n: int, max_n: int, length: int = 48,
        max_model_len: int = 1000) -> list[list[int]]:
    history = np.full((len(rows), length), -1, np.int32)
    for i, tokens in enumerate(rows):
        history[i, :len(tokens)] = tokens
    lengths = np.asarray([len(t) for t in rows], np.int32)
    drafts = np.asarray(propose(jnp.asarray(history), jnp.asarray(lengths), k, min_n, max_n,
                                max_model_len))
    return [[int(t) for t in row if t != NO_DRAFT] for row in drafts]


def test_vllm_documented_example():
    # vLLM's docstring: [1,2,3,4,2,3], min 2, max 3, k 4: [4,2,3] cannot match, [2,3] does,
    # and only three tokens follow it
    assert run([[1, 2, 3, 4, 2, 3]], k=4, min_n=2, max_n=3) == [[4, 2, 3]]


def test_longest_match_wins_then_the_earliest_occurrence():
    rows = [[7, 1, 2, 9, 1, 2, 8, 5, 1, 2],  # [1,2] occurs at 1 and 4: the earliest, 1
            [1, 2, 3, 6, 2, 3, 7, 1, 2, 3],  # [1,2,3] beats the more recent [2,3]
            [4, 4, 4, 4],  # overlapping occurrence of [4,4,4]
            [5, 6, 7],  # nothing repeats
            [3]]  # too short for min_n
    assert run(rows, k=3, min_n=2, max_n=3) == [[9, 1, 2], [6, 2, 3], [4], [], []]


def test_drafts_stop_at_max_model_len():
    assert run([[1, 2, 1, 2, 1, 2]], k=4, min_n=1, max_n=2, max_model_len=8) == [[1, 2]]


def test_random_histories_follow_the_rule():
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, vocab, size=rng.integers(1, 48)).tolist()
            for vocab in (2, 3, 5, 50) for _ in range(12)]
    for k, min_n, max_n in ((1, 1, 1), (4, 1, 3), (5, 2, 5), (3, 3, 4)):
        want = [lookup(r, k, min_n, max_n, 1000) for r in rows]
        assert run(rows, k, min_n, max_n) == want, (k, min_n, max_n)


def test_acceptance_keeps_the_accepted_drafts_and_the_next_token():
    sampled = jnp.asarray([[5, 6, 7, 8],    # drafts 5 6 9: two accepted, then 7
                           [1, 2, 3, 4],    # all three accepted: four kept
                           [9, 2, 3, 4],    # first draft rejected: one kept (9)
                           [5, 6, 7, 8],    # stop token 6 after one accepted draft
                           [5, 6, 7, 8],    # only two tokens remain
                           [5, 6, 7, 8],    # no drafts at all
                           [5, 6, 7, 8]],   # already done
                          jnp.int32)
    drafts = jnp.asarray([[5, 6, 9], [1, 2, 3], [1, 2, 3], [5, 6, 7], [5, 6, 7],
                          [NO_DRAFT] * 3, [5, 6, 7]], jnp.int32)
    stop_ids = jnp.asarray([[-1, -1]] * 3 + [[6, -1]] + [[-1, -1]] * 3, jnp.int32)
    remaining = jnp.asarray([10, 10, 10, 10, 2, 10, 10], jnp.int32)
    done = jnp.asarray([False] * 6 + [True])
    accepted, kept, stopped = acceptance(sampled, drafts, stop_ids, remaining, done)
    assert accepted.tolist() == [2, 3, 0, 3, 3, 0, 3]
    assert kept.tolist() == [3, 4, 1, 2, 2, 1, 0]
    assert stopped.tolist() == [False, False, False, True, True, False, False]
