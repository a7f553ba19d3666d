"""Speculative decoding: drafts proposed and verified inside the decode program.

`jaxserve.config.speculative` holds vLLM's `speculative_config` keys. Here: `ngram`
(prompt-lookup drafts over the token history on device), `draft` (a smaller model's greedy
drafts, over a KV pool of its own with the target's page ids), `eagle3` (a head drafting from
the target's hidden states), `drafters` (the one interface the programs ask: none, n-gram,
draft model, EAGLE-3). `jaxserve.engine.speculative_rounds` proposes, verifies through the
ragged attention batch and accepts (the runner's "spec" program); docs/speculative.md says
why the output is exact.
"""
