"""Qwen3-Reranker as a classifier: the score of a (query, document) prompt is the
probability the model gives "yes" over "no" as its next token,
softmax([no, yes])[yes] = sigmoid(logit_yes - logit_no), read at the last position.

vLLM converts the checkpoint into a one-row classifier at load time (`--hf-overrides
'{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no",
"yes"], "is_original_qwen3_reranker": true}'`). jaxserve keeps the causal LM as it is and
takes the two logits from its head in the pooling program (`PoolingRunner`), which is the
same number without rewriting weights; a folder is a reranker when its `architectures`
name one, it sets `is_original_qwen3_reranker`, or `--convert classify` says so. As with
vLLM, the client writes the model's prompt template (instruction, query, document and the
assistant prefix) into the texts it scores.
"""

from __future__ import annotations

from jaxserve.loading.tokenizer import Tokenizer

YES_NO = ("yes", "no")


def yes_no_token_ids(tokenizer: Tokenizer | None) -> tuple[int, int]:
    """The single-token ids of "yes" and "no" in the model's vocabulary."""
    if tokenizer is None:
        raise ValueError("a reranker needs the model's tokenizer.json to find its 'yes' and "
                         "'no' tokens")
    ids = []
    for word in YES_NO:
        encoded = tokenizer.encode(word, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(f"a reranker's {word!r} must be one token; this tokenizer "
                             f"makes it {encoded}")
        ids.append(encoded[0])
    return ids[0], ids[1]
