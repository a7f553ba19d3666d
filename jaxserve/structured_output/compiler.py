"""Compiles `StructuredOutputsParams` to llguidance matchers; fills token bitmasks.

See the package docstring for the choices (compact JSON, regex classes, eos) and the costs.
"""

from __future__ import annotations

import collections
import json as jsonlib
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import llguidance
import llguidance.numpy
import numpy as np
import tokenizers

from jaxserve.errors import InvalidRequestError
from jaxserve.structured_output.params import StructuredOutputsParams

_JSON_DEFAULTS = {"whitespace_flexible": False}  # compact JSON unless the schema opts in
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)  # short error texts for clients


def _load_tokenizer(source: Any) -> tuple[str, int]:
    """(tokenizer.json text with padding and truncation off, ids in its vocabulary) of a
    jaxserve `Tokenizer`, a `tokenizers.Tokenizer`, a model folder or a tokenizer.json path."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        hf = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
    else:
        hf = getattr(source, "_tok", source)
    data = jsonlib.loads(hf.to_str())
    data["padding"] = data["truncation"] = None
    return jsonlib.dumps(data), max(hf.get_vocab(with_added_tokens=True).values()) + 1


CacheInfo = collections.namedtuple("CacheInfo", "hits misses size maxsize")


class GrammarCompiler:
    """Compiles StructuredOutputsParams to matchers for one tokenizer; cached per spec.

    `vocab_size` is the model's vocabulary (rows of its logits), at least the tokenizer's;
    ids past the tokenizer's are never allowed. `eos_token_ids`: the ids that end a sequence
    (those the tokenizer lacks are dropped).
    """

    def __init__(self, tokenizer_json_path_or_tokenizer: Any, vocab_size: int,
                 eos_token_ids: Iterable[int], cache_size: int = 128):
        text, tokens = _load_tokenizer(tokenizer_json_path_or_tokenizer)
        if vocab_size < tokens:
            raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {tokens}")
        eos = sorted({int(t) for t in eos_token_ids if 0 <= int(t) < tokens})
        if not eos:
            raise ValueError("structured output needs an eos token id in the tokenizer's "
                             f"vocabulary; got {list(eos_token_ids)}")
        self.vocab_size = vocab_size
        self.eos_token_ids = eos
        self._tokenizer = llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos)
        self._cache: collections.OrderedDict[str, llguidance.LLMatcher] = \
            collections.OrderedDict()  # cache_key → matcher in its start state, never advanced
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._hits = self._misses = 0

    @property
    def mask_words(self) -> int:
        """int32 words per bitmask row: ceil(vocab_size / 32)."""
        return -(-self.vocab_size // 32)

    def cache_info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(self._hits, self._misses, len(self._cache), self._cache_size)

    def compile(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher in its start state (thread-safe; call it off the engine thread:
        a new grammar takes milliseconds, a cached one a deep copy). A grammar llguidance
        rejects is an InvalidRequestError("structured_outputs") with llguidance's reason."""
        key = params.cache_key()
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._hits += 1
                self._cache.move_to_end(key)
                return GrammarMatcher(template.deep_copy())
            self._misses += 1
        template = self._build(params)  # outside the lock: llguidance drops the GIL here
        with self._lock:
            self._cache[key] = template
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return GrammarMatcher(template.deep_copy())

    def _build(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        try:
            if params.json is not None:
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    params.json, defaults=_JSON_DEFAULTS)
            elif params.json_object:
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    {"type": "object"}, defaults=_JSON_DEFAULTS)
            elif params.regex is not None:
                grammar = llguidance.LLMatcher.grammar_from_lark(
                    f"start: /{llguidance.regex_to_lark(params.regex, 'dw')}/")
            elif params.choice is not None:  # JSON string escapes are Lark's too
                grammar = llguidance.LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(jsonlib.dumps(c) for c in params.choice))
            else:
                grammar = llguidance.grammar_from("grammar", params.grammar)  # Lark or GBNF
        except ValueError as err:
            raise InvalidRequestError("structured_outputs", f"invalid {params.kind}: {err}") \
                from None
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=_LIMITS)
        if matcher.is_error():
            raise InvalidRequestError("structured_outputs",
                                      f"invalid {params.kind}: {matcher.get_error().strip()}")
        return matcher


class GrammarMatcher:
    """One request's grammar state. Not thread-safe: one thread (the engine's) drives it."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self._matcher = matcher

    def fill_bitmask(self, row: np.ndarray) -> bool:
        """Write the tokens allowed next into `row` ([mask_words] int32, contiguous). False in
        an error state (the row then allows eos only, llguidance's choice) or when no token
        is allowed."""
        if row.dtype != np.int32 or row.ndim != 1 or not row.flags.c_contiguous:
            raise ValueError("row must be a contiguous 1-D int32 array")
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        return self._ok(row)

    def _ok(self, row: np.ndarray) -> bool:
        return not self._matcher.is_error() and bool(row.any())

    def accept(self, token: int) -> bool:
        """Advance by one sampled token (eos included); False if the grammar rejects it, and
        the matcher then stays in its error state."""
        return self._matcher.consume_token(token)

    @property
    def is_finished(self) -> bool:
        """The grammar is complete (or failed): nothing but eos may follow."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str | None:
        """llguidance's reason, in an error state; else None."""
        return self._matcher.get_error() if self._matcher.is_error() else None


_executor: llguidance.LLExecutor | None = None
_executor_lock = threading.Lock()


def fill_bitmasks(matchers: list[GrammarMatcher | None], out: np.ndarray) -> list[bool]:
    """Fill row i of `out` ([rows >= len(matchers), mask_words] int32, contiguous) from
    matchers[i], all rows at once on llguidance's thread pool (the GIL released); a None
    matcher's row becomes all ones (every token allowed). Per row: `fill_bitmask`'s result
    (True for None)."""
    global _executor
    if out.dtype != np.int32 or out.ndim != 2 or not out.flags.c_contiguous:
        raise ValueError("out must be a contiguous 2-D int32 array")
    jobs = []
    for i, m in enumerate(matchers):
        if m is None:
            out[i] = -1
        else:
            jobs.append((m._matcher, i))
    if jobs:
        with _executor_lock:
            if _executor is None:
                _executor = llguidance.LLExecutor()
        llguidance.numpy.fill_next_token_bitmask_par(_executor, jobs, out)
    return [m is None or m._ok(out[i]) for i, m in enumerate(matchers)]
