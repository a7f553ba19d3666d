"""The loop the decode program and the speculative rounds share (`jaxserve.engine.programs`):
steps on device until every row is done or the step budget is spent, so that several tokens
come back per host round trip."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxserve.sampling.sampler import SampleResult
from jaxserve.sampling_params import MAX_LOGPROBS


def loop_until_done(num_steps: jax.Array, body: Callable, done: jax.Array, state: Any):
    """Run `body(step, done, state) -> (stopped, state)` while `step < num_steps` and some
    row of `done [S]` is not done (`stopped [S]` joins it); the final `state`. The decode
    loop and the speculative rounds both run this loop."""

    def cond(carry):
        step, done, _ = carry
        return (step < num_steps) & ~jnp.all(done)

    def run(carry):
        step, done, state = carry
        stopped, state = body(step, done, state)
        return step + 1, done | stopped, state

    _, _, state = jax.lax.while_loop(cond, run, (jnp.int32(0), done, state))
    return state


def empty_samples(rows: int, columns: int) -> SampleResult:
    """A `SampleResult` of zeros, `[S, K]` per field (`[S, K, MAX_LOGPROBS]` the top lists)."""
    return SampleResult(tokens=jnp.zeros((rows, columns), jnp.int32),
                        logprob=jnp.zeros((rows, columns), jnp.float32),
                        top_ids=jnp.zeros((rows, columns, MAX_LOGPROBS), jnp.int32),
                        top_logprobs=jnp.zeros((rows, columns, MAX_LOGPROBS), jnp.float32))
