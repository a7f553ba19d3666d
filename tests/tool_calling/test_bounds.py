"""What a forced tool choice's grammar lets through (`jaxserve.tool_calling.bounds`), read off
llguidance's own matcher for the shipped model's tokenizer.

References: arguments written by hand at each bound and one step past it; `jsonschema`
confirms that every accepted text is valid under the schema as the client wrote it.
"""

import json
from pathlib import Path

import jsonschema
import pytest

import jaxserve
from jaxserve.loading.tokenizer import Tokenizer
from jaxserve.structured_output import GrammarCompiler
from jaxserve.tool_calling import check_tool_choice

pytestmark = pytest.mark.quick  # seconds, no engine: `pytest -m quick`

MODEL_DIR = Path(jaxserve.__file__).parent / "default_model"
BIG = 2**53 - 1


@pytest.fixture(scope="module")
def grammar():
    tok = Tokenizer(MODEL_DIR)
    compiler = GrammarCompiler(tok, tok.vocab_size, [tok.eos_token_id])

    def accepts(tools, tool_choice, text, parallel=None) -> bool:
        """Whether the reply `text` is one the choice's grammar lets the model write whole."""
        choice = check_tool_choice(tools, tool_choice, parallel)
        matcher = compiler.compile(choice.constraint())
        ids = tok.encode(text, add_special_tokens=False)
        return all(matcher.accept(t) for t in ids) and matcher.accept(tok.eos_token_id)
    return accepts


def named(grammar, properties: dict, arguments: dict) -> bool:
    """Whether `arguments` pass a named choice of a function with these `properties`."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": properties}}}]
    return grammar(tools, {"type": "function", "function": {"name": "f"}},
                   json.dumps(arguments, separators=(",", ":")))


def keys(n: int, width: int = 2) -> dict:
    return {f"{i:0{width}d}": i for i in range(n)}


UNBOUNDED = [  # (a property's schema with no bounds, arguments at the bound, one step past)
    ({"type": "string"}, "a" * 256, "a" * 257),
    ({"type": "integer"}, BIG, BIG + 1),
    ({"type": "integer"}, -BIG, -BIG - 1),
    ({"type": "number"}, 1.000001, 1.0000001),
    ({"type": "array", "items": {"type": "integer"}}, list(range(16)), list(range(17))),
    ({"type": "object"}, keys(16), keys(17)),
    ({"type": "object"}, {"k" * 64: 1}, {"k" * 65: 1}),
    ({}, [1, "x", None], [[1]]),  # any value: flat, not nested
    ({"type": "array"}, [[1], {"k": None}], [[[1]]]),  # items of any value
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, {"a": 1}, {"a": 1, "b": 2}),
]


@pytest.mark.parametrize("schema, inside, past", UNBOUNDED, ids=str)
def test_what_the_schema_leaves_open_is_bounded(grammar, schema, inside, past):
    jsonschema.validate({"v": inside}, {"properties": {"v": schema}})
    assert named(grammar, {"v": schema}, {"v": inside})
    assert not named(grammar, {"v": schema}, {"v": past})


EXPLICIT = [  # (a schema with the client's own bounds, arguments they allow past the defaults)
    ({"type": "string", "maxLength": 1000}, "a" * 1000),
    ({"type": "string", "minLength": 300}, "a" * 300),
    ({"type": "integer", "minimum": 10**17}, 10**17 + 5),  # llguidance: 64-bit at most
    ({"type": "integer", "maximum": -10**17}, -10**17 - 5),
    ({"type": "number", "maximum": 10**18}, 10**17),
    ({"type": "number", "multipleOf": 2**-7}, 3 * 2**-7),  # 7 decimals: 0.0234375
    ({"type": "array", "items": {"type": "integer"}, "minItems": 20}, list(range(20))),
    ({"type": "array", "items": {"type": "integer"}, "maxItems": 40}, list(range(40))),
    ({"type": "object", "maxProperties": 30}, keys(30)),
    ({"type": "object", "additionalProperties": {"type": "string", "maxLength": 400}},
     {"k": "a" * 400}),
]


@pytest.mark.parametrize("schema, arguments", EXPLICIT, ids=str)
def test_the_clients_own_bounds_win(grammar, schema, arguments):
    jsonschema.validate({"v": arguments}, {"properties": {"v": schema}})
    assert named(grammar, {"v": schema}, {"v": arguments})


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer", "maximum": 9}}}}}]
ONE = '[{"name":"f","parameters":{"x":1}}]'
TWO = '[{"name":"f","parameters":{"x":1}},{"name":"f","parameters":{"x":2}}]'


@pytest.mark.parametrize("parallel, several", [(None, False), (False, False), (True, True)])
def test_required_allows_several_calls_only_when_asked(grammar, parallel, several):
    assert grammar(TOOLS, "required", ONE, parallel)
    assert grammar(TOOLS, "required", TWO, parallel) == several
