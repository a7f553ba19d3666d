"""Reading a step's results back and booking them: sampled tokens into the scheduler,
log-probabilities and prompt log-probabilities into each request's output processor, text
deltas out, and the step's figures into the metrics; or, for a step that raised, failing its
requests and rebuilding what it broke (`_recover`). A mixin of `Engine`, which owns
`_processors`, `_owners`, `metrics`, `failure` and the replicas."""

from __future__ import annotations

import dataclasses
import logging
import time

import jax

from jaxserve.engine import multihost
from jaxserve.engine.batcher import StepInput
from jaxserve.engine.metrics import StepRecord
from jaxserve.engine.output_processor import StreamDelta, logprob_entries
from jaxserve.engine.replica import InFlight, Replica
from jaxserve.engine.scheduler import SchedulerOutput, SequenceUpdate
from jaxserve.engine.sequence import Status
from jaxserve.sampling.sampler import SampleResult, TargetLogprobs

log = logging.getLogger("jaxserve.engine")

MAX_CONSECUTIVE_FAILURES = 3  # failed steps in a row after which the engine gives up


class EngineFailedError(RuntimeError):
    """The engine cannot serve any more (`Engine.failure` says why); restart the process."""


def _without_logprobs(pending):
    """A step's device results without the log-probability fields, which are not copied to
    the host when no request asked for them."""
    def drop(node):
        if isinstance(node, SampleResult):
            return dataclasses.replace(node, logprob=None, top_ids=None, top_logprobs=None)
        return node
    return jax.tree.map(drop, pending, is_leaf=lambda node: isinstance(node, SampleResult))


