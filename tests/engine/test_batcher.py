"""`build_step_input`: every StepInput field of hand-built steps against hand-computed values,
plus the bucket ladders and `SamplingArrays.from_params`."""

import numpy as np
import pytest

from jaxserve.sampling.arrays import SamplingArrays
from jaxserve.engine.batcher import (MAX_DEVICE_STOP_IDS, bucket_for,
                                     build_step_input)
from jaxserve.config.engine import EngineConfig
from jaxserve.engine.scheduler import ScheduledChunk, SchedulerOutput
from jaxserve.engine.sequence import Sequence
from jaxserve.sampling_params import SamplingParams

pytestmark = pytest.mark.quick  # seconds, no engine: `pytest -m quick`

CONFIG = EngineConfig(max_model_len=64, page_size=16, num_pages=40, max_num_seqs=4,
                      max_num_batched_tokens=32, token_buckets=(16, 32), seq_buckets=(2, 4))
WORDS = 2  # int32 words of a token bitmask (a vocabulary of up to 64)


def make_seq(name, prompt, output=(), computed=0, pages=(), max_new=8, stops=(), seed=0,
             **params):
    seq = Sequence(name, list(prompt), SamplingParams(**params), seed=seed,
                   max_new_tokens=max_new, stop_token_ids=frozenset(stops))
    seq.output_token_ids = list(output)
    seq.num_computed_tokens = computed
    seq.pages = list(pages)
    return seq


def mixed_step():
    """A decode row, a second prefill chunk and a first prefill chunk: 14 tokens, 3 rows."""
    # a: 20 prompt tokens + 1 output cached up to 20; decodes token 7 at position 20.
    a = make_seq("a", range(100, 120), output=[7], computed=20, pages=[3, 5], max_new=10,
                 stops=[50, 3, 9, 1, 20, 11, 7, 2, 40, 5], seed=123, temperature=0.7,
                 top_k=5, presence_penalty=0.5)
    # b: 24 prompt tokens, 16 cached; this chunk is positions 16..23.
    b = make_seq("b", range(200, 224), computed=16, pages=[8, 2], max_new=6, stops=[1],
                 temperature=0.0, repetition_penalty=1.2)
    # c: 5 prompt tokens, none cached.
    c = make_seq("c", range(300, 305), pages=[9], max_new=3, seed=2**32 + 5, temperature=1.0,
                 top_p=0.9, min_p=0.1, frequency_penalty=0.0, logprobs=3)
    return SchedulerOutput([ScheduledChunk(a, 1), ScheduledChunk(b, 8), ScheduledChunk(c, 5)])


