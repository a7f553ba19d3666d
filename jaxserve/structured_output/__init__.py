"""Structured output: grammars that constrain sampling, compiled to per-step token bitmasks.

A request asks for a JSON schema, any JSON object, a regex, one of a list of strings, or a
grammar (`StructuredOutputsParams`, shaped like vLLM's). `GrammarCompiler` turns it into a
`GrammarMatcher` for the model's tokenizer; before each sampling step the matcher writes the
tokens allowed next into one row of an int32 bitmask (bit j of word i: token 32 i + j), the
device masks the logits with it, and the sampled token advances the matcher.

The engine is llguidance (Rust, used by vLLM and sglang-jax): it computes masks into numpy
buffers with no torch, releases the GIL, and fills many rows in parallel. xgrammar, the other
common choice, exposes its host bitmask API through torch tensors only.

Choices made here:
- JSON is compact by default: llguidance's `whitespace_flexible` is off, so no free
  whitespace anywhere (`{"a":1,"b":[2]}`) and a small model cannot loop on spaces or newlines.
  A schema may opt back in through llguidance's own key, e.g.
  `"x-guidance": {"whitespace_flexible": true}` or `{"item_separator": ", "}`. Keywords
  llguidance cannot enforce (an unknown `format`, ...) are errors, not silently ignored.
- `grammar` is Lark in llguidance's dialect when a line starts with `start:` or
  `%llguidance`, else GBNF (llama.cpp's `root ::= ...`), converted by llguidance.
- Regexes use Rust's syntax (llguidance's) with JSON Schema's classes: `\\d` is `[0-9]` and
  `\\w` `[0-9a-zA-Z_]` (Python's `re.ASCII`), not every script's digits and letters.
- eos: llguidance is given the eos ids, so they are allowed exactly when the grammar accepts,
  and only they once it is complete (`is_finished`). ids the tokenizer lacks (the model's
  padded vocabulary rows) are never allowed.

Cost, measured on a shared 2-core CPU with the shipped model's 4096-token tokenizer (random
walks through a JSON schema, each step a new grammar state): a mask row takes 10-20 us,
alone (`fill_bitmask`) or per row in batches of 8-64 (`fill_bitmasks`, llguidance's thread
pool, which gains nothing on 2 busy cores and is there for hosts with more). Compiling a
schema takes 0.5-1.5 ms; a cache hit 7-13 us, mostly `cache_key()` (the deep copy is 0.5 us).
Mask time grows with the vocabulary; a 128k one was not measured here.
"""

import importlib

from jaxserve.structured_output.params import StructuredOutputsParams

# llguidance loads only when a grammar is first compiled: the engine, and a deployment image
# without llguidance, serve unconstrained requests without it.
_COMPILER_NAMES = ("CacheInfo", "GrammarCompiler", "GrammarMatcher", "fill_bitmasks")

__all__ = ["StructuredOutputsParams", *_COMPILER_NAMES]


def __getattr__(name: str):
    if name in _COMPILER_NAMES:
        return getattr(importlib.import_module("jaxserve.structured_output.compiler"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
