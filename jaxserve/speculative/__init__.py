"""Speculative decoding: drafts proposed and verified inside the decode program.

`config` (vLLM's `speculative_config` keys), `ngram` (prompt-lookup drafts over the token
history on device), `draft` (a smaller model's greedy drafts, over a KV pool of its own with
the target's page ids), `jaxserve.engine.speculative_rounds` (propose, verify through the ragged attention batch, accept:
the runner's "spec" program). docs/speculative.md says why the output is exact.
"""

from jaxserve.speculative.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
