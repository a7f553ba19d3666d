"""Pads a scheduled step to a bucket and packs it into one small pytree of arrays (numpy).

Every compiled program has one (tokens, sequences) shape from the two bucket ladders, so the
step's real sizes are rounded up to the next rung; padding tokens write nowhere (slot -1) and
padding sequences have no tokens and page tables of the padding page 0.

Two per-step extras ride along only when a request asks for them: `prompt_targets` (the
prompt token that follows each position, for prompt log-probabilities) and `allowed` (the
next-token bitmask of each row under structured output, computed by the row's grammar when
its last token was booked; free rows allow everything).
"""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

from jaxserve.config.engine import EngineConfig
from jaxserve.sampling.arrays import SamplingArrays
from jaxserve.engine.scheduler import SchedulerOutput
from jaxserve.engine.sequence import PENDING

MAX_DEVICE_STOP_IDS = 8  # stop ids checked on device per row; the host checks them all


@dataclasses.dataclass
class StepInput:
    """One step's inputs: a flat ragged batch of T tokens from S sequences."""

    token_ids: np.ndarray  # [T] int32
    # [T] int32: -1, or the row of the previous step whose sampled token (still on device) this
    # token is (a `PENDING` output; the program reads it from there)
    token_source: np.ndarray
    positions: np.ndarray  # [T] int32
    slot_mapping: np.ndarray  # [T] int32, page * page_size + offset; -1 for padding
    kv_lens: np.ndarray  # [S] int32, cached tokens after this step
    page_indices: np.ndarray  # [S, P] int32
    cu_q_lens: np.ndarray  # [S + 1] int32
    num_seqs: np.ndarray  # [1] int32
    logits_indices: np.ndarray  # [S] int32, the flat index of each sequence's last token
    sampling: SamplingArrays  # [S] rows
    # [S] int32, tokens each row may still generate in a decode loop: its limit, or fewer
    # where its reserved pages end (a speculative step may have found pages for one round)
    max_new: np.ndarray
    stop_ids: np.ndarray  # [S, MAX_DEVICE_STOP_IDS] int32, -1 padded (decode loop)
    # [S, max_model_len] int32 tokens so far, -1 padded; penalty rows only, or every row of a
    # speculative step (otherwise a read-only all -1 view, which the runner does not copy)
    history: np.ndarray
    prompt_lens: np.ndarray  # [S] int32, how many of `history` are prompt tokens
    # [T] int32: for a token of a request that wants prompt log-probabilities, the prompt
    # token at the next position (-1 elsewhere, and past the prompt's last token)
    prompt_targets: np.ndarray
    # [T] int32: the LoRA adapter slot of each token's sequence (`jaxserve.lora`), -1: none
    lora_slots: np.ndarray
    # [S, ceil(V / 32)] int32 bitmask of the tokens each row may sample (bit j of word i:
    # token 32 i + j); all ones (-1) for a free row; without constrained rows, a read-only
    # all -1 view that the runner does not copy to the device
    allowed: np.ndarray
    # hybrid KV memory (`jaxserve.engine.window_pages`): the window layers' slots [T] and
    # page tables [S, P] (0 where a page slid out); None without it
    window_slot_mapping: np.ndarray | None = None
    window_page_indices: np.ndarray | None = None

    @property
    def has_penalties(self) -> bool:
        """Whether some row has a presence, frequency or repetition penalty (and so needs
        its token history)."""
        s = self.sampling
        return bool(s.presence.any() or s.frequency.any() or (s.repetition != 1).any())

    @property
    def is_constrained(self) -> bool:
        """Whether some row samples under a grammar (and so needs its bitmask copied)."""
        return bool(self.sampling.constrained.any())


def bucket_for(ladder: tuple[int, ...], size: int) -> int:
    """The smallest rung of `ladder` that holds `size`."""
    index = bisect.bisect_left(ladder, size)
    if index == len(ladder):
        raise ValueError(f"size {size} exceeds the largest bucket {ladder[-1]}")
    return ladder[index]


