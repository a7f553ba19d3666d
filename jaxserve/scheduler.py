"""First-come-first-served scheduler with chunked prefill and preemption (plain Python).

Each step fills a token budget (`max_num_batched_tokens`): first one decode token for every
running sequence (or the next chunk of one still prefilling), then prefill chunks of waiting
sequences in arrival order, so a long prompt never stalls running streams. When pages run
out it preempts the newest running sequence (frees its pages; it recomputes later) instead of
failing. When a step holds only decode tokens, it asks for several decode steps at once
(`num_decode_steps`), with pages reserved for all of them.
"""

from __future__ import annotations

import collections
import dataclasses

from jaxserve.engine_config import EngineConfig
from jaxserve.page_allocator import PageAllocator
from jaxserve.sequence import Sequence, Status


@dataclasses.dataclass
class ScheduledChunk:
    """`num_tokens` tokens of `seq`, starting at `seq.num_computed_tokens`, run this step."""

    seq: Sequence
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the sequence's newest token, so a token is sampled."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclasses.dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    num_decode_steps: int = 1  # > 1: every chunk is one decode token; run the decode loop
    preempted: list[Sequence] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    """Owns the waiting and running queues and every sequence's pages."""

    def __init__(self, config: EngineConfig, allocator: PageAllocator):
        self.config = config
        self.allocator = allocator
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Sequence | None:
        """Remove a request wherever it is and free its pages; returns it if found."""
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self.finish(seq, "abort")
                    return seq
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark `seq` finished and release its pages (cached pages stay in the LRU)."""
        if seq in self.running:
            self.running.remove(seq)
        self.allocator.free(seq.pages)
        seq.pages = []
        seq.status, seq.finish_reason = Status.FINISHED, reason

    # ---- scheduling ---------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        out = SchedulerOutput(chunks=[])
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            count = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._reserve_or_preempt(seq, seq.num_computed_tokens + count, out):
                continue
            out.chunks.append(ScheduledChunk(seq, count))
            budget -= count
        if not out.preempted:
            budget = self._admit_waiting(budget, out)
        if out.chunks and all(c.seq.is_decoding for c in out.chunks):
            out.num_decode_steps = self._decode_steps(out)
        # Decode rows in order of cached length (prompt chunks after them, in arrival order):
        # the CPU attention gathers decode rows' pages a block of rows at a time, as far as
        # the block's longest row, so alike rows should go together.
        out.chunks.sort(key=lambda c: (not c.seq.is_decoding,
                                       c.seq.num_computed_tokens if c.seq.is_decoding else 0))
        return out

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_computed_tokens == 0:
                seq.pages, seq.page_hashes = self.allocator.match_prefix(seq.token_ids)
                seq.num_computed_tokens = len(seq.pages) * self.config.page_size
                if not seq.output_token_ids:
                    seq.num_cached_tokens = seq.num_computed_tokens
            count = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._reserve(seq, seq.num_computed_tokens + count):
                self._release(seq)  # give back the prefix pages; try again next step
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.chunks.append(ScheduledChunk(seq, count))
            budget -= count
        return budget

    def _decode_steps(self, out: SchedulerOutput) -> int:
        """As many decode steps as configured if pages for all of them, for every sequence,
        can be reserved (all or none, so a fallback to one step holds no extra pages)."""
        steps = self.config.num_decode_steps
        wanted = [min(c.seq.num_computed_tokens + steps, self.config.max_model_len)
                  for c in out.chunks]
        needed = sum(max(0, -(-n // self.config.page_size) - len(c.seq.pages))
                     for c, n in zip(out.chunks, wanted))
        if needed > self.allocator.num_free_pages:
            return 1
        for chunk, num_tokens in zip(out.chunks, wanted):
            self._reserve(chunk.seq, num_tokens)
        return steps

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Make `seq`'s pages cover `num_tokens` tokens; False (nothing taken) if they can't."""
        needed = -(-num_tokens // self.config.page_size) - len(seq.pages)
        if needed <= 0:
            return True
        pages = self.allocator.allocate(needed)
        if pages is None:
            return False
        seq.pages.extend(pages)
        return True

    def _reserve_or_preempt(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Reserve pages for a running sequence, preempting the newest ones until it fits."""
        while not self._reserve(seq, num_tokens):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        out.chunks = [c for c in out.chunks if c.seq is not seq]
        self._release(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.num_preemptions += 1

    def _release(self, seq: Sequence) -> None:
        self.allocator.free(seq.pages)
        seq.pages, seq.page_hashes, seq.num_computed_tokens = [], [], 0
