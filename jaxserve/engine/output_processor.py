"""Turns a sequence's new tokens into text: detokenization, stop strings, streaming deltas.

The scheduler appends tokens and checks stop tokens and length (`Scheduler.postprocess`);
this module only reads the sequence. Per token it extends the text and looks for the stop
strings: the text ends before a stop string, and `process` reports how many of the new
tokens to keep (through the one that completed it) so the engine can stop the sequence
there. A stop token's text is not shown. While stop strings are set, the last
`len(longest stop) - 1` characters are held back from the stream, since they may turn out to
start a stop string.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.engine.sequence import Sequence
from jaxserve.engine.stop_strings import find_stop
from jaxserve.loading.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclasses.dataclass
class StreamDelta:
    """What one engine step added to one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    new_logprobs: list[dict[int, float]] | None = None  # per new token, when requested
    # The prompt's log-probabilities (`RequestOutput.prompt_logprobs`), on the first delta
    prompt_logprobs: list[dict[int, float] | None] | None = None


def merge_deltas(deltas: list[StreamDelta]) -> StreamDelta:
    """One delta for consecutive deltas of one request (a reader that fell behind sends
    them as one event)."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    logprobs = None
    if any(d.new_logprobs is not None for d in deltas):
        logprobs = [entry for d in deltas for entry in d.new_logprobs or ()]
    return StreamDelta(last.request_id, [t for d in deltas for t in d.new_token_ids],
                       "".join(d.new_text for d in deltas), last.finished, last.finish_reason,
                       logprobs, next((d.prompt_logprobs for d in deltas
                                       if d.prompt_logprobs is not None), None))


def logprob_entries(tokens: np.ndarray, logprob: np.ndarray, top_ids: np.ndarray,
                    top_logprobs: np.ndarray, top: int) -> list[dict[int, float]]:
    """Per sampled token `{token id: log-probability}` of it and the `top` most likely.
    tokens, logprob `[K]`; top_ids, top_logprobs `[K, MAX_LOGPROBS]`."""
    entries = []
    for k, token in enumerate(tokens.tolist()):
        entry = {int(t): float(v) for t, v in zip(top_ids[k, :top], top_logprobs[k, :top])}
        entry[token] = float(logprob[k])
        entries.append(entry)
    return entries


class OutputProcessor:
    """Per-request text state; one per sequence, created at admission."""

    def __init__(self, seq: Sequence, tokenizer: Tokenizer | None):
        self.request_id = seq.request_id
        self.stop = seq.params.stop
        self.stop_token_ids = seq.stop_token_ids
        self.detok = (IncrementalDetokenizer(tokenizer, seq.params.skip_special_tokens)
                      if tokenizer is not None else None)
        self.text = ""  # final text so far (stop strings and stop tokens removed)
        self.emitted = 0  # characters of `text` already streamed
        # Per generated token: {token id: log-probability} of it and the top `logprobs`.
        self.logprobs: list[dict[int, float]] | None = (
            [] if seq.params.logprobs is not None else None)
        self._logprobs_emitted = 0
        # Per prompt token: its entry, filled by the engine as prefill chunks compute them.
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] * len(seq.prompt_token_ids)
            if seq.params.prompt_logprobs is not None else None)
        self._prompt_logprobs_emitted = False
        self._holdback = max((len(s) for s in self.stop), default=1) - 1

    def process(self, new_tokens: list[int], finish_reason: str | None,
                logprobs: list[dict[int, float]] | None = None
                ) -> tuple[StreamDelta, int | None]:
        """Add the tokens a step appended (`finish_reason`: the scheduler's, if it finished
        the sequence) and their log-probability entries. Returns what to stream and, when a
        stop string completed at one of them, how many of `new_tokens` to keep."""
        keep = None
        for i, token in enumerate(new_tokens):
            if self._add(token):
                keep, finish_reason = i + 1, "stop"
                break
        kept = new_tokens if keep is None else new_tokens[:keep]
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.extend(logprobs[:len(kept)])
        return self.delta(kept, finish_reason), keep

    def _add(self, token: int) -> bool:
        """Extend the text by one token; True if that completed a stop string."""
        if self.detok is None:
            return False
        piece = self.detok.add([token])
        if self.stop:
            cut = find_stop(self.detok.text, len(piece), self.stop)
            if cut is not None:
                self.text = self.detok.text[:cut]
                return True
        if token not in self.stop_token_ids:
            self.text = self.detok.text
        return False

    def delta(self, new_tokens: list[int], finish_reason: str | None) -> StreamDelta:
        """What to stream now: new tokens, and the text not yet streamed, holding back a
        possible stop-string start unless finished (`finish_reason` set)."""
        finished = finish_reason is not None
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self._holdback)
        text = self.text[self.emitted:end]
        self.emitted = end
        logprobs = None
        if self.logprobs is not None:
            logprobs = self.logprobs[self._logprobs_emitted:]
            self._logprobs_emitted = len(self.logprobs)
        prompt_logprobs = None
        if self.prompt_logprobs is not None and not self._prompt_logprobs_emitted:
            prompt_logprobs, self._prompt_logprobs_emitted = self.prompt_logprobs, True
        return StreamDelta(self.request_id, new_tokens, text, finished, finish_reason,
                           logprobs, prompt_logprobs)
