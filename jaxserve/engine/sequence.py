"""Host-side state of one request while the engine serves it (plain Python, no jax).

A sequence's tokens are its prompt followed by what it generated. `num_computed_tokens` of
them have K/V in the cache (in `pages`, in order); the rest are computed by later steps. A
preempted sequence keeps its tokens but loses its pages and recomputes them all, output
included, as one longer prompt. While a step is on device, each token it will sample is a
`PENDING` placeholder at the end of the outputs, so the next step can be scheduled (and fed
that token on device) before this one's results are read.

A request with structured output carries a `GrammarState`: its grammar's matcher and the
bitmask of the tokens allowed next, recomputed (for all such requests of a step at once) as
the step's tokens are booked, so the next step's mask is ready before it is scheduled.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Any

import numpy as np

from jaxserve.engine.page_allocator import root_key
from jaxserve.sampling_params import SamplingParams

PENDING = -1  # an output token sampled by a step still on device (`Scheduler.advance`)
# Finish reason of a request whose grammar rejected its token or allows no token after it.
GRAMMAR_DEAD_END = "grammar_dead_end"


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class RequestTimes:
    """Wall-clock marks of one request, for latency metrics (seconds, `time.monotonic`)."""

    arrival: float = dataclasses.field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    inter_token: list[float] = dataclasses.field(default_factory=list)

    def tokens_arrived(self, count: int, now: float) -> None:
        """Record `count` tokens that reached the host together at `now`."""
        if count <= 0:
            return
        if self.first_token is None:
            self.first_token = now
            count -= 1
        elif self.last_token is not None:
            # A multi-step decode returns several tokens at once: spread the gap evenly.
            gap = (now - self.last_token) / count
            self.inter_token.extend([gap] * count)
            count = 0
        if count:
            self.inter_token.extend([0.0] * count)
        self.last_token = now


@dataclasses.dataclass
class GrammarState:
    """A request's grammar (a `jaxserve.structured_output.GrammarMatcher`) and the tokens it
    allows next."""

    matcher: Any
    mask: np.ndarray  # [ceil(V / 32)] int32 bitmask, bit j of word i: token 32 i + j

    @classmethod
    def start(cls, matcher: Any, mask_words: int) -> "GrammarState | None":
        """The grammar at its start; None if it allows no first token."""
        mask = np.zeros(mask_words, np.int32)
        return cls(matcher, mask) if matcher.fill_bitmask(mask) else None

    def advance(self, token: int) -> str | None:
        """Book a sampled token: None to go on (then `refresh_masks` before the next step),
        "stop" when it completed the grammar, `GRAMMAR_DEAD_END` when the grammar rejects
        it."""
        if not self.matcher.accept(token):
            return GRAMMAR_DEAD_END
        return "stop" if self.matcher.is_finished else None


def refresh_masks(states: list[GrammarState]) -> list[bool]:
    """Recompute the masks of grammars that booked a token, all at once (llguidance fills
    the rows on its thread pool, without the GIL); False where a grammar allows no token."""
    rows = np.empty((len(states), states[0].mask.shape[0]), np.int32)  # [N, W]
    from jaxserve.structured_output.compiler import fill_bitmasks  # llguidance, on first use

    allowed = fill_bitmasks([state.matcher for state in states], rows)
    for state, row in zip(states, rows):
        state.mask[:] = row
    return allowed


@dataclasses.dataclass
class Sequence:
    """One request: its tokens, its pages, its progress and how it ended."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    max_new_tokens: int  # min(max_tokens, max_model_len - prompt length)
    stop_token_ids: frozenset[int]  # eos (unless ignore_eos) and stop_token_ids
    prompt: str | None = None
    grammar: GrammarState | None = None  # structured output: the tokens allowed next
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    page_hashes: list[bytes] = dataclasses.field(default_factory=list)  # of full pages, in order
    # hybrid KV memory: the window layers' page table (`jaxserve.engine.window_pages`), as
    # long as `pages`, 0 where a page slid out of the window
    window_pages: list[int] = dataclasses.field(default_factory=list)
    cache_salt: str | None = None  # prefix-cache isolation: pages shared only with the same salt
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    lora: Any = None  # the adapter it is generated with (`jaxserve.lora.slots.Adapter`)
    lora_slot: int = -1  # the device slot holding it while admitted (-1: none held)
    # The row, in the step still on device, whose sampled token is the PENDING token at the
    # end of `output_token_ids` (the next step reads it there on device).
    pending_row: int | None = None
    status: Status = Status.WAITING
    finish_reason: str | None = None
    times: RequestTimes = dataclasses.field(default_factory=RequestTimes)

    @property
    def prefix_root(self) -> bytes:
        """The key its prefix-cache pages chain from: its salt and its adapter's key."""
        return root_key(self.cache_salt, None if self.lora is None else self.lora.key)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens_between(self, start: int, stop: int) -> list[int]:
        """`token_ids[start:stop]` without building the whole list (a decode step reads one
        token of a long sequence)."""
        prompt = len(self.prompt_token_ids)
        if start >= prompt:
            return self.output_token_ids[start - prompt:stop - prompt]
        if stop <= prompt:
            return self.prompt_token_ids[start:stop]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - prompt]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_decoding(self) -> bool:
        """True when only the newest sampled token is missing from the cache."""
        return bool(self.output_token_ids) and self.num_computed_tokens == self.num_tokens - 1

    @property
    def remaining_new_tokens(self) -> int:
        return self.max_new_tokens - len(self.output_token_ids)