def test_mixed_step_every_field():
    step = build_step_input(mixed_step(), CONFIG, WORDS)
    # 14 tokens -> token bucket 16; 3 rows -> sequence bucket 4.
    expected_tokens = [7] + list(range(216, 224)) + list(range(300, 305)) + [0, 0]
    np.testing.assert_array_equal(step.token_ids, expected_tokens)
    np.testing.assert_array_equal(step.positions,
                                  [20] + list(range(16, 24)) + list(range(5)) + [0, 0])
    # a: position 20 is offset 4 of its 2nd page (5) -> 84; b: positions 16..23 are offsets
    # 0..7 of page 2 -> 32..39; c: positions 0..4 of page 9 -> 144..148; padding -1.
    np.testing.assert_array_equal(step.slot_mapping,
                                  [84] + list(range(32, 40)) + list(range(144, 149)) + [-1, -1])
    np.testing.assert_array_equal(step.kv_lens, [21, 24, 5, 0])
    np.testing.assert_array_equal(step.page_indices,
                                  [[3, 5, 0, 0], [8, 2, 0, 0], [9, 0, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(step.cu_q_lens, [0, 1, 9, 14, 14])
    np.testing.assert_array_equal(step.num_seqs, [3])
    np.testing.assert_array_equal(step.logits_indices, [0, 8, 13, 13])
    np.testing.assert_array_equal(step.max_new, [9, 6, 3, 0])
    # a has 10 stop ids: the 8 smallest, sorted, reach the device.
    assert MAX_DEVICE_STOP_IDS == 8
    np.testing.assert_array_equal(step.stop_ids, [[1, 2, 3, 5, 7, 9, 11, 20],
                                                  [1] + [-1] * 7, [-1] * 8, [-1] * 8])
    # Penalty rows (a, b) carry their whole history; c and the padding row none.
    history = np.full((4, 64), -1)
    history[0, :21] = list(range(100, 120)) + [7]
    history[1, :24] = range(200, 224)
    np.testing.assert_array_equal(step.history, history)
    np.testing.assert_array_equal(step.prompt_lens, [20, 24, 0, 0])
    s = step.sampling
    np.testing.assert_allclose(s.temperature, [0.7, 0.0, 1.0, 0.0])
    np.testing.assert_array_equal(s.top_k, [5, 0, 0, 0])
    np.testing.assert_allclose(s.top_p, [1.0, 1.0, 0.9, 1.0])
    np.testing.assert_allclose(s.min_p, [0.0, 0.0, 0.1, 0.0])
    np.testing.assert_array_equal(s.seed, [123, 0, 5, 0])
    np.testing.assert_allclose(s.presence, [0.5, 0.0, 0.0, 0.0])
    np.testing.assert_allclose(s.frequency, [0.0, 0.0, 0.0, 0.0])
    np.testing.assert_allclose(s.repetition, [1.0, 1.2, 1.0, 1.0])
    np.testing.assert_array_equal(s.wants_logprobs, [False, False, True, False])
    for name, dtype in [("token_ids", np.int32), ("positions", np.int32),
                        ("slot_mapping", np.int32), ("kv_lens", np.int32),
                        ("page_indices", np.int32), ("cu_q_lens", np.int32),
                        ("num_seqs", np.int32), ("logits_indices", np.int32),
                        ("max_new", np.int32), ("stop_ids", np.int32),
                        ("history", np.int32), ("prompt_lens", np.int32)]:
        assert getattr(step, name).dtype == dtype, name
    assert s.seed.dtype == np.uint32 and s.temperature.dtype == np.float32


def test_decode_loop_step_has_one_token_per_row():
    # Three decoding sequences, positions 5, 17 and 32 (a page boundary: offset 0 of page 3).
    a = make_seq("a", [11] * 5, output=[21], computed=5, pages=[4], max_new=4)
    b = make_seq("b", [12] * 17, output=[22], computed=17, pages=[6, 7], max_new=5)
    c = make_seq("c", [13] * 30, output=[23, 24, 25], computed=32, pages=[1, 2, 3], max_new=9)
    out = SchedulerOutput([ScheduledChunk(s, 1) for s in (a, b, c)], decode_only=True,
                          num_decode_steps=4)
    step = build_step_input(out, CONFIG, WORDS)
    # tokens == rows == 4 (sequence bucket), not the token bucket 16.
    np.testing.assert_array_equal(step.token_ids, [21, 22, 25, 0])
    np.testing.assert_array_equal(step.positions, [5, 17, 32, 0])
    np.testing.assert_array_equal(step.slot_mapping, [4 * 16 + 5, 7 * 16 + 1, 3 * 16, -1])
    np.testing.assert_array_equal(step.kv_lens, [6, 18, 33, 0])
    np.testing.assert_array_equal(step.cu_q_lens, [0, 1, 2, 3, 3])
    np.testing.assert_array_equal(step.logits_indices, [0, 1, 2, 2])
    np.testing.assert_array_equal(step.max_new, [3, 4, 6, 0])
    np.testing.assert_array_equal(step.page_indices,
                                  [[4, 0, 0, 0], [6, 7, 0, 0], [1, 2, 3, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(step.num_seqs, [3])
    assert step.history.shape == (4, 64) and (step.history == -1).all()


def test_step_exactly_filling_the_buckets_is_not_padded():
    # 2 rows, 16 tokens: bucket (16, 2) exactly; no padding token, no padding row.
    a = make_seq("a", range(1, 11), pages=[1])
    b = make_seq("b", range(20, 26), pages=[2])
    step = build_step_input(SchedulerOutput([ScheduledChunk(a, 10), ScheduledChunk(b, 6)]),
                            CONFIG, WORDS)
    assert step.token_ids.shape == (16,) and step.kv_lens.shape == (2,)
    assert (step.slot_mapping >= 0).all()
    np.testing.assert_array_equal(step.slot_mapping, list(range(16, 26)) + list(range(32, 38)))
    np.testing.assert_array_equal(step.cu_q_lens, [0, 10, 16])
    np.testing.assert_array_equal(step.logits_indices, [9, 15])


def test_one_token_more_moves_to_the_next_bucket():
    a = make_seq("a", range(1, 18), pages=[1, 2])
    step = build_step_input(SchedulerOutput([ScheduledChunk(a, 17)]), CONFIG, WORDS)
    assert step.token_ids.shape == (32,) and step.kv_lens.shape == (2,)
    np.testing.assert_array_equal(step.slot_mapping[:17], list(range(16, 33)))
    assert (step.slot_mapping[17:] == -1).all() and (step.token_ids[17:] == 0).all()
    np.testing.assert_array_equal(step.cu_q_lens, [0, 17, 17])
    np.testing.assert_array_equal(step.page_indices[1], [0, 0, 0, 0])


def test_token_bucket_never_smaller_than_the_rows():
    config = EngineConfig(max_model_len=64, page_size=16, num_pages=40, max_num_seqs=4,
                          max_num_batched_tokens=32, token_buckets=(2, 32), seq_buckets=(4,))
    seqs = [make_seq(n, [1, 2], output=[3], computed=2, pages=[i + 1])
            for i, n in enumerate("ab")]
    step = build_step_input(SchedulerOutput([ScheduledChunk(s, 1) for s in seqs]), config,
                            WORDS)
    # 2 tokens would fit the rung 2, but 4 rows need at least 4 tokens: the rung 32.
    assert step.token_ids.shape == (32,) and step.kv_lens.shape == (4,)


def test_prompt_targets_are_the_next_prompt_tokens_of_rows_that_ask():
    # a: prompt 100..109 wants prompt log-probabilities; this chunk is positions 4..9, so
    # positions 4..8 score tokens 105..109 and position 9 (the last) scores nothing.
    a = make_seq("a", range(100, 110), computed=4, pages=[1], prompt_logprobs=2)
    b = make_seq("b", range(200, 205), pages=[2])  # does not ask
    # c: a second chunk ending inside the prompt: positions 0..3 of 8 score 301..304.
    c = make_seq("c", range(300, 308), pages=[3], prompt_logprobs=0)
    step = build_step_input(SchedulerOutput([ScheduledChunk(a, 6), ScheduledChunk(b, 5),
                                             ScheduledChunk(c, 4)]), CONFIG, WORDS)
    expected = [105, 106, 107, 108, 109, -1] + [-1] * 5 + [301, 302, 303, 304] + [-1]
    np.testing.assert_array_equal(step.prompt_targets, expected)


class FixedGrammar:
    """A grammar state that allows a fixed set of tokens (what the batcher copies)."""

    def __init__(self, tokens):
        self.mask = np.zeros(WORDS, np.int32)
        for token in tokens:
            self.mask.view(np.uint32)[token // 32] |= np.uint32(1 << (token % 32))


def test_grammar_rows_carry_their_bitmask_and_free_rows_allow_everything():
    a = make_seq("a", [1, 2], pages=[1], structured_outputs={"choice": ["x"]})
    a.grammar = FixedGrammar([3, 33, 63])
    b = make_seq("b", [1, 2], pages=[2])
    step = build_step_input(SchedulerOutput([ScheduledChunk(a, 2), ScheduledChunk(b, 2)]),
                            CONFIG, WORDS)
    bits = np.unpackbits(step.allowed.view(np.uint8), bitorder="little").reshape(2, 64)
    np.testing.assert_array_equal(np.flatnonzero(bits[0]), [3, 33, 63])
    assert bits[1].all() and step.is_constrained
    np.testing.assert_array_equal(step.sampling.constrained, [True, False])
    free = build_step_input(SchedulerOutput([ScheduledChunk(b, 2)]), CONFIG, WORDS)
    assert not free.is_constrained and (free.allowed == -1).all()
    assert free.allowed.shape == (2, WORDS)


def test_step_too_large_for_the_ladders_raises():
    five = [make_seq(str(i), [1], pages=[i + 1]) for i in range(5)]
    with pytest.raises(ValueError):
        build_step_input(SchedulerOutput([ScheduledChunk(s, 1) for s in five]), CONFIG, WORDS)
    big = make_seq("big", range(1, 34), pages=[1, 2, 3])
    with pytest.raises(ValueError):
        build_step_input(SchedulerOutput([ScheduledChunk(big, 33)]), CONFIG, WORDS)


@pytest.mark.parametrize("size, rung", [(0, 16), (1, 16), (16, 16), (17, 32), (32, 32)])
def test_bucket_for(size, rung):
    assert bucket_for((16, 32), size) == rung


def test_bucket_for_past_the_top_raises():
    with pytest.raises(ValueError, match="33"):
        bucket_for((16, 32), 33)


def test_sampling_arrays_padding_rows_are_greedy():
    params = [SamplingParams(temperature=0.8, top_k=-1, top_p=0.5, min_p=0.2, seed=3,
                             presence_penalty=1.0, frequency_penalty=-1.0,
                             repetition_penalty=0.5, logprobs=0)]
    arrays = SamplingArrays.from_params(params, [2**32 + 9], 3)
    np.testing.assert_allclose(arrays.temperature, [0.8, 0, 0])
    np.testing.assert_array_equal(arrays.top_k, [0, 0, 0])  # -1 (whole vocabulary) -> 0
    np.testing.assert_allclose(arrays.top_p, [0.5, 1, 1])
    np.testing.assert_allclose(arrays.min_p, [0.2, 0, 0])
    np.testing.assert_array_equal(arrays.seed, [9, 0, 0])  # seeds are taken mod 2**32
    np.testing.assert_allclose(arrays.presence, [1.0, 0, 0])
    np.testing.assert_allclose(arrays.frequency, [-1.0, 0, 0])
    np.testing.assert_allclose(arrays.repetition, [0.5, 1, 1])
    np.testing.assert_array_equal(arrays.wants_logprobs, [True, False, False])  # 0 asks too


def test_sampling_arrays_too_many_requests_raise():
    with pytest.raises(ValueError):
        SamplingArrays.from_params([SamplingParams()] * 3, [0, 0, 0], 2)
