"""Structured output through the engine, on the shipped model (which never saw JSON).

Independent checks: every output parses and validates with `jsonschema`, matches the regex
with Python's `re`, or is exactly one of the choices; free requests batched beside
constrained ones give the tokens they give alone (their rows are not masked); nothing
compiles after warm-up; a grammar that reaches a dead end ends its request with
finish_reason "grammar_dead_end" and frees its pages (the dead end is injected through the
sequence's grammar, the engine's seam).
"""

import json
import re

import jsonschema
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.sequence import GRAMMAR_DEAD_END
from jaxserve.structured_output import GrammarMatcher

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "mood": {"enum": ["happy", "sad", "calm"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                  "maxItems": 3}},
          "required": ["name", "age", "mood", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm():
    """One rung per ladder (a step program and a decode loop): masks are per row, so the
    buckets' sizes do not matter here, and the cpu preset's 12 programs took a minute."""
    return LLM("jaxserve/default_model", progress=False, strict_compile=True, max_num_seqs=8,
               max_num_batched_tokens=64, token_buckets=(64,), seq_buckets=(8,))


def constrained(seed: int, max_tokens: int = 96, **structured) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                          structured_outputs=structured)


def test_json_schema_outputs_validate(llm):
    outs = llm.generate(["Once upon a time"] * 10,
                        [constrained(seed, json=SCHEMA) for seed in range(10)])
    texts = [o.outputs[0].text for o in outs]
    for text, out in zip(texts, outs):
        jsonschema.validate(json.loads(text), SCHEMA)
        assert out.outputs[0].finish_reason == "stop"
    assert len(set(texts)) > 1  # sampled, not one forced string


def test_choice_and_regex(llm):
    choices = ["sunny", "a rainy day", "snow (again)"]
    outs = llm.generate(["The weather was"] * 6, [constrained(s, choice=choices)
                                                  for s in range(6)])
    assert all(o.outputs[0].text in choices for o in outs)
    date = r"\d{4}-\d{2}-\d{2}"
    outs = llm.generate(["The letter was dated"] * 4, [constrained(s, regex=date)
                                                       for s in range(4)])
    assert all(re.fullmatch(date, o.outputs[0].text, re.ASCII) for o in outs)


def test_mixed_batch_leaves_free_rows_alone_and_never_compiles(llm):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["It is a truth", "She said that"]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    mixed = llm.generate(prompts + ["Once upon a time", "Dear sir"],
                         [greedy, greedy, constrained(1, json=SCHEMA),
                          constrained(2, choice=["yes", "no"])])
    assert [o.outputs[0].token_ids for o in mixed[:2]] == alone
    jsonschema.validate(json.loads(mixed[2].outputs[0].text), SCHEMA)
    assert mixed[3].outputs[0].text in ("yes", "no")
    assert llm.engine.stats().compiles_after_warmup == 0


class DeadEndAfter(GrammarMatcher):
    """A grammar matcher that allows no token once `limit` tokens were accepted (what the
    engine sees of a grammar at a dead end: an empty bitmask)."""

    def __init__(self, matcher: GrammarMatcher, limit: int):
        super().__init__(matcher._matcher)
        self.limit, self.accepted = limit, 0

    def accept(self, token: int) -> bool:
        self.accepted += 1
        return super().accept(token)

    def _ok(self, row) -> bool:
        return super()._ok(row) and self.accepted < self.limit


def test_grammar_dead_end_finishes_the_request_and_frees_its_pages(llm):
    engine = llm.engine
    seq = engine.make_sequence("dead-end", llm.tokenizer.encode("Once upon a time"),
                               constrained(0, json=SCHEMA))
    seq.grammar.matcher = DeadEndAfter(seq.grammar.matcher, 3)
    engine.enqueue(seq)
    while engine.has_unfinished():
        engine.step()
    out = engine.pop_output(seq).outputs[0]
    assert out.finish_reason == GRAMMAR_DEAD_END and len(out.token_ids) == 3
    assert engine.stats().num_running == 0 and engine.replicas[0].allocator.usage == 0


@pytest.mark.parametrize("structured, field", [
    ({"json": SCHEMA, "regex": "a"}, "structured_outputs"),
    ({"choice": []}, "structured_outputs"),
    ({"grammar": "start: (((", }, "structured_outputs"),
    ({"colour": "red"}, "structured_outputs"),
])
def test_bad_constraints_name_the_field(llm, structured, field):
    with pytest.raises(ValueError) as info:
        llm.generate(["x"], SamplingParams(structured_outputs=structured))
    assert info.value.field == field
