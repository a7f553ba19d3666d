"""Pooling parity: jaxserve's embeddings against sentence-transformers' `encode` of the same
tiny random folders (float32, cosine >= 0.9999 per text), for a Qwen3-Embedding-style
decoder (last token, normalized), a gte-Qwen2-style decoder (mean), BERT (CLS) and
XLM-RoBERTa (mean); a Qwen3-Reranker-style scorer against transformers' logits by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from sentence_transformers import SentenceTransformer

from jaxserve import LLM
from jaxserve.errors import InvalidRequestError
from jaxserve.llm import resolve_settings
from jaxserve.loading.tokenizer import Tokenizer
from jaxserve.pooling.program import shared_prefix
from jaxserve import PoolingParams
from pooling_models import TEXTS, build_decoder, build_encoder
from tiny_models import SMALL_ENGINE

# sixteen inputs: more than a batch's rows (8), so they run in several batches; then a
# batch of queries behind one instruction, which a decoder's batch holds once (prefix sharing)
PREFIXED = [f"Instruct: fox\nQuery: {q}" for q in ("a fox", "the dog", "café")]
INPUTS = TEXTS * 3 + ["fox"] + PREFIXED


def cosines(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return np.sum(got * want, -1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)


@pytest.mark.parametrize("kind, architecture, pooling, normalize, options", [
    ("decoder", "qwen3", "LAST", True, {}),  # Qwen3-Embedding
    ("decoder", "qwen3", "MEAN", True, {"scan_layers": True}),  # TPU/GPU's layer layout
    ("decoder", "qwen2", "MEAN", False, {}),  # gte-Qwen2-style mean
    ("encoder", "bert", "CLS", True, {}),  # bge-style
    ("encoder", "xlm-roberta", "MEAN", True, {}),  # e5 / bge-m3-style, offset positions
])
def test_matches_sentence_transformers(tmp_path, kind, architecture, pooling, normalize,
                                       options):
    build = build_decoder if kind == "decoder" else build_encoder
    build(tmp_path, architecture, pooling, normalize)
    want = SentenceTransformer(str(tmp_path), device="cpu").encode(INPUTS, batch_size=4)
    llm = LLM(str(tmp_path), dtype="float32", runner="pooling", **SMALL_ENGINE, **options)
    got = np.array([o.outputs.embedding for o in llm.embed(INPUTS)])
    assert llm.pooler.spec.pooling_type == pooling
    if options:
        assert llm.model.scan_layers
    if kind == "decoder":  # some prefixed queries share a batch, and its prefix
        ids = [llm.tokenizer.encode(text) for text in INPUTS]
        assert any(shared_prefix([ids[i] for i in group]) >= 8
                   for group in llm.pooler.engine.runner.batches(ids))
    print(f"{architecture} {pooling}: min cosine {cosines(got, want).min():.8f}")
    assert cosines(got, want).min() >= 0.9999, cosines(got, want)
    if normalize:
        np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, atol=1e-5)
    else:  # unnormalized vectors keep their length
        np.testing.assert_allclose(np.linalg.norm(got, axis=-1), np.linalg.norm(want, axis=-1),
                                   rtol=1e-3)
    with pytest.raises(ValueError, match="runner='pooling'"):
        llm.generate("a")
    with pytest.raises(InvalidRequestError, match="matryoshka") as refused:
        llm.embed("a", PoolingParams(dimensions=8))
    assert refused.value.field == "dimensions"
    if kind == "encoder":  # no generation engine: LLM only, the server refuses it
        with pytest.raises(ValueError, match="encoder"):
            resolve_settings(str(tmp_path), "float32", None, {"runner": "pooling"})


def test_qwen3_reranker_scores_yes_over_no(tmp_path):
    build_decoder(tmp_path, "qwen3", "LAST", normalize=False)
    query, documents = "Query: the fox?", ["Document: a quick brown fox", "Document: café",
                                           "Document: emoji 🦊"]
    llm = LLM(str(tmp_path), dtype="float32", runner="pooling", convert="classify",
              **SMALL_ENGINE)
    got = [o.outputs.score for o in llm.score(query, documents)]
    tokenizer = Tokenizer(tmp_path)
    yes, no = (tokenizer.encode(w, add_special_tokens=False)[0] for w in ("yes", "no"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    want = []
    for document in documents:
        ids = tokenizer.encode(query) + tokenizer.encode(document, add_special_tokens=False)
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1]
        pair = torch.stack([logits[no], logits[yes]]).log_softmax(-1)
        want.append(pair[1].exp().item())
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    assert max(want) - min(want) > 1e-3  # the documents' scores differ
    with pytest.raises(ValueError, match="reranker"):
        llm.embed("a")
