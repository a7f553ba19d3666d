"""First-come-first-served scheduler with chunked prefill and preemption (plain Python).

The scheduler owns the books: every sequence's status, pages and token counts change here
only — in `schedule()` before a step; in `advance()` as a single step is dispatched (its
tokens count as computed, each token it samples a `PENDING` placeholder), so the next step can
be scheduled while this one runs; in `complete()` when its tokens arrive (placeholders
filled, stop tokens and length checked, full pages keyed for the prefix cache, finished
sequences' pages freed), or `postprocess()` for a decode loop, whose token count is known
only when it ends; plus `abort()` and `stop_early()` (a stop string, found in the text).

Each step fills a token budget (`max_num_batched_tokens`): first one decode token for every
running sequence (or the next chunk of one still prefilling), then prefill chunks of waiting
sequences in arrival order, so a long prompt never stalls running streams. When pages run
out it preempts the newest running sequence (frees its pages; it recomputes later) instead of
failing. When a step holds only decode tokens and nobody streams them (every request's
`output_kind` is "final_only"), it asks for several decode steps at once
(`num_decode_steps`), with pages reserved for all of them; a streamed request gets each
token from its own step, which the engine overlaps with the next.

With `speculative_config`, a decode-only step of few enough rows is `speculative`: each of its
steps is a round that may keep up to k + 1 tokens, so pages are reserved for that many per
round (all rows or none; without them the program drafts only as far as each row's pages
reach), and after the step the pages only rejected drafts used are freed.

With LoRA (`lora_slots`), a sequence with an adapter also needs a device slot for it to be
admitted (`jaxserve.lora.slots`), which it holds until it finishes or is preempted; one
whose adapter finds no slot waits, and the requests behind it are admitted meanwhile.

With hybrid KV memory (`windows`, `jaxserve.engine.window_pages`), every reservation also
extends the sequence's window-layer page table, after freeing what slid out of its window;
a prefix is reused only as far as its window pages are cached too.
"""

from __future__ import annotations

import collections
import dataclasses
import time

from jaxserve.config.engine import EngineConfig
from jaxserve.engine.page_allocator import PageAllocator
from jaxserve.engine.sequence import (GRAMMAR_DEAD_END, PENDING, Sequence, Status,
                                      refresh_masks)
from jaxserve.engine.window_pages import WindowPages
from jaxserve.lora.slots import SlotTable


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
    decode_only: bool = False  # every chunk is one decode token: run the decode program
    num_decode_steps: int = 1  # decode steps that program runs (pages reserved for them)
    speculative: bool = False  # a decode-only step run as speculative rounds
    preempted: list[Sequence] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclasses.dataclass
class SequenceUpdate:
    """What one step did to one sequence: the tokens it gained (row `row` of the step's
    results) and, if the step finished it, why."""

    seq: Sequence
    row: int
    new_token_ids: list[int]
    finish_reason: str | None = None


def _stop_reason(seq: Sequence, token: int, num_outputs: int) -> str | None:
    """Why `token`, the sequence's `num_outputs`-th output, ends it: a stop token (eos
    included), its grammar (complete, or at a dead end), or its length limit; None if it
    does not. The grammar, if any, books the token here."""
    if token in seq.stop_token_ids:
        return "stop"
    reason = seq.grammar.advance(token) if seq.grammar is not None else None
    if reason is not None:
        return reason
    if num_outputs >= seq.max_new_tokens:
        return "length"
    return None