def build_step_input(out: SchedulerOutput, config: EngineConfig, mask_words: int,
                     window_tables: bool = False) -> StepInput:
    """Pack the scheduled chunks, padded to (token bucket, sequence bucket); `mask_words`:
    int32 words of a row's token bitmask, ceil(vocabulary / 32); `window_tables`: the
    sequences' window-layer page tables too (hybrid KV memory)."""
    num_seqs = len(out.chunks)
    rows = bucket_for(config.seq_buckets, num_seqs)
    if out.decode_only:
        tokens = rows  # the decode loop feeds exactly one token per row
    else:
        tokens = bucket_for(config.token_buckets, max(out.num_tokens, rows))
    page_size = config.page_size
    token_ids = np.zeros(tokens, np.int32)
    token_source = np.full(tokens, -1, np.int32)
    positions = np.zeros(tokens, np.int32)
    slots = np.full(tokens, -1, np.int32)
    kv_lens = np.zeros(rows, np.int32)
    page_indices = np.zeros((rows, config.pages_per_seq), np.int32)
    window_slots = np.full(tokens, -1, np.int32) if window_tables else None
    window_indices = np.zeros_like(page_indices) if window_tables else None
    cu_q_lens = np.zeros(rows + 1, np.int32)
    max_new = np.zeros(rows, np.int32)
    stop_ids = np.full((rows, MAX_DEVICE_STOP_IDS), -1, np.int32)
    every_history = out.speculative
    if every_history or any(c.seq.params.has_penalties for c in out.chunks):
        history = np.full((rows, config.max_model_len), -1, np.int32)
    else:
        history = np.broadcast_to(np.int32(-1), (rows, config.max_model_len))
    prompt_lens = np.zeros(rows, np.int32)
    prompt_targets = np.full(tokens, -1, np.int32)
    lora_slots = np.full(tokens, -1, np.int32)
    if any(c.seq.params.structured_outputs is not None for c in out.chunks):
        allowed = np.full((rows, mask_words), -1, np.int32)
    else:
        allowed = np.broadcast_to(np.int32(-1), (rows, mask_words))
    start = 0
    for i, chunk in enumerate(out.chunks):
        seq, count = chunk.seq, chunk.num_tokens
        first = seq.num_computed_tokens
        pos = np.arange(first, first + count, dtype=np.int32)
        chunk_ids = seq.tokens_between(first, first + count)
        token_ids[start:start + count] = chunk_ids
        if chunk_ids[-1] == PENDING:  # only the newest token can be on device
            token_ids[start + count - 1] = 0
            token_source[start + count - 1] = seq.pending_row
        positions[start:start + count] = pos
        lora_slots[start:start + count] = seq.lora_slot
        pages = np.asarray(seq.pages, np.int32)
        slots[start:start + count] = pages[pos // page_size] * page_size + pos % page_size
        kv_lens[i] = first + count
        page_indices[i, :len(pages)] = pages
        if window_tables:
            window = np.asarray(seq.window_pages, np.int32)
            window_slots[start:start + count] = (window[pos // page_size] * page_size
                                                 + pos % page_size)
            window_indices[i, :len(window)] = window
        if seq.params.prompt_logprobs is not None:
            prompt = seq.prompt_token_ids
            scored = pos[pos + 1 < len(prompt)]  # positions whose next token is the prompt's
            prompt_targets[start:start + len(scored)] = np.asarray(prompt)[scored + 1]
        if seq.grammar is not None:
            allowed[i] = seq.grammar.mask
        start += count
        cu_q_lens[i + 1] = start
        max_new[i] = min(seq.remaining_new_tokens, len(pages) * page_size - first)
        ids = sorted(seq.stop_token_ids)[:MAX_DEVICE_STOP_IDS]
        stop_ids[i, :len(ids)] = ids
        if every_history or seq.params.has_penalties:
            history[i, :seq.num_tokens] = seq.token_ids
            prompt_lens[i] = len(seq.prompt_token_ids)
    cu_q_lens[num_seqs + 1:] = start
    logits_indices = np.maximum(cu_q_lens[1:] - 1, 0).astype(np.int32)
    params = [c.seq.params for c in out.chunks]
    seeds = [c.seq.seed for c in out.chunks]
    return StepInput(
        token_ids=token_ids, token_source=token_source, positions=positions,
        slot_mapping=slots, kv_lens=kv_lens,
        page_indices=page_indices, cu_q_lens=cu_q_lens,
        num_seqs=np.asarray([num_seqs], np.int32), logits_indices=logits_indices,
        sampling=SamplingArrays.from_params(params, seeds, rows), max_new=max_new,
        stop_ids=stop_ids, history=history, prompt_lens=prompt_lens,
        prompt_targets=prompt_targets, lora_slots=lora_slots, allowed=allowed,
        window_slot_mapping=window_slots, window_page_indices=window_indices)
