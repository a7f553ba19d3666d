"""Speculative decoding: drafts proposed and verified inside the decode program.

`config` (vLLM's `speculative_config` keys), `ngram` (prompt-lookup drafts over the token
history on device), `rounds` (propose, verify through the ragged attention batch, accept: the
runner's "spec" program).
"""

from jaxserve.speculative.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