class Scheduler:
    """Owns the waiting and running queues and every sequence's pages."""

    def __init__(self, config: EngineConfig, allocator: PageAllocator,
                 lora_slots: SlotTable | None = None, windows: WindowPages | None = None):
        self.config = config
        self.allocator = allocator
        self.windows = windows
        self.lora_slots = lora_slots
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # a step's caps: the config's, lower while the larger buckets' programs still compile
        # (`jaxserve.engine.background_compile`; they only grow)
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs

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
                    self._finish(seq, "abort")
                    return seq
        return None

    def fail(self, seq: Sequence) -> None:
        """A step serving `seq` failed: it finishes with reason "error". Its pages leave the
        prefix cache: a single step is booked (and its filled pages keyed) when it is
        dispatched, so a key may name a page the failed step never wrote."""
        self.allocator.forget(seq.pages)
        if self.windows is not None:
            self.windows.forget(seq)
        self._finish(seq, "error")

    def restart_running(self) -> None:
        """The KV cache was lost: every running sequence returns to the front of the queue
        and recomputes its tokens, as if preempted."""
        for seq in reversed(list(self.running)):
            self.running.remove(seq)
            while seq.output_token_ids and seq.output_token_ids[-1] == PENDING:
                seq.output_token_ids.pop()  # sampled by the lost step
            self._release(seq)
            seq.status = Status.WAITING
            self.waiting.appendleft(seq)

    def _finish(self, seq: Sequence, reason: str) -> None:
        """Mark `seq` finished and release its pages (cached pages stay in the LRU)."""
        for queue in (self.running, self.waiting):
            if seq in queue:
                queue.remove(seq)
        while seq.output_token_ids and seq.output_token_ids[-1] == PENDING:
            seq.output_token_ids.pop()  # sampled by a step still on device: dropped
        self.allocator.free(seq.pages)
        seq.pages = []
        if self.windows is not None:
            self.windows.release(seq)
        self._release_adapter(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason
        seq.times.finished = time.monotonic()

    # ---- after a step -------------------------------------------------------------------
    def advance(self, plan: SchedulerOutput) -> list[int | None]:
        """A single step was dispatched: its tokens count as computed and each token it will
        sample is a `PENDING` output. Returns, per chunk, that output's index (None for a
        chunk that samples nothing), for `complete()`."""
        indices = []
        for row, chunk in enumerate(plan.chunks):
            seq, samples = chunk.seq, chunk.samples
            seq.num_computed_tokens += chunk.num_tokens
            indices.append(None)
            if samples:
                seq.output_token_ids.append(PENDING)
                seq.pending_row = row
                indices[-1] = len(seq.output_token_ids) - 1
        return indices

    def complete(self, plan: SchedulerOutput, sampled: list[int],
                 indices: list[int | None]) -> list[SequenceUpdate]:
        """The tokens of a step `advance()` booked arrived (`sampled[i]`: chunk i's): fill
        the placeholders, finish sequences on a stop token or their length, key full pages.
        A sequence finished meanwhile (aborted, or stopped by the step before) is skipped;
        a later step's placeholder after a stop is dropped."""
        now = time.monotonic()
        updates = []
        for row, (seq, token, index) in enumerate(zip(self._live(plan), sampled, indices)):
            if seq is None:
                continue
            reason = None
            if index is not None:
                seq.output_token_ids[index] = token
                seq.times.tokens_arrived(1, now)
                reason = _stop_reason(seq, token, index + 1)
            self._register_pages(seq)
            if reason is not None:
                del seq.output_token_ids[index + 1:]
                self._finish(seq, reason)
            if index is not None:
                updates.append(SequenceUpdate(seq, row, [token], reason))
        self._refresh_grammars(updates)
        return updates

    def _refresh_grammars(self, updates: list[SequenceUpdate]) -> None:
        """The next bitmasks of the constrained sequences that go on, computed together; a
        grammar that allows no further token finishes its sequence (`GRAMMAR_DEAD_END`)."""
        going_on = [u for u in updates if u.finish_reason is None and u.seq.grammar is not None]
        if not going_on:
            return
        for update, allowed in zip(going_on, refresh_masks([u.seq.grammar for u in going_on])):
            if not allowed:
                update.finish_reason = GRAMMAR_DEAD_END
                self._finish(update.seq, GRAMMAR_DEAD_END)

    @staticmethod
    def _live(plan: SchedulerOutput) -> list[Sequence | None]:
        """The plan's sequences in row order, None for one finished since it was scheduled."""
        return [None if c.seq.status is Status.FINISHED else c.seq for c in plan.chunks]

    def _register_pages(self, seq: Sequence) -> None:
        """Key the full pages whose tokens are all known and computed (a decode loop
        computes tokens it also returns; placeholders are not known yet)."""
        outputs = seq.output_token_ids
        pending = 0
        while pending < len(outputs) and outputs[-1 - pending] == PENDING:
            pending += 1
        known = min(seq.num_computed_tokens, seq.num_tokens - pending)
        filled = known // self.config.page_size > len(seq.page_hashes)
        if filled and self.allocator.enable_prefix_caching:
            first = len(seq.page_hashes)
            self.allocator.register_full_pages(seq.token_ids, seq.pages, seq.page_hashes, known,
                                               seq.prefix_root)
            if self.windows is not None:
                self.windows.register(seq, first)

    def postprocess(self, plan: SchedulerOutput, sampled: list[list[int]],
                    fed: list[int]) -> list[SequenceUpdate]:
        """Book-keep a step that ran: chunk i computed `fed[i]` tokens and sampled
        `sampled[i]` (in order). Tokens are appended up to the first stop token or the length
        limit, which finish the sequence; full pages are keyed for the prefix cache. Returns
        an update for every sequence that gained tokens (none finished meanwhile)."""
        now = time.monotonic()
        updates = []
        for row, (seq, tokens, count) in enumerate(zip(self._live(plan), sampled, fed)):
            if seq is None:
                continue
            seq.num_computed_tokens += count
            kept, reason = [], None
            for token in tokens:
                kept.append(token)
                reason = _stop_reason(seq, token, len(seq.output_token_ids) + len(kept))
                if reason is not None:
                    break
            seq.output_token_ids.extend(kept)
            seq.times.tokens_arrived(len(kept), now)
            self._register_pages(seq)
            self._trim(seq)
            if reason is not None:
                self._finish(seq, reason)
            if kept:
                updates.append(SequenceUpdate(seq, row, kept, reason))
        self._refresh_grammars(updates)
        return updates

    def _trim(self, seq: Sequence) -> None:
        """Free the pages past the sequence's tokens (reserved for a loop's steps or rounds
        that did not happen, or written only by rejected drafts)."""
        keep = -(-seq.num_tokens // self.config.page_size)
        if len(seq.pages) > keep:
            self.allocator.free(seq.pages[keep:])
            del seq.pages[keep:]
        if self.windows is not None:
            self.windows.trim(seq, keep)

    def stop_early(self, update: SequenceUpdate, keep: int) -> None:
        """A stop string ended `update`'s sequence at its `keep`-th new token: drop the tokens
        after it and finish the sequence (reason "stop")."""
        seq = update.seq
        del seq.output_token_ids[len(seq.output_token_ids) - len(update.new_token_ids) + keep:]
        update.new_token_ids = update.new_token_ids[:keep]
        update.finish_reason = "stop"
        if seq.status is Status.FINISHED:
            seq.finish_reason = "stop"
        else:
            self._finish(seq, "stop")

    def stats(self) -> dict[str, int]:
        """Queue lengths and preemptions, for the engine's `stats()`."""
        return {"num_running": len(self.running), "num_waiting": len(self.waiting),
                "num_preemptions": self.num_preemptions}

    # ---- scheduling ---------------------------------------------------------------------
    def schedule(self, max_decode_steps: int | None = None) -> SchedulerOutput:
        """This step's work. `max_decode_steps` caps a decode loop below `num_decode_steps`
        (an engine sharing its devices runs one step per turn)."""
        budget = self.max_num_batched_tokens
        out = SchedulerOutput(chunks=[])
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            if len(seq.output_token_ids) >= seq.max_new_tokens:
                continue  # its last token is on device; it finishes when that arrives
            count = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._reserve_or_preempt(seq, seq.num_computed_tokens + count, out):
                continue
            out.chunks.append(ScheduledChunk(seq, count))
            budget -= count
        if not out.preempted:
            budget = self._admit_waiting(budget, out)
        if out.chunks and all(c.seq.is_decoding for c in out.chunks):
            out.decode_only = True
            out.speculative = self.config.speculates(len(out.chunks))
            out.num_decode_steps = self._decode_steps(out, max_decode_steps)
        now = time.monotonic()
        for chunk in out.chunks:
            if chunk.seq.times.first_scheduled is None:
                chunk.seq.times.first_scheduled = now
        return out

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> int:
        no_slot = []  # sequences whose adapter found no slot, in arrival order
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self._hold_adapter(seq):
                no_slot.append(self.waiting.popleft())
                continue
            # A request that wants its prompt's log-probabilities computes every prompt token
            # (a cached page has K/V, not the logits); it still keys its pages for others.
            if seq.num_computed_tokens == 0 and seq.params.prompt_logprobs is None:
                seq.pages, seq.page_hashes = self.allocator.match_prefix(seq.token_ids,
                                                                        seq.prefix_root)
                if self.windows is not None:  # only as far as its window pages are cached
                    usable = self.windows.match(seq)
                    self.allocator.unmatch(seq.pages[usable:])
                    del seq.pages[usable:], seq.page_hashes[usable:]
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
        self.waiting.extendleft(reversed(no_slot))
        return budget

    def _hold_adapter(self, seq: Sequence) -> bool:
        """Whether `seq` holds a slot for its adapter (taking one if it can), or needs none."""
        if seq.lora is None or seq.lora_slot >= 0:
            return True
        slot = self.lora_slots.acquire(seq.lora)
        if slot is None:
            return False
        seq.lora_slot = slot
        return True

    def _release_adapter(self, seq: Sequence) -> None:
        if seq.lora_slot >= 0:
            self.lora_slots.release(seq.lora_slot)
            seq.lora_slot = -1

    def _decode_steps(self, out: SchedulerOutput, limit: int | None) -> int:
        """As many decode steps as configured (at most `limit`) if pages for all of them,
        for every sequence, can be reserved (all or none, so a fallback to one step holds no
        extra pages); one if a request streams (its tokens would otherwise arrive in bursts)
        or samples under a grammar (its next bitmask needs the token just sampled)."""
        steps = min(self.config.num_decode_steps, limit or self.config.num_decode_steps)
        if any(c.seq.params.output_kind == "delta" or c.seq.grammar is not None
               for c in out.chunks):
            steps = 1
        if steps == 1 and not out.speculative:
            return 1
        per_step = self.config.speculative_config.num_speculative_tokens + 1 \
            if out.speculative else 1
        wanted = [min(c.seq.num_computed_tokens + steps * per_step, self.config.max_model_len)
                  for c in out.chunks]
        if out.speculative:  # no slot past the last token a row may keep
            wanted = [min(n, c.seq.num_computed_tokens + c.seq.remaining_new_tokens)
                      for c, n in zip(out.chunks, wanted)]
        needed = sum(max(0, -(-n // self.config.page_size) - len(c.seq.pages))
                     for c, n in zip(out.chunks, wanted))
        if needed > self.allocator.num_free_pages:
            return 1
        if self.windows is not None and needed > self.windows.allocator.num_free_pages:
            return 1  # (a bound: pages that slide out as they reserve are not counted)
        for chunk, num_tokens in zip(out.chunks, wanted):
            self._reserve(chunk.seq, num_tokens)
        return steps

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Make `seq`'s pages cover `num_tokens` tokens; False (nothing taken) if they can't."""
        wanted = -(-num_tokens // self.config.page_size)
        needed = wanted - len(seq.pages)
        pages = self.allocator.allocate(needed) if needed > 0 else []
        if pages is None:
            return False
        if self.windows is not None and not self.windows.reserve(seq, wanted):
            self.allocator.free(pages)
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
        if self.windows is not None:
            self.windows.release(seq)
        self._release_adapter(seq)
