"""Turns sampled tokens into a request's output: stop checks, text, streaming deltas.

The host is the authority on stopping; the device's checks in the decode loop only save
work. Per token, in order: stop strings (the text ends before the string, the token ids with
the token that completed it), stop token ids and eos (kept in the ids; their text is not
shown), then `max_new_tokens`. While stop strings are set, the last `len(longest stop) - 1`
characters are held back from the stream, since they may turn out to start a stop string.
"""

from __future__ import annotations

import dataclasses

from jaxserve.sequence import Sequence
from jaxserve.stop_strings import find_stop
from jaxserve.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclasses.dataclass
class StreamDelta:
    """What one engine step added to one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    new_logprobs: list[dict[int, float]] | None = None  # per new token, when requested


class OutputProcessor:
    """Per-request text state; one per sequence, created at admission."""

    def __init__(self, seq: Sequence, tokenizer: Tokenizer | None):
        self.seq = seq
        self.detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.text = ""  # final text so far (stop strings and stop tokens removed)
        self.emitted = 0  # characters of `text` already streamed
        # Per generated token: {token id: log-probability} of it and the top `logprobs`.
        self.logprobs: list[dict[int, float]] | None = (
            [] if seq.params.logprobs is not None else None)
        self._logprobs_emitted = 0
        self._holdback = max((len(s) for s in seq.params.stop), default=1) - 1

    def add_tokens(self, tokens: list[int]) -> tuple[list[int], str | None]:
        """Append sampled tokens until one ends the request; returns (kept tokens, reason)."""
        seq = self.seq
        kept = []
        for token in tokens:
            seq.output_token_ids.append(token)
            kept.append(token)
            reason = self._check(token)
            if reason is not None:
                return kept, reason
        return kept, None

    def _check(self, token: int) -> str | None:
        seq = self.seq
        is_stop_token = token in seq.stop_token_ids
        if self.detok is not None:
            delta = self.detok.add([token])
            if seq.params.stop:
                cut = find_stop(self.detok.text, len(delta), seq.params.stop)
                if cut is not None:
                    self.text = self.detok.text[:cut]
                    return "stop"
            if not is_stop_token:
                self.text = self.detok.text
        if is_stop_token:
            return "stop"
        if seq.remaining_new_tokens <= 0:
            return "length"
        return None

    def add_logprobs(self, result, row: int, count: int) -> None:
        """Record log-probabilities of the first `count` samples of `row` (fields [S, K, ...])."""
        top = self.seq.params.logprobs
        for k in range(count):
            token = int(result.tokens[row, k])
            entry = {int(t): float(v) for t, v in zip(result.top_ids[row, k, :top],
                                                       result.top_logprobs[row, k, :top])}
            entry[token] = float(result.logprob[row, k])
            self.logprobs.append(entry)

    def delta(self, new_tokens: list[int], finished: bool) -> StreamDelta:
        """What to stream now: new tokens, and the text not yet streamed, holding back a
        possible stop-string start unless finished."""
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self._holdback)
        text = self.text[self.emitted:end]
        self.emitted = end
        logprobs = None
        if self.logprobs is not None:
            logprobs = self.logprobs[self._logprobs_emitted:]
            self._logprobs_emitted = len(self.logprobs)
        seq = self.seq
        return StreamDelta(seq.request_id, new_tokens, text, finished,
                           seq.finish_reason if finished else None, logprobs)
