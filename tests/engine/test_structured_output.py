"""Structured output's grammar layer, against the shipped model's tokenizer.

The references are independent of llguidance: matchers are walked by hand (take the allowed
set from the bitmask, decoded with numpy shifts; pick a token; accept it) and the decoded text
is checked with Python's `re`, `jsonschema` and `json`.
"""

import json
import re
import threading
from pathlib import Path

import jsonschema
import numpy as np
import pytest

import jaxserve
from jaxserve.errors import InvalidRequestError
from jaxserve.loading.tokenizer import Tokenizer
from jaxserve.structured_output import (
    GrammarCompiler,
    StructuredOutputsParams,
    fill_bitmasks,
)

MODEL_DIR = Path(jaxserve.__file__).parent / "default_model"
VOCAB = json.loads((MODEL_DIR / "config.json").read_text())["vocab_size"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(MODEL_DIR)


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, VOCAB, [tok.eos_token_id])


def allowed(row):
    """Token ids whose bit is set: bit j of word i is token 32 i + j."""
    bits = (row[:, None] >> np.arange(32, dtype=np.int32)) & 1  # [words, 32]
    return np.flatnonzero(bits.ravel())


def walk(matcher, compiler, pick, max_steps=400):
    """Drive `matcher` to the end: `pick(step, allowed_ids)` chooses each token. Returns the
    tokens before eos; checks that a complete grammar allows eos only."""
    eos = set(compiler.eos_token_ids)
    row = np.zeros(compiler.mask_words, np.int32)
    out = []
    for step in range(max_steps):
        assert matcher.fill_bitmask(row), matcher.error
        ids = allowed(row)
        assert ids.max() < VOCAB
        if matcher.is_finished:
            assert set(ids.tolist()) == eos  # complete: only eos
            return out
        token = int(pick(step, ids))
        assert matcher.accept(token), matcher.error
        if token in eos:
            assert matcher.is_finished
            return out
        out.append(token)
    raise AssertionError(f"no end after {max_steps} tokens")


def rand_pick(seed):
    rng = np.random.default_rng(seed)
    return lambda step, ids: rng.choice(ids)


def test_regex_walks_fullmatch(tok, compiler):
    pattern = r"\d{4}-\d{2}-\d{2}"
    params = StructuredOutputsParams(regex=pattern)
    text = tok.decode(walk(compiler.compile(params), compiler, lambda s, ids: ids[0]))
    assert text == "0000-00-00"  # the lowest id each step: "0" and "-" are single bytes
    for seed in range(5):
        text = tok.decode(walk(compiler.compile(params), compiler, rand_pick(seed)))
        assert re.fullmatch(pattern, text, re.ASCII), text


def test_json_schema_walks_validate(tok, compiler):
    for seed in range(5):
        text = tok.decode(walk(compiler.compile(StructuredOutputsParams(json=SCHEMA)),
                               compiler, rand_pick(seed)))
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_is_compact(tok, compiler):
    m = compiler.compile(StructuredOutputsParams(json_object=True))
    for token in tok.encode('{"a":', add_special_tokens=False):
        assert m.accept(token)
    row = np.zeros(compiler.mask_words, np.int32)
    m.fill_bitmask(row)
    texts = [tok.decode([i]) for i in allowed(row)]
    assert not [t for t in texts if t[:1].isspace()]
    assert not compiler.compile(StructuredOutputsParams(json_object=True)).accept(
        tok.encode(" ", add_special_tokens=False)[0])


def test_json_object_walks_parse_as_dicts(tok, compiler):
    texts = [tok.decode([i]) for i in range(VOCAB)]

    def pick_closing(rng):
        def pick(step, ids):  # random for 20 tokens, then close strings and containers
            if step >= 20:
                for good in (lambda t: t in ('"', "}", "]"), lambda t: set(t) & set('"}]')):
                    ok = [i for i in ids if good(texts[i])]
                    if ok:
                        return rng.choice(ok)
            return rng.choice(ids)
        return pick

    for seed in range(5):
        m = compiler.compile(StructuredOutputsParams(json_object=True))
        out = tok.decode(walk(m, compiler, pick_closing(np.random.default_rng(seed))))
        assert isinstance(json.loads(out), dict), out


def test_choice_walks_give_one_choice(tok, compiler):
    choices = ["a+b", 'say "hi"', "a|b", "(x)*", "back\\slash", "yes", "yes!", "é"]
    params = StructuredOutputsParams(choice=choices)
    seen = set()
    for seed in range(30):
        seen.add(tok.decode(walk(compiler.compile(params), compiler, rand_pick(seed))))
    assert seen <= set(choices) and len(seen) > 3
    for choice in choices:  # each is reachable, and complete at its end
        m = compiler.compile(params)
        assert all(m.accept(t) for t in tok.encode(choice, add_special_tokens=False))
        row = np.zeros(compiler.mask_words, np.int32)
        m.fill_bitmask(row)
        assert tok.eos_token_id in allowed(row)
    assert not compiler.compile(params).accept(tok.encode("no", add_special_tokens=False)[0])


