"""One interface for what proposes drafts, so that no traced program branches on which kind it
has: none (plain decoding), n-gram lookup, a draft model, an EAGLE-3 head.

A drafter is built inside a trace (its model merged from the program's weights) and has a part
in each of the runner's programs, as hooks the programs call at fixed points:
- `split` / `join`: the program's cache argument is the target's cache alone, or (target's,
  drafter's own) when the drafter keeps state on device (a draft model's KV pool; an EAGLE
  head's pool and `eagle3.State`);
- the step program: `follow_step` after the target's forward (the drafter keeps its cache
  over every token the target sees);
- the decode loop: `decode_begin`, `follow_decode` after each step's forward, `decode_end`;
- speculative rounds: `rounds_begin`, `propose`, `follow_round` after each verification,
  `rounds_end`.
Each hook returns the drafter's carried state (None where it has none); a hook a drafter has no
part in returns it unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.speculative import eagle3, ngram
from jaxserve.speculative.draft import propose as propose_with_draft


class Drafter:
    """No drafts (plain decoding) and the defaults every drafter starts from: no state of its
    own, no target hidden states read (`aux_layers`), nothing done after a forward."""

    aux_layers: tuple[int, ...] = ()  # the target layers whose inputs the drafter reads
    has_cache = False  # whether the programs' cache argument is (target's, drafter's)

    def split(self, caches):
        """(the target's cache, the drafter's own or None)."""
        return (caches[0], caches[1]) if self.has_cache else (caches, None)

    def join(self, caches, own):
        """The programs' cache argument from the target's cache and the drafter's own."""
        return (caches, own) if self.has_cache else caches

    def follow_step(self, model, own, inp, token_ids, batch, aux, sampled):
        """After a step program's target forward over `token_ids [T]` (`aux [T, n E]`: the
        inputs of `aux_layers`), with `sampled [S]` the tokens drawn: the drafter's state."""
        return own

    def decode_begin(self, own, inp, current):
        """The decode loop's carried drafter state, from its own state and `current [S]`."""
        return own

    def follow_decode(self, model, carry, current, position, batch, aux):
        """After one decode step's target forward over `current [S]` at `position [S]`."""
        return carry

    def decode_end(self, carry, own, current):
        """The drafter's own state after the decode loop, from its carried state and its own
        before the loop (`current [S]`: each row's newest token)."""
        return carry

    def rounds_begin(self, own, inp, current, width: int):
        """The speculative rounds' carried drafter state."""
        return own

    def propose(self, model, carry, inp, history, current, position, active):
        """`[S, k]` drafts for each row's `current [S]` at `position [S]` (`history [S, L]`
        the token history, `active [S]` the rows still running) and the carried state."""
        raise NotImplementedError("plain decoding proposes no drafts")

    def follow_round(self, carry, sampled, aux, ragged, kept):
        """After a round's verification: `sampled [S, W]` tokens drawn, `aux [T, n E]` the
        verification's `aux_layers` inputs laid out by `ragged`, `kept [S]` tokens kept."""
        return carry

    def rounds_end(self, carry, own):
        """The drafter's own state after the rounds, from its carried state and its own
        before them."""
        return carry


class NgramDrafter(Drafter):
    """Prompt lookup over each row's token history (`ngram.propose`); no state on device."""

    def __init__(self, spec, max_model_len: int):
        self.spec, self.max_model_len = spec, max_model_len

    def propose(self, model, carry, inp, history, current, position, active):
        spec = self.spec
        drafts = ngram.propose(history, position + 1, spec.num_speculative_tokens,
                               spec.prompt_lookup_min, spec.prompt_lookup_max,
                               self.max_model_len)  # [S, k]
        return drafts, carry


