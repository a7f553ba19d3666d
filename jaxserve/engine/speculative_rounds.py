"""The speculative decode loop, traced into the runner's "spec" program (one per row bucket;
`jaxserve.engine.programs`).

Each round, for every row at once, in one device program with no host round trip:
1. propose: up to k drafts (the `drafter`'s: n-gram lookup over the row's token history, a
   draft model, an EAGLE-3 head; `jaxserve.speculative.drafters`);
2. verify: one forward over the row's current token and its drafts (k + 1 positions, a
   ragged batch through the attention backend, K/V written for all of them);
3. accept: sample a token at every position with the row's own settings, keyed by (seed,
   position) as the plain decode loop keys it, and keep the sampled tokens up to and including
   the first one that differs from its draft.

Why sampling then comparing is exact: a draft here is one token with probability 1, and for
such a draft standard speculative sampling (accept with probability min(1, p(d) / q(d)) =
p(d), else sample from the normalized max(0, p - q), which is p without d) gives each kept
token exactly the target's distribution p — as does drawing t ~ p and keeping the draft when
t = d (probability p(d)), else keeping t (p conditioned on t != d). And since the draw at a
position is the one the plain decode loop makes there, greedy and seeded rows produce the
tokens they would produce without speculation.

Rows that cannot speculate still take part, with no drafts (one position, as a decode step):
rows under a grammar (the mask after a draft needs the host) and rows with penalties (their
counts after a draft would differ per position). Their position 0 samples with penalties and
masks; draft positions sample without either, which no row that drafts needs.

A rejected draft's K/V stays in its slot until the next round overwrites it; the row's length
only counts kept tokens, so nothing reads it. The host books the kept tokens (the decode
loop's `postprocess`), keys only their pages for the prefix cache, and frees the pages the
rejected drafts alone used.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.engine.batcher import StepInput
from jaxserve.config.engine import EngineConfig
from jaxserve.engine.device_loop import empty_samples, loop_until_done
from jaxserve.sampling.sampler import TokenCounts, penalized_rows, sample_with_logprobs
from jaxserve.speculative import ngram
from jaxserve.speculative.drafters import Drafter
from jaxserve.speculative.windows import RaggedWindow


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftCounts:
    """What a speculative program proposed and kept, per row over its rounds (the host sums
    them into vLLM's `spec_decode` counters)."""

    num_drafts: jax.Array  # [S] int32, rounds in which the row proposed at least one token
    num_draft_tokens: jax.Array  # [S] int32, tokens proposed
    accepted_per_pos: jax.Array  # [S, k] int32, rounds whose draft j was accepted


def acceptance(sampled: jax.Array, drafts: jax.Array, stop_ids: jax.Array,
               remaining: jax.Array, done: jax.Array) -> tuple[jax.Array, ...]:
    """Which of a round's tokens each row keeps. `sampled [S, k + 1]`: the token drawn at
    each position (after the current token, then after each draft); `drafts [S, k]`
    (`NO_DRAFT` where none); `stop_ids [S, M]` (-1 padded); `remaining [S]`: tokens the row
    may still keep; `done [S]`: rows already finished. Returns `[S]` each: drafts accepted
    (the leading drafts equal to the token drawn before them), tokens kept (the accepted
    drafts' tokens and the one drawn after them, cut after a stop token and at `remaining`),
    and whether the row stops here."""
    width = sampled.shape[1]
    accepted = jnp.sum(jnp.cumprod(sampled[:, :-1] == drafts, axis=1), axis=1)
    is_stop = jnp.any(sampled[:, :, None] == stop_ids[:, None, :], axis=-1)  # [S, W]
    first_stop = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1), width)
    kept = jnp.minimum(jnp.minimum(accepted + 1, first_stop + 1), remaining)
    kept = jnp.where(done, 0, kept)
    stopped = ~done & ((first_stop < kept) | (kept >= remaining))
    return accepted, kept, stopped