class StepResults:
    """`Engine`'s methods that turn a dispatched step's device results into deltas."""

    def _recover(self, replica: Replica, err: Exception, deltas: list[StreamDelta],
                 *flights: InFlight | None) -> None:
        """A step of `replica` raised: the requests of the steps it had under way (and the one
        it was scheduling) that have not had their final delta finish with reason "error"
        (appended to `deltas`) and free their pages; if the KV cache did not survive, it is
        rebuilt and the replica's other requests recompute. The engine gives up for good
        (`failure`, then `EngineFailedError` from every `step()`) after
        `MAX_CONSECUTIVE_FAILURES` failed steps in a row on one replica, when recovering
        fails, or at once on several processes (the followers cannot be brought back in
        step)."""
        log.error("engine step failed; failing its requests", exc_info=err)
        replica.consecutive_failures += 1
        replica.in_flight = None
        plans = [f.plan for f in flights if f is not None] + [replica.scheduling]
        replica.scheduling = None
        reason = None
        try:
            failed = {id(c.seq): c.seq for plan in plans if plan is not None
                      for c in plan.chunks if c.seq.request_id in self._owners}
            for seq in failed.values():
                if seq.status is not Status.FINISHED:
                    replica.scheduler.fail(seq)
                seq.finish_reason = "error"  # also one the step finished before it raised
                deltas.append(self._finish_as(seq, "error"))
            if not replica.runner.caches_usable():
                log.error("the KV cache was lost with the failed step; rebuilding it")
                replica.runner.reset_caches()
                replica.allocator.forget_all()
                if replica.scheduler.windows is not None:
                    replica.scheduler.windows.allocator.forget_all()
                replica.scheduler.restart_running()
        except Exception as during:  # noqa: BLE001 - recovery itself failed
            reason = f"could not recover from a failed step ({err!r}): {during!r}"
        if reason is None and multihost.is_multiprocess():
            reason = f"a step failed in a multi-host run: {err!r}"
        if reason is None and replica.consecutive_failures >= MAX_CONSECUTIVE_FAILURES:
            reason = f"{replica.consecutive_failures} steps failed in a row; last: {err!r}"
        if reason is not None:
            self.failure = reason
            raise EngineFailedError(reason) from err

    def _complete(self, replica: Replica, flight: InFlight, deltas: list[StreamDelta]) -> None:
        """Read a dispatched step's results and book them; the requests' deltas go on
        `deltas` as they are made (a failure part-way keeps those already made)."""
        plan, rows = flight.plan, len(flight.plan.chunks)
        pending, prompt = flight.pending, None
        if not plan.decode_only:
            pending, prompt = pending  # SampleResult [S, ...], TargetLogprobs [T, ...]
            if all(c.seq.params.prompt_logprobs is None for c in plan.chunks):
                prompt = None  # not copied to the host
        if all(c.seq.params.logprobs is None for c in plan.chunks):
            pending = _without_logprobs(pending)
        result, prompt = jax.device_get((pending, prompt))
        if plan.decode_only:
            result, produced, *drafts = result  # [S, K, ...], [S] (, DraftCounts)
            if drafts:
                self._record_drafts(drafts[0], rows)
        else:
            result = jax.tree.map(lambda a: a[:, None], result)  # [S, 1, ...]
        if prompt is not None:
            self._book_prompt_logprobs(plan, flight.inp, prompt)
        if flight.placeholders is None:  # a decode loop
            produced = [int(n) for n in produced[:rows]]
            sampled = [result.tokens[i, :n].tolist() for i, n in enumerate(produced)]
            updates = replica.scheduler.postprocess(plan, sampled, produced)
        else:
            updates = replica.scheduler.complete(plan, result.tokens[:rows, 0].tolist(),
                                                 flight.placeholders)
        for update in updates:
            deltas.append(self._output(replica, update, result))
        replica.consecutive_failures = 0
        self.metrics.record_step(StepRecord(
            num_seqs=rows, num_tokens=plan.num_tokens,
            padded_tokens=int(flight.inp.token_ids.shape[0]),
            num_decode_steps=plan.num_decode_steps, kv_cache_usage=replica.allocator.usage,
            duration=time.monotonic() - flight.started))

    def _record_drafts(self, drafts, rows: int) -> None:
        """A speculative step's `DraftCounts` (numpy, per row) into the metrics."""
        self.metrics.record_drafts(int(drafts.num_drafts[:rows].sum()),
                                   int(drafts.num_draft_tokens[:rows].sum()),
                                   drafts.accepted_per_pos[:rows].sum(axis=0).tolist())

    def _book_prompt_logprobs(self, plan: SchedulerOutput, inp: StepInput,
                              prompt: TargetLogprobs) -> None:
        """Give each request that asked for prompt log-probabilities the entries its chunk
        computed: the token at flat index j (position p) scored prompt token p + 1."""
        for i, chunk in enumerate(plan.chunks):
            seq = chunk.seq
            top = seq.params.prompt_logprobs
            processor = self._processors.get(seq.request_id)
            if top is None or processor is None:
                continue
            start = int(inp.cu_q_lens[i])
            first = int(inp.positions[start])
            count = min(chunk.num_tokens, len(seq.prompt_token_ids) - 1 - first)
            if count <= 0:
                continue
            span = slice(start, start + count)
            entries = logprob_entries(inp.prompt_targets[span], prompt.logprob[span],
                                      prompt.top_ids[span], prompt.top_logprobs[span], top)
            processor.prompt_logprobs[first + 1:first + 1 + count] = entries

    def _output(self, replica: Replica, update: SequenceUpdate,
                result: SampleResult) -> StreamDelta:
        """Text and stream delta of one sequence's new tokens (fields of `result` `[S, K,
        ...]`); a stop string found in the text stops the sequence there."""
        seq = update.seq
        entries = None
        if seq.params.logprobs is not None:
            count, row = len(update.new_token_ids), update.row
            entries = logprob_entries(result.tokens[row, :count], result.logprob[row, :count],
                                      result.top_ids[row, :count],
                                      result.top_logprobs[row, :count], seq.params.logprobs)
        new_tokens = update.new_token_ids
        if seq.params.max_tokens == 0:  # prompt log-probabilities only: the token is unseen
            new_tokens, entries = [], None if entries is None else []
        delta, keep = self._processors[seq.request_id].process(
            new_tokens, update.finish_reason, entries)
        if keep is not None:
            replica.scheduler.stop_early(update, keep)
        if delta.finished:
            self._owners.pop(seq.request_id, None)
            self.metrics.record_finished(seq)
        return delta