class DraftModelDrafter(Drafter):
    """A smaller model's greedy drafts (`draft.propose`), over a KV pool of its own that it
    fills with every token the target sees."""

    has_cache = True

    def __init__(self, draft, context, k: int, page_size: int):
        self.draft, self.context = draft, context  # context(batch): the draft's StepContext
        self.k, self.page_size = k, page_size

    def follow_step(self, model, own, inp, token_ids, batch, aux, sampled):
        return self.draft(token_ids, inp.positions, own, self.context(batch)).kv_cache

    def follow_decode(self, model, carry, current, position, batch, aux):
        return self.draft(current, position, carry, self.context(batch)).kv_cache

    def propose(self, model, carry, inp, history, current, position, active):
        return propose_with_draft(self.draft, self.context, carry, current, position,
                                  active, inp.page_indices, inp.num_seqs, self.k,
                                  self.page_size)


class Eagle3Drafter(Drafter):
    """An EAGLE-3 head reading the target's hidden states (`eagle3`). Its own state is (its
    KV pool, `eagle3.State`: what each row left it to read); the decode loop carries (pool,
    the joined target state before each row's token `[S, E]`), the rounds (pool,
    `eagle3.Pending`)."""

    has_cache = True

    def __init__(self, head: eagle3.Eagle3Head, attention, k: int, page_size: int):
        self.head, self.attention = head, attention
        self.k, self.page_size, self.width = k, page_size, k + 1
        self.aux_layers = head.eagle.aux_layer_ids

    def follow_step(self, model, own, inp, token_ids, batch, aux, sampled):
        head = self.head
        pool, state = own
        carried = state.last_hidden(inp.token_source, self.width)  # [T, E]
        _, _, pool = head(head.embeddings(model, token_ids),
                          eagle3.step_hidden(head, aux, inp.cu_q_lens, carried),
                          inp.positions, pool, self.attention.for_step(batch))
        # next: each row's sampled token, with its last token's state
        joined = head.joined(aux[inp.logits_indices])  # [S, E]
        return pool, state.stored(eagle3.single(sampled, joined, self.width))

    def decode_begin(self, own, inp, current):
        pool, state = own
        rows = current.shape[0]
        return pool, state.last_hidden(inp.token_source[:rows], self.width)

    def follow_decode(self, model, carry, current, position, batch, aux):
        pool, joined = carry  # the head reads each token with the state before it
        _, _, pool = self.head(self.head.embeddings(model, current), joined, position, pool,
                               self.attention.for_step(batch))
        return pool, self.head.joined(aux)

    def decode_end(self, carry, own, current):
        pool, joined = carry
        return pool, own[1].stored(eagle3.single(current, joined, self.width))

    def rounds_begin(self, own, inp, current, width: int):
        pool, state = own
        rows = current.shape[0]
        return pool, state.pending(inp.token_source[:rows], current, width)

    def propose(self, model, carry, inp, history, current, position, active):
        pool, pending = carry
        drafts, pool = eagle3.propose(self.head, self.attention, model, pool, pending, self.k,
                                      position, active, inp.page_indices, inp.num_seqs,
                                      self.page_size)
        return drafts, (pool, pending)

    def follow_round(self, carry, sampled, aux, ragged, kept):
        pool, pending = carry  # the head reads the kept tokens with the target's states next
        joined = ragged.per_column(self.head.joined(aux))  # [S, W, E]
        pending = jax.tree.map(
            lambda new, old: jnp.where((kept > 0).reshape(-1, *[1] * (new.ndim - 1)), new, old),
            eagle3.Pending(sampled, joined, kept), pending)
        return pool, pending

    def rounds_end(self, carry, own):
        pool, pending = carry
        return pool, own[1].stored(pending)


def make_drafter(spec, max_model_len: int, page_size: int, draft=None, attention=None,
                 context=None) -> Drafter:
    """The drafter for `spec` (a `SpeculativeConfig`, or None: plain decoding): `draft` is
    the draft model or EAGLE head (merged in the trace) with its attention backend, and
    `context(batch)` the `StepContext` of a draft model's forward."""
    if spec is None:
        return Drafter()
    k = spec.num_speculative_tokens
    if isinstance(draft, eagle3.Eagle3Head):
        return Eagle3Drafter(draft, attention, k, page_size)
    if draft is not None:
        return DraftModelDrafter(draft, context, k, page_size)
    return NgramDrafter(spec, max_model_len)