def test_forbidden_token_is_rejected(tok, compiler):
    m = compiler.compile(StructuredOutputsParams(regex=r"\d+"))
    row = np.zeros(compiler.mask_words, np.int32)
    assert m.fill_bitmask(row) and m.error is None
    x = tok.encode("x", add_special_tokens=False)[0]
    assert x not in allowed(row)
    assert tok.eos_token_id not in allowed(row)  # nothing matched yet: no eos
    assert not m.accept(x)
    assert m.error and m.is_finished
    assert not m.fill_bitmask(row)


def test_eos_follows_acceptance(tok, compiler):
    m = compiler.compile(StructuredOutputsParams(regex=r"\d+"))
    row = np.zeros(compiler.mask_words, np.int32)
    assert m.accept(tok.encode("7", add_special_tokens=False)[0])
    m.fill_bitmask(row)
    ids = set(allowed(row).tolist())
    assert tok.eos_token_id in ids and len(ids) > 1 and not m.is_finished
    m = compiler.compile(StructuredOutputsParams(regex="ab"))
    assert all(m.accept(t) for t in tok.encode("ab", add_special_tokens=False))
    assert m.is_finished and m.fill_bitmask(row)
    assert allowed(row).tolist() == [tok.eos_token_id]


def test_padded_vocab_and_extra_eos_ids(tok):
    vocab = tok.vocab_size + 100  # not a multiple of 32: the last word is part padding
    comp = GrammarCompiler(MODEL_DIR, vocab, [tok.eos_token_id, 2, tok.vocab_size + 5])
    assert comp.mask_words == -(-vocab // 32) and comp.eos_token_ids == [tok.eos_token_id, 2]
    m = comp.compile(StructuredOutputsParams(regex=r"(.|\n)*"))
    row = np.zeros(comp.mask_words, np.int32)
    rng = np.random.default_rng(0)
    for _ in range(10):
        assert m.fill_bitmask(row)
        ids = allowed(row)
        assert ids.max() < tok.vocab_size and len(ids) > 1000
        assert m.accept(int(rng.choice(ids[ids > 2])))
    m = comp.compile(StructuredOutputsParams(regex="ab"))
    assert all(m.accept(t) for t in tok.encode("ab", add_special_tokens=False))
    m.fill_bitmask(row)
    assert allowed(row).tolist() == [tok.eos_token_id, 2]
    with pytest.raises(ValueError, match="smaller"):
        GrammarCompiler(tok, tok.vocab_size - 1, [tok.eos_token_id])


def test_fill_bitmasks_matches_single_rows(tok, compiler):
    params = [StructuredOutputsParams(json=SCHEMA), None,
              StructuredOutputsParams(regex=r"\d+"), StructuredOutputsParams(choice=["ab", "c"])]
    prefix = {0: '{"name":"x', 2: "12", 3: "a"}
    batch, single = [], []  # matchers in equal states, for fill_bitmasks and fill_bitmask
    for i, p in enumerate(params):
        for group in (batch, single):
            m = None if p is None else compiler.compile(p)
            if m is not None:
                assert all(m.accept(t) for t in tok.encode(prefix[i], add_special_tokens=False))
            group.append(m)
    out = np.zeros((len(params) + 1, compiler.mask_words), np.int32)  # [rows, mask_words]
    assert fill_bitmasks(batch, out) == [True] * len(params)
    assert (out[1] == -1).all()
    for i, m in enumerate(single):
        if m is not None:
            row = np.zeros(compiler.mask_words, np.int32)
            m.fill_bitmask(row)
            np.testing.assert_array_equal(out[i], row)
    batch[2].accept(tok.encode("x", add_special_tokens=False)[0])  # an error state
    assert fill_bitmasks(batch, out) == [True, True, False, True]


def test_cache_serves_independent_matchers(tok):
    comp = GrammarCompiler(tok, VOCAB, [tok.eos_token_id], cache_size=2)
    a = comp.compile(StructuredOutputsParams(json=json.dumps(SCHEMA)))
    b = comp.compile(StructuredOutputsParams(json=dict(reversed(SCHEMA.items()))))
    assert comp.cache_info()[:3] == (1, 1, 1)  # the same schema, as text or reordered
    row_a, row_b = (np.zeros(comp.mask_words, np.int32) for _ in range(2))
    assert a.accept(tok.encode("{", add_special_tokens=False)[0])
    a.fill_bitmask(row_a)
    b.fill_bitmask(row_b)
    assert allowed(row_b).tolist() == tok.encode("{", add_special_tokens=False)  # b at start
    assert not np.array_equal(row_a, row_b)
    regex_a, regex_b = StructuredOutputsParams(regex="a"), StructuredOutputsParams(regex="b")
    comp.compile(regex_a)
    comp.compile(StructuredOutputsParams(json=SCHEMA))  # a hit: now the most recent
    comp.compile(regex_b)  # evicts regex_a, the least recently used
    comp.compile(StructuredOutputsParams(json=SCHEMA))
    assert comp.cache_info() == (3, 3, 2, 2)
    comp.compile(regex_a)
    assert comp.cache_info() == (3, 4, 2, 2)


def test_compile_from_threads(tok):
    comp = GrammarCompiler(tok, VOCAB, [tok.eos_token_id])
    specs = [StructuredOutputsParams(regex=f"{i % 4}+") for i in range(32)]
    results = [None] * len(specs)

    def run(i):
        m = comp.compile(specs[i])
        results[i] = m.accept(tok.encode(str(i % 4), add_special_tokens=False)[0])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(specs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    info = comp.cache_info()
    assert all(results) and info.hits + info.misses == 32 and info.size == 4


def test_grammars_lark_and_gbnf(tok, compiler):
    for grammar in ('root ::= "yes" | "no"', 'start: "yes" | "no"'):
        for seed in range(3):
            m = compiler.compile(StructuredOutputsParams(grammar=grammar))
            assert tok.decode(walk(m, compiler, rand_pick(seed))) in ("yes", "no")


@pytest.mark.parametrize("spec, message", [
    ({"regex": "a("}, "unclosed group"),
    ({"grammar": "start: foo"}, "foo"),
    ({"grammar": "root ::= ("}, "GBNF"),
    ({"json": {"type": "foo"}}, "foo"),
    ({"json": {"type": "string", "format": "no-such-format"}}, "no-such-format"),
])
def test_compile_rejects_bad_grammars(compiler, spec, message):
    with pytest.raises(InvalidRequestError, match=message) as err:
        compiler.compile(StructuredOutputsParams(**spec))
    assert err.value.field == "structured_outputs"


@pytest.mark.parametrize("kwargs", [
    {}, {"regex": "a", "choice": ["b"]}, {"json_object": True, "json": {}}, {"choice": []},
    {"choice": ["a", 1]}, {"choice": "ab"}, {"regex": ""}, {"regex": 3}, {"json": "[1]"},
    {"json": "{bad"}, {"json": 3}, {"json_object": "yes"},
])
def test_params_reject_bad_shapes(kwargs):
    with pytest.raises(InvalidRequestError) as err:
        StructuredOutputsParams(**kwargs)
    assert err.value.field == "structured_outputs"


def test_params_normalize_and_key():
    a = StructuredOutputsParams(json='{"type": "object", "properties": {}}')
    b = StructuredOutputsParams(json={"properties": {}, "type": "object"})
    assert a.json == b.json and a.cache_key() == b.cache_key()
    assert StructuredOutputsParams(regex="a").cache_key() != \
        StructuredOutputsParams(grammar="a").cache_key()
    assert StructuredOutputsParams(choice=("a", "b")).choice == ["a", "b"]


def test_from_request_maps_fields():
    f = StructuredOutputsParams.from_request
    assert f() is None and f(response_format={"type": "text"}) is None
    assert f(response_format={"type": "json_object"}).json_object
    schema = {"type": "object"}
    assert f(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema, "strict": True}}).json == schema
    assert f(structured_outputs={"json": json.dumps(schema)}).json == schema
    assert f(structured_outputs={"regex": "a+", "json": None, "json_object": False}).regex == "a+"
    assert f(structured_outputs={"json_object": True}).json_object
    assert f(guided_json=schema).json == schema
    assert f(guided_regex="a").regex == "a"
    assert f(guided_choice=["a", "b"]).choice == ["a", "b"]
    assert f(guided_grammar="start: /a/").grammar == "start: /a/"
    assert f(response_format={"type": "text"}, guided_regex="a").regex == "a"


@pytest.mark.parametrize("kwargs, field", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "structured_outputs"),
    ({"guided_json": {}, "guided_regex": "a"}, "guided_json"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "[1]"}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": ["a"]}, "structured_outputs"),
    ({"guided_regex": 5}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "not json"}, "guided_json"),
    ({"guided_grammar": ""}, "guided_grammar"),
])
def test_from_request_names_bad_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as err:
        StructuredOutputsParams.from_request(**kwargs)
    assert err.value.field == field
