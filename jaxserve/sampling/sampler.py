"""On-device token sampling from per-row arrays.

Every sampling setting is a row of an array, never a Python constant, so a batch that mixes
greedy and sampled requests with different temperatures, top-k, top-p, min-p, penalties and
seeds runs one compiled program. Randomness is keyed by (request seed, position of the sampled
token), so a seeded request gives the same tokens however it is batched.

Structured output constrains rows through `allowed`, a `[B, ceil(V / 32)]` int32 bitmask per
row (bit j of word i: token 32 i + j may come next; all ones for a free row), computed on the
host by the request's grammar and applied to the logits here, after penalties and before
sampling, so a batch that mixes constrained and free rows runs the same program. The
reported log-probabilities stay those of the model's raw distribution (as vLLM's default).

Prompt log-probabilities (`target_logprobs`) score given next tokens at every position of the
step's flat batch, in tiles of tokens so the `[T, V]` logits never exist at once.

Penalties need each row's token counts over the vocabulary (`TokenCounts`); they are built
from the row's token history only when some row has a penalty, and the decode loop updates
them with every token it samples.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxserve import fixed_order
from jaxserve.sampling.arrays import SamplingArrays
from jaxserve.sampling_params import MAX_LOGPROBS


# The batcher builds these in numpy; traced programs take them as pytrees.
jax.tree_util.register_dataclass(SamplingArrays)


def penalized_rows(arrays: SamplingArrays) -> jax.Array:
    """`[B]` bool: the rows with a presence, frequency or repetition penalty."""
    return (arrays.presence != 0) | (arrays.frequency != 0) | (arrays.repetition != 1)


def any_penalty(arrays: SamplingArrays) -> jax.Array:
    """Whether some row has a presence, frequency or repetition penalty."""
    return jnp.any(penalized_rows(arrays))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TokenCounts:
    """What each row has seen, for penalties."""

    generated: jax.Array  # [B, V] int32, times each token was generated
    seen: jax.Array  # [B, V] bool, token in the prompt or generated

    @classmethod
    def from_history(cls, history: jax.Array, prompt_lens: jax.Array, vocab: int,
                     arrays: SamplingArrays) -> "TokenCounts":
        """history `[B, L]` token ids (-1 padded), the first prompt_lens[b] of row b from its
        prompt. All zeros, without the scatter, when no row has a penalty."""
        rows, length = history.shape

        def count():
            valid = history >= 0  # [B, L]
            ids = jnp.where(valid, history, 0)
            row = jnp.arange(rows)[:, None]  # [B, 1]
            is_generated = valid & (jnp.arange(length)[None, :] >= prompt_lens[:, None])
            generated = jnp.zeros((rows, vocab), jnp.int32).at[row, ids].add(
                is_generated.astype(jnp.int32))
            seen = jnp.zeros((rows, vocab), jnp.bool_).at[row, ids].max(valid)
            return cls(generated, seen)

        def empty():
            return cls(jnp.zeros((rows, vocab), jnp.int32), jnp.zeros((rows, vocab), jnp.bool_))

        return jax.lax.cond(any_penalty(arrays), count, empty)

    def add(self, tokens: jax.Array, mask: jax.Array) -> "TokenCounts":
        """Count `tokens [B]` where `mask [B]`."""
        row = jnp.arange(tokens.shape[0])
        return TokenCounts(self.generated.at[row, tokens].add(mask.astype(jnp.int32)),
                           self.seen.at[row, tokens].max(mask))


def apply_penalties(logits: jax.Array, arrays: SamplingArrays,
                    counts: TokenCounts) -> jax.Array:
    """vLLM's penalties on `[B, V]` float32 logits."""
    rep = arrays.repetition[:, None]  # [B, 1]
    penalized = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(counts.seen, penalized, logits)
    logits = logits - arrays.frequency[:, None] * counts.generated
    return logits - arrays.presence[:, None] * (counts.generated > 0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SampleResult:
    """Chosen tokens with their log-probabilities under the model's raw distribution."""

    tokens: jax.Array  # [B] int32
    logprob: jax.Array  # [B] float32
    top_ids: jax.Array  # [B, MAX_LOGPROBS] int32
    top_logprobs: jax.Array  # [B, MAX_LOGPROBS] float32


def allowed_tokens(allowed: jax.Array, vocab: int) -> jax.Array:
    """The `[B, W]` int32 bitmask as `[B, vocab]` bool."""
    bits = jnp.arange(32, dtype=jnp.int32)  # [32]
    unpacked = jnp.right_shift(allowed[:, :, None], bits) & 1  # [B, W, 32]
    return unpacked.reshape(allowed.shape[0], -1)[:, :vocab] != 0


def apply_grammar(logits: jax.Array, arrays: SamplingArrays, allowed: jax.Array) -> jax.Array:
    """`[B, V]` logits with the tokens each row's grammar forbids at -inf; skipped at run
    time when no row is constrained. The host never sends a row with no allowed token (it
    ends that request first), so no row becomes all -inf."""
    def constrain():
        return jnp.where(allowed_tokens(allowed, logits.shape[-1]), logits, -jnp.inf)
    return jax.lax.cond(jnp.any(arrays.constrained), constrain, lambda: logits)


def scored(logits: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Log-probabilities of `tokens [N]` under `logits [N, V]`, and the `MAX_LOGPROBS` most
    likely tokens' (ids `[N, MAX_LOGPROBS]` int32, log-probabilities `[N, MAX_LOGPROBS]`)."""
    logprobs = fixed_order.rowwise(functools.partial(jax.nn.log_softmax, axis=-1),
                                   logits)  # [N, V]
    top_logprobs, top_ids = jax.lax.top_k(logprobs, MAX_LOGPROBS)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]  # [N]
    return chosen, top_ids.astype(jnp.int32), top_logprobs


def sample_with_logprobs(logits: jax.Array, arrays: SamplingArrays, positions: jax.Array,
                         counts: TokenCounts | None, allowed: jax.Array | None) -> SampleResult:
    """Penalties and the grammar masks (`allowed` `[B, W]`), then `sample`; log-probabilities
    come from the unpenalized, unmasked logits. `counts` / `allowed` None: rows known to have
    no penalty / grammar (a speculative step's draft positions), nothing of either traced.

    Penalties and log-probabilities each pass over the whole `[B, V]` logits, so each runs
    only when some row of the batch asked for it (a `lax.cond`); otherwise its fields are
    zeros."""
    penalized = logits if counts is None else jax.lax.cond(
        any_penalty(arrays), lambda: apply_penalties(logits, arrays, counts), lambda: logits)
    masked = penalized if allowed is None else apply_grammar(penalized, arrays, allowed)
    tokens = sample(masked, arrays, positions)

    def log_probabilities():
        return scored(logits, tokens)

    def none():
        rows = logits.shape[0]
        return (jnp.zeros((rows,), jnp.float32), jnp.zeros((rows, MAX_LOGPROBS), jnp.int32),
                jnp.zeros((rows, MAX_LOGPROBS), jnp.float32))

    chosen, top_ids, top_logprobs = jax.lax.cond(jnp.any(arrays.wants_logprobs),
                                                 log_probabilities, none)
    return SampleResult(tokens, chosen, top_ids, top_logprobs)


TARGET_TILE = 128  # tokens whose logits `target_logprobs` holds at once


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TargetLogprobs:
    """Log-probability of a given next token at each position, with the most likely ones."""

    logprob: jax.Array  # [T] float32
    top_ids: jax.Array  # [T, MAX_LOGPROBS] int32
    top_logprobs: jax.Array  # [T, MAX_LOGPROBS] float32


def target_logprobs(hidden: jax.Array, targets: jax.Array, logits_fn) -> TargetLogprobs:
    """Score `targets [T]` (the token that follows each position; -1: none wanted) under the
    model's distribution at `hidden [T, E]`, `logits_fn` mapping `[N, E]` to `[N, V]` float32
    logits. Runs in tiles of `TARGET_TILE` tokens, and not at all (zeros) when no target is
    wanted, so steps without prompt log-probabilities pay one reduction over `[T]`."""
    tokens = hidden.shape[0]
    tiles = -(-tokens // TARGET_TILE)
    pad = tiles * TARGET_TILE - tokens

    def score():
        padded = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(tiles, TARGET_TILE, -1)
        wanted = jnp.pad(jnp.maximum(targets, 0), (0, pad)).reshape(tiles, TARGET_TILE)

        chosen, top_ids, top_logprobs = jax.lax.map(  # per tile [TILE, E], [TILE]
            lambda args: scored(logits_fn(args[0]), args[1]), (padded, wanted))
        return TargetLogprobs(chosen.reshape(-1)[:tokens],
                              top_ids.reshape(-1, MAX_LOGPROBS)[:tokens],
                              top_logprobs.reshape(-1, MAX_LOGPROBS)[:tokens])

    def none():
        return TargetLogprobs(jnp.zeros((tokens,), jnp.float32),
                              jnp.zeros((tokens, MAX_LOGPROBS), jnp.int32),
                              jnp.zeros((tokens, MAX_LOGPROBS), jnp.float32))

    return jax.lax.cond(jnp.any(targets >= 0), score, none)


def greedy(logits: jax.Array) -> jax.Array:
    """`argmax` over the last axis (the first index on ties), as a max then a min: two plain
    reductions, which XLA's CPU backend runs several times faster than a variadic argmax
    reduce. `[B, V]` → `[B]` int32."""
    peak = jnp.max(logits, axis=-1, keepdims=True)  # [B, 1]
    index = jnp.arange(logits.shape[-1], dtype=jnp.int32)  # [V]
    return jnp.min(jnp.where(logits == peak, index, logits.shape[-1]), axis=-1)


def _ordered_keys(x: jax.Array) -> jax.Array:
    """float32 → int32 keys in the same order (the bits, negatives' magnitude flipped), so
    that a threshold between any two distinct floats is found by 32 halvings."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _largest_key_where(keys: jax.Array, holds) -> jax.Array:
    """Per row of `keys [B, V]`, the largest key t (between the row's smallest and largest)
    for which `holds(t [B, 1]) → [B] bool` is true, `holds` being true for small t and false
    for large: a binary search of 32 steps, each one pass over the row. The smallest key is
    the answer when nothing larger holds."""
    low = jnp.min(keys, axis=-1, keepdims=True)  # [B, 1]
    high = jnp.max(keys, axis=-1, keepdims=True) + 1  # [B, 1], never holds

    def halve(_, bounds):
        low, high = bounds
        mid = (low >> 1) + (high >> 1) + (low & high & 1)  # floor((low + high) / 2)
        ok = holds(mid)[:, None]
        return jnp.where(ok, mid, low), jnp.where(ok, high, mid)

    return jax.lax.fori_loop(0, 32, halve, (low, high))[0]


def _rank_filtered(scaled: jax.Array, arrays: SamplingArrays) -> jax.Array:
    """`[B, V]` temperature-scaled logits with the tokens outside each row's top-k, then
    top-p, at -inf, in token order.

    Both keep the most likely tokens down to a cutoff, so each is a threshold found by binary
    search, as tpu-inference does, rather than by sorting the row: top-k's cutoff is the
    largest logit with at least k tokens at or above it, top-p's the largest with at least
    `top_p` of the probability (after top-k) at or above it, which keeps the smallest set of
    top tokens whose mass reaches `top_p`. 64 passes over `[B, V]` instead of a sort (a
    sort's many passes and its permutation are what TPUs and XLA:CPU do slowest). A token
    tied with a cutoff stays; the most likely token always stays."""
    vocab = scaled.shape[-1]
    keys = _ordered_keys(scaled)  # [B, V]
    bottom = jnp.min(keys, axis=-1, keepdims=True)  # [B, 1] keeps every token
    top_k = arrays.top_k[:, None]  # [B, 1]
    k_cut = _largest_key_where(keys, lambda t: jnp.sum(keys >= t, axis=-1) >= top_k[:, 0])
    k_cut = jnp.where((top_k > 0) & (top_k < vocab), k_cut, bottom)
    probs = jax.nn.softmax(jnp.where(keys >= k_cut, scaled, -jnp.inf), axis=-1)  # [B, V]
    p_cut = _largest_key_where(keys, lambda t: jnp.sum(jnp.where(keys >= t, probs, 0.0),
                                                       axis=-1) >= arrays.top_p)
    p_cut = jnp.where(arrays.top_p[:, None] < 1, p_cut, bottom)
    return jnp.where(keys >= jnp.maximum(k_cut, p_cut), scaled, -jnp.inf)


def _filtered_sample(logits: jax.Array, arrays: SamplingArrays,
                     positions: jax.Array) -> jax.Array:
    """Temperature, then top-k and top-p, then min-p, then one categorical draw per row.

    Top-k and top-p search each row for a cutoff (`_rank_filtered`: 64 passes over
    `[B, V]`), so they run only when some row of the batch asks for one of them (a
    `lax.cond`). Min-p needs no search: a token's probability over the top one's is
    exp(its logit - the top logit), whatever the normalization. The draw is a Gumbel argmax
    in token order, keyed by (seed, position), so a row gets the same token whether or not
    its batch searched for cutoffs."""
    vocab = logits.shape[-1]
    temperature = jnp.where(arrays.temperature > 0, arrays.temperature, 1.0)
    scaled = logits / temperature[:, None]  # [B, V]
    ranks = (arrays.temperature > 0) & (((arrays.top_k > 0) & (arrays.top_k < vocab))
                                        | (arrays.top_p < 1))
    filtered = jax.lax.cond(jnp.any(ranks), lambda: _rank_filtered(scaled, arrays),
                            lambda: scaled)
    top = jnp.max(scaled, axis=-1, keepdims=True)  # [B, 1]
    filtered = jnp.where(scaled - top >= jnp.log(arrays.min_p)[:, None], filtered, -jnp.inf)
    keys = jax.vmap(lambda seed, pos: jax.random.fold_in(jax.random.key(seed), pos))(
        arrays.seed, positions)
    return jax.vmap(jax.random.categorical)(keys, filtered)  # [B] token ids


def sample(logits: jax.Array, arrays: SamplingArrays, positions: jax.Array) -> jax.Array:
    """Choose one token per row.

    logits `[B, V]` float32; positions `[B]` int32, the position the new token will take.
    Returns `[B]` int32. When every row is greedy, nothing but the argmax runs.
    """
    best = greedy(logits)  # [B]
    all_greedy = jnp.all(arrays.temperature == 0)
    sampled = jax.lax.cond(all_greedy, lambda: best,
                           lambda: _filtered_sample(logits, arrays, positions).astype(jnp.int32))
    return jnp.where(arrays.temperature == 0, best, sampled)
