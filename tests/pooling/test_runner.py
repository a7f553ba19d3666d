"""The pooling runner's pieces against independent references: packing, the segment
attention (blocked and not) against per-sequence dense attention in numpy, pooling by
segment, and the batching (no batch over the buckets, every input answered in order)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.pooling import program
from jaxserve.pooling.program import PackedSequences, pool, segment_attention
from jaxserve.pooling.runner import PoolingRunner, finish
from jaxserve.pooling.spec import PoolerSpec, pooler_spec


def numpy_attention(q, k, v, causal):
    """softmax(q k^T / sqrt(D)) v of one sequence, kv heads repeated: [L, H, D]."""
    k = np.repeat(k, q.shape[1] // k.shape[1], axis=1)
    v = np.repeat(v, q.shape[1] // v.shape[1], axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1])
    if causal:
        scores = np.where(np.tril(np.ones(scores.shape[1:], bool))[None], scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", weights, v)


@pytest.mark.parametrize("causal, shared", [(True, 0), (False, 0), (True, 3)])
@pytest.mark.parametrize("block", [4, 512])
def test_segment_attention_is_each_sequences_own(monkeypatch, causal, shared, block):
    """Each row's tokens attend as its whole sequence alone would (with `shared`, the
    prefix every row starts with is packed once and each row sees it)."""
    monkeypatch.setattr(program, "QUERY_BLOCK", block)
    lengths, tokens = [5, 4, 7], 16
    rng = np.random.default_rng(0)
    sequences = [[9, 8, 7] + list(range(n - 3)) for n in lengths]
    batch = PackedSequences.pack(sequences, tokens, rows=4, shared=shared)
    q_whole = [rng.normal(size=(n, 4, 8)).astype(np.float32) for n in lengths]
    kv_whole = [rng.normal(size=(2, n, 2, 8)).astype(np.float32) for n in lengths]
    if shared:  # the prefix's projections are one set, as a causal model's would be
        for i in range(1, len(lengths)):
            q_whole[i][:shared], kv_whole[i][:, :shared] = q_whole[0][:shared], \
                kv_whole[0][:, :shared]
    q = np.zeros((tokens, 4, 8), np.float32)
    k, v = (np.zeros((tokens, 2, 8), np.float32) for _ in range(2))
    q[:shared], k[:shared], v[:shared] = q_whole[0][:shared], *kv_whole[0][:, :shared]
    start = shared
    for qs, kvs in zip(q_whole, kv_whole):
        n = len(qs) - shared
        q[start:start + n], k[start:start + n], v[start:start + n] = (
            qs[shared:], kvs[0, shared:], kvs[1, shared:])
        start += n
    out = np.asarray(segment_attention(batch, causal)(0, q, k, v, None)[0])
    start = shared
    for qs, kvs in zip(q_whole, kv_whole):
        want = numpy_attention(qs, kvs[0], kvs[1], causal)
        n = len(qs) - shared
        np.testing.assert_allclose(out[start:start + n], want[shared:], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out[:shared], want[:shared], rtol=1e-5, atol=1e-5)
        start += n


def test_shared_prefix_mean_and_positions():
    sequences = [[5, 6, 7, 1], [5, 6, 7, 2, 3]]
    assert program.shared_prefix(sequences) == 3
    assert program.shared_prefix([[5, 6], [5, 6]]) == 1  # each keeps a token of its own
    batch = PackedSequences.pack(sequences, tokens=8, rows=2, shared=3)
    assert batch.token_ids[:6].tolist() == [5, 6, 7, 1, 2, 3]
    assert batch.positions[:6].tolist() == [0, 1, 2, 3, 3, 4]
    hidden = np.arange(8 * 2, dtype=np.float32).reshape(8, 2) ** 1.5  # [T, E]
    np.testing.assert_allclose(pool(hidden, batch, "MEAN"), np.stack([
        hidden[[0, 1, 2, 3]].mean(0), hidden[[0, 1, 2, 4, 5]].mean(0)]), rtol=1e-6)
    np.testing.assert_allclose(pool(hidden, batch, "LAST"), hidden[[3, 5]])
    np.testing.assert_allclose(pool(hidden, batch, "CLS"), hidden[[0, 0]])


def test_pool_last_cls_mean():
    batch = PackedSequences.pack([[1, 2, 3], [4], [5, 6]], tokens=8, rows=4)
    hidden = np.arange(8 * 2, dtype=np.float32).reshape(8, 2) ** 1.5  # [T, E]
    np.testing.assert_allclose(pool(hidden, batch, "LAST")[:3], hidden[[2, 3, 5]])
    np.testing.assert_allclose(pool(hidden, batch, "CLS")[:3], hidden[[0, 3, 4]])
    np.testing.assert_allclose(pool(hidden, batch, "MEAN")[:3], np.stack([
        hidden[0:3].mean(0), hidden[3], hidden[4:6].mean(0)]), rtol=1e-6)
    assert batch.positions[:6].tolist() == [0, 1, 2, 0, 0, 1]


def test_finish_cuts_then_normalizes():
    vectors = np.array([[3.0, 4.0, 12.0]])
    np.testing.assert_allclose(finish(vectors, True, 2), [[0.6, 0.8]])
    np.testing.assert_allclose(finish(vectors, False), vectors)


def test_spec_from_sentence_transformers_files(tmp_path):
    import json
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert pooler_spec(tmp_path) == PoolerSpec("CLS", True)
    (tmp_path / "modules.json").write_text(json.dumps([
        {"path": "", "type": "sentence_transformers.models.Transformer"},
        {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_mean_tokens": True}))
    assert pooler_spec(tmp_path) == PoolerSpec("MEAN", False)
    assert pooler_spec(tmp_path, pooler_config={"normalize": True}).normalize
    with pytest.raises(ValueError, match="pooler_config"):
        pooler_spec(tmp_path, pooler_config={"pooling": "MEAN"})
    with pytest.raises(ValueError, match="classify"):
        pooler_spec(tmp_path, convert="classify")


def test_batches_hold_the_budget_and_long_inputs_alone():
    runner = PoolingRunner.__new__(PoolingRunner)  # the batching needs no model
    runner.budget, runner.rows, runner.share_prefixes = 64, 3, False
    lengths = [10, 20, 30, 100, 5, 5, 5, 5, 60]
    groups = runner.batches([[0] * n for n in lengths])
    assert groups == [[0, 1, 2], [3], [4, 5, 6], [7], [8]]
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))


def test_batches_count_a_shared_prefix_once():
    runner = PoolingRunner.__new__(PoolingRunner)
    runner.budget, runner.rows, runner.share_prefixes = 64, 8, True
    prefix = list(range(100, 140))  # 40 tokens
    sequences = [prefix + [i, i] for i in range(5)] + [[1] * 30, [1] * 30, [2] * 10]
    groups = runner.batches(sequences)
    # 40 + 5 x 2 = 50 tokens: the five share one batch; [1] * 30 twice share 29 tokens
    # (each keeps one): 31; the last shares nothing with them, so 30 + 30 + 10 > 64
    assert groups == [[0, 1, 2, 3, 4], [5, 6], [7]]
    for group in groups:
        members = [sequences[i] for i in group]
        shared = program.shared_prefix(members)
        assert shared + sum(len(m) - shared for m in members) <= runner.budget
    runner.share_prefixes = False
    assert runner.batches(sequences)[0] == [0]  # 42 + 42 > 64
