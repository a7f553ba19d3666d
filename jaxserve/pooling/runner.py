"""`PoolingRunner`: whole sequences packed into the engine's token buckets, one compiled
pooling program per (tokens, rows) bucket, and what each row returns: its pooled vector
(embed) or its score (classify).

The program is `forward` (the model's hidden states `[T, E]` of a `PackedSequences`) then
`jaxserve.pooling.program.pool` on device; a classifier then takes the last token's
yes-minus-no logit through a sigmoid (`jaxserve.pooling.reranker`). Prefill only: a
sequence is never split across batches (nothing is kept between them), so the token ladder
reaches `max_model_len`. Every batch has `max_num_seqs` rows (a row costs one gathered
vector), so there is one program per token bucket, all compiled at warm-up: after it
nothing compiles, as in the generation engine.
"""

from __future__ import annotations

import bisect
import threading
import time
from typing import Callable

import jax
import numpy as np
from flax import nnx

from jaxserve.errors import InvalidRequestError
from jaxserve.pooling.program import PackedSequences, pool, shared_prefix
from jaxserve.pooling.spec import PoolerSpec

# forward(model, batch) -> hidden states [T, E] of every packed token
Forward = Callable[[nnx.Module, PackedSequences], jax.Array]


class PoolingRunner:
    """Runs lists of token sequences through the compiled pooling programs."""

    def __init__(self, model: nnx.Module, forward: Forward, spec: PoolerSpec,
                 token_buckets: tuple[int, ...], seq_buckets: tuple[int, ...],
                 max_model_len: int, yes_no_ids: tuple[int, int] | None = None,
                 position_offset: int = 0, share_prefixes: bool = False):
        """`yes_no_ids` (classify): the tokens whose logits' difference is the score.
        `share_prefixes` (causal models only): a batch whose sequences all start alike
        runs that prefix once (`jaxserve.pooling.program`)."""
        if spec.task == "classify" and yes_no_ids is None:
            raise ValueError("a classify pooler needs the yes/no token ids")
        self.spec, self.max_model_len = spec, max_model_len
        self.position_offset = position_offset
        self.budget = max(token_buckets)  # tokens a batch of several sequences may hold
        self.token_buckets = tuple(token_buckets) + ((max_model_len,)
                                                     if max_model_len > self.budget else ())
        self.rows = max(seq_buckets)
        self.share_prefixes = share_prefixes
        graphdef, state = nnx.split(model)
        self._state = state
        self._lock = threading.Lock()

        def program(state, batch: PackedSequences) -> jax.Array:
            model = nnx.merge(graphdef, state)
            hidden = forward(model, batch)  # [T, E]
            if spec.task == "classify":  # the last token's yes/no logits
                logits = model.logits(hidden[batch.last_index])  # [S, V]
                return jax.nn.sigmoid(logits[:, yes_no_ids[0]] - logits[:, yes_no_ids[1]])
            return pool(hidden, batch, spec.pooling_type)  # [S, E]

        self._program = jax.jit(program)

    # ---- batching -------------------------------------------------------------------------
    def check(self, ids: list[int], field: str = "input") -> None:
        """`InvalidRequestError` naming `field` for a sequence the runner cannot take."""
        if not ids:
            raise InvalidRequestError(field, "an input has no tokens")
        if len(ids) > self.max_model_len:
            raise InvalidRequestError(field, f"an input has {len(ids)} tokens, more than "
                                      f"max_model_len ({self.max_model_len})")

    def batches(self, sequences: list[list[int]]) -> list[list[int]]:
        """Indices of `sequences` grouped into batches, in order: at most `rows` sequences
        and `budget` tokens, a prefix all of a batch's sequences share counted once (with
        `share_prefixes`), or one sequence longer than that alone (its batch's attention
        then covers only its own tokens)."""
        groups: list[list[int]] = []
        group: list[int] = []
        common = shortest = total = 0  # the group's shared prefix, least length, tokens
        for index, ids in enumerate(sequences):
            if group and len(group) < self.rows:
                joined = 0
                if self.share_prefixes:
                    joined = min(common if len(group) > 1 else len(ids),
                                 _common_length(sequences[group[0]], ids),
                                 min(shortest, len(ids)) - 1)
                cost = joined + total + len(ids) - joined * (len(group) + 1)
                if cost <= self.budget:
                    group.append(index)
                    common, shortest, total = joined, min(shortest, len(ids)), total + len(ids)
                    continue
            if group:
                groups.append(group)
            group, shortest, total = [index], len(ids), len(ids)
        return groups + ([group] if group else [])

    def run(self, sequences: list[list[int]]) -> np.ndarray:
        """Each sequence's pooled vector `[N, E]` (float32, not normalized) or score `[N]`."""
        for ids in sequences:
            self.check(ids)
        outputs = []
        for group in self.batches(sequences):
            members = [sequences[i] for i in group]
            shared = shared_prefix(members) if self.share_prefixes else 0
            total = shared + sum(len(ids) - shared for ids in members)
            tokens = self.token_buckets[bisect.bisect_left(self.token_buckets, total)]
            outputs.append(self._run_batch(members, tokens, shared)[:len(members)])
        return np.concatenate(outputs, axis=0)

    def _run_batch(self, sequences: list[list[int]], tokens: int, shared: int = 0
                   ) -> np.ndarray:
        batch = PackedSequences.pack(sequences, tokens, self.rows, self.position_offset,
                                     shared)
        with self._lock:
            return np.asarray(self._program(self._state, batch))

    def release(self) -> None:
        """Drop the runner's reference to the weights (it runs nothing after)."""
        with self._lock:
            self._state = None

    def warm_up(self) -> float:
        """Compile every token bucket's program; seconds taken."""
        started = time.perf_counter()
        for tokens in self.token_buckets:
            self._run_batch([[0]], tokens)
        return time.perf_counter() - started


def finish(vectors: np.ndarray, normalize: bool, dimensions: int | None = None
           ) -> np.ndarray:
    """Pooled vectors `[N, E]` cut to their first `dimensions` (Matryoshka) and then
    L2-normalized if `normalize`, as vLLM orders it."""
    if dimensions is not None:
        vectors = vectors[:, :dimensions]
    if normalize:
        norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
        vectors = vectors / np.maximum(norms, 1e-12)
    return vectors


def _common_length(first: list[int], second: list[int]) -> int:
    """How many leading tokens two sequences share."""
    count = 0
    for a, b in zip(first, second):
        if a != b:
            break
        count += 1
    return count