def speculative_rounds(model, context, inp: StepInput, caches, current: jax.Array,
                       num_rounds: jax.Array, config: EngineConfig, vocab: int,
                       drafter: Drafter, load: jax.Array | None = None):
    """Up to `num_rounds` rounds for the rows of a decode-only `inp` (one token per row,
    `current [S]`, at `inp.positions`), `drafter` proposing (`caches` as its `split` takes
    them); `context(batch)`: the `StepContext` of a forward over a `PagedBatch`. Returns the
    kept tokens (`SampleResult` of `[S, R * (k + 1)]` fields, R = `num_decode_steps`), how
    many each row kept `[S]`, `DraftCounts`, the cache(s), each row's newest token `[S]`,
    and `load` (a mixture-of-experts target's expert load `[L, X]`, None for a dense one)
    plus the pairs the verifications ran."""
    spec = config.speculative_config
    k, page_size, limit = spec.num_speculative_tokens, config.page_size, config.max_model_len
    width = k + 1
    rows = inp.kv_lens.shape[0]
    tokens = rows * width
    row = jnp.arange(rows)
    col = jnp.arange(width)  # [W] position j of a round: the current token, then drafts
    valid = row < inp.num_seqs[0]  # [S]
    drafting = valid & ~inp.sampling.constrained & ~penalized_rows(inp.sampling)
    history = inp.history.at[row, inp.positions].set(current)  # [S, L], current included
    counts = TokenCounts.from_history(history, inp.prompt_lens, vocab, inp.sampling)
    capacity = config.num_decode_steps * width
    stats = DraftCounts(jnp.zeros((rows,), jnp.int32), jnp.zeros((rows,), jnp.int32),
                        jnp.zeros((rows, k), jnp.int32))
    # draft positions sample without penalties or masks (rows with either never draft)
    free = dataclasses.replace(inp.sampling, presence=jnp.zeros_like(inp.sampling.presence),
                               frequency=jnp.zeros_like(inp.sampling.frequency),
                               repetition=jnp.ones_like(inp.sampling.repetition),
                               constrained=jnp.zeros_like(inp.sampling.constrained))
    free = jax.tree.map(lambda a: jnp.repeat(a, k, axis=0), free)  # [S * k] rows

    def verify(position, window, done, caches, counts, load):
        """Forward over `window [S, W]` (current token, drafts) at `position [S]` on; the
        token sampled at each of its positions (`SampleResult` of `[S, W]` fields), the
        target's `aux_layers` inputs for the drafter `[T, n E]` (None: it reads none) and
        the verification's `RaggedWindow`."""
        q_lens = jnp.where(valid, jnp.sum(window >= 0, axis=1), 0)  # [S] drafts are leading
        at = position[:, None] + col[None, :]  # [S, W]
        ragged = RaggedWindow.of(q_lens, at, ~done[:, None], inp.page_indices, inp.num_seqs,
                                 page_size, inp.window_page_indices)
        out = model(ragged.flat(jnp.maximum(window, 0), 0), ragged.flat(at, 0), caches,
                    context(ragged.batch), aux_layers=drafter.aux_layers,
                    count_experts=load is not None)
        hidden, caches, aux = out.hidden, out.kv_cache, out.aux  # [T, E], ..., [T, n E]
        if load is not None:
            load = load + out.expert_load  # [L, X]
        # one logits matmul for every position: the vocabulary's weights are read once
        logits = model.logits(ragged.per_column(hidden).reshape(tokens, -1))
        logits = logits.reshape(rows, width, -1)  # [S, W, V]
        first = sample_with_logprobs(logits[:, 0], inp.sampling, position + 1, counts,
                                     inp.allowed)  # [S]
        rest = sample_with_logprobs(logits[:, 1:].reshape(rows * k, -1), free,
                                    (at[:, 1:] + 1).reshape(-1), None, None)  # [S * k]
        sampled = jax.tree.map(
            lambda a, b: jnp.concatenate([a[:, None], b.reshape(rows, k, *b.shape[1:])], 1),
            first, rest)
        return sampled, caches, aux, ragged, load

    def body(step, done, carry):
        out, count, current, position, history, counts, stats, caches, drafted, load = carry
        remaining = inp.max_new - count  # [S] tokens the row may still keep
        drafts, drafted = drafter.propose(model, drafted, inp, history, current, position,
                                          valid & ~done)  # [S, k]
        may_draft = drafting[:, None] & ~done[:, None] & (col[None, 1:] < remaining[:, None])
        drafts = jnp.where(may_draft, drafts, ngram.NO_DRAFT)
        window = jnp.concatenate([current[:, None], drafts], axis=1)  # [S, W]
        sampled, caches, aux, ragged, load = verify(position, window, done, caches, counts,
                                                    load)
        accepted, kept, stopped = acceptance(sampled.tokens, drafts, inp.stop_ids, remaining,
                                             done)
        keep = col[None, :] < kept[:, None]  # [S, W]
        slot = jnp.where(keep, count[:, None] + col[None, :], capacity)  # [S, W]
        out = jax.tree.map(lambda buf, new: buf.at[row[:, None], slot].set(new, mode="drop"),
                           out, sampled)
        history = history.at[row[:, None], jnp.where(keep, position[:, None] + 1 + col, limit)
                             ].set(sampled.tokens, mode="drop")
        counts = counts.add(sampled.tokens[:, 0], kept > 0)  # penalty rows keep one a round
        proposed = jnp.sum(drafts >= 0, axis=1)
        stats = DraftCounts(
            stats.num_drafts + (proposed > 0), stats.num_draft_tokens + proposed,
            stats.accepted_per_pos + ((col[None, :k] < accepted[:, None])
                                      & (proposed > 0)[:, None]).astype(jnp.int32))
        newest = sampled.tokens[row, jnp.maximum(kept - 1, 0)]
        current = jnp.where(kept > 0, newest, current)
        drafted = drafter.follow_round(drafted, sampled.tokens, aux, ragged, kept)
        return stopped, (out, count + kept, current, position + kept, history, counts, stats,
                         caches, drafted, load)

    caches, own = drafter.split(caches)
    carry = (empty_samples(rows, capacity), jnp.zeros((rows,), jnp.int32), current,
             inp.positions[:rows], history, counts, stats, caches,
             drafter.rounds_begin(own, inp, current, width), load)
    out, count, current, _, _, _, stats, caches, drafted, load = loop_until_done(
        num_rounds, body, ~valid | (inp.max_new <= 0), carry)
    caches = drafter.join(caches, drafter.rounds_end(drafted, own))
    return out, count, stats, caches, current, load
