"""Tool-call and reasoning parsers, fuzzed with hypothesis (`jaxserve.tool_calling`).

References: the calls, content and reasoning each test writes into the text itself (the
parser must find exactly them), and the whole text parsed at once for every split of it
into streamed pieces (a reply streamed token by token must give the same result).
"""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxserve.tool_calling import ChatParsing
from jaxserve.tool_calling.bounds import bounded
from jaxserve.tool_calling.events import ArgumentsPiece, CallStart, Content, Reasoning, merged
from jaxserve.tool_calling.reasoning import REASONING_PARSERS
from jaxserve.tool_calling.tool_choice import ConstrainedCalls, check_tool_choice
from jaxserve.tool_calling.tool_parsers import TOOL_PARSERS

pytestmark = pytest.mark.quick  # seconds, no engine: `pytest -m quick`

NAMES = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)
SCALARS = (st.none() | st.booleans() | st.integers(-10**6, 10**6)
           | st.floats(allow_nan=False, allow_infinity=False, width=32)
           | st.text(max_size=8))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)
ARGUMENTS = st.dictionaries(st.text(max_size=6), VALUES, max_size=4)
CALLS = st.lists(st.tuples(NAMES, ARGUMENTS), min_size=1, max_size=3)
# Plain text around calls: no marker can form in it.
PROSE = st.text(st.sampled_from("abc xyz.,!?\n<>/:;'é日"), max_size=20).filter(
    lambda t: "<tool_call>" not in t and "<think>" not in t)
# Text built from the markers' pieces, to break the parsers.
NOISE = st.lists(st.sampled_from(
    ["<tool_call>", "</tool_call>", "<tool", "_call>", "{", "}", '"name"', ":", ",", '"f"',
     '"arguments"', '"parameters"', "[TOOL_CALLS]", "[ARGS]", "<function=f>",
     "<parameter=a>", "</parameter>", "</function>", "a", " ", "\n", '"', "1", "[", "]", ";",
     "<|python_tag|>", "<think>", "</think>", "\\"]), max_size=30).map("".join)


def streamed(parser, text: str, cuts: list[int]):
    """Events of `text` fed in the pieces that `cuts` (positions) make, then finished."""
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    events = []
    for start, end in zip(bounds, bounds[1:]):
        events += parser.feed(text[start:end])
    return merged(events + parser.finish())


def calls_of(events) -> list[tuple[str, dict]]:
    """(name, arguments) of each call; each call's arguments must be a JSON object."""
    names = {e.index: e.name for e in events if isinstance(e, CallStart)}
    arguments = {}
    for event in events:
        if isinstance(event, ArgumentsPiece):
            arguments[event.index] = arguments.get(event.index, "") + event.text
    decoded = {i: json.loads(text) for i, text in arguments.items()}
    assert all(isinstance(v, dict) for v in decoded.values())
    assert sorted(names) == sorted(decoded) == list(range(len(names)))
    return [(names[i], decoded[i]) for i in range(len(names))]


def content_of(events) -> str:
    return "".join(e.text for e in events if isinstance(e, Content))


def hermes_text(calls):
    return "".join(f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>\n'
                   for n, a in calls)


def llama3_text(calls):
    return "<|python_tag|>" + "; ".join(json.dumps({"name": n, "parameters": a})
                                        for n, a in calls)


def mistral_text(calls):
    listed = json.dumps([{"name": n, "arguments": a} for n, a in calls])
    return "[TOOL_CALLS]" + listed


def mistral_v11_text(calls):
    return "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls)


FORMATS = {"hermes": ("hermes", hermes_text, True), "llama3_json": ("llama3_json", llama3_text,
                                                                     False),
           "mistral": ("mistral", mistral_text, True),
           "mistral_v11": ("mistral", mistral_v11_text, True)}


@pytest.mark.parametrize("form", sorted(FORMATS))
@settings(max_examples=150, deadline=None)
@given(calls=CALLS, before=PROSE, cuts=st.lists(st.integers(0, 10**4), max_size=12))
def test_any_split_of_valid_calls_gives_the_written_calls(form, calls, before, cuts):
    parser_name, write, has_content = FORMATS[form]
    before = before.lstrip() if has_content else ""
    if form.startswith("mistral"):
        before = before.replace("[TOOL_CALLS]", "")
    text = before + write(calls)
    whole = merged(TOOL_PARSERS[parser_name]().parse(text))
    assert streamed(TOOL_PARSERS[parser_name](), text, cuts) == whole
    assert calls_of(whole) == calls
    assert content_of(whole) == before


@settings(max_examples=150, deadline=None)
@given(calls=st.lists(st.tuples(NAMES, st.dictionaries(
    NAMES, st.one_of(st.integers(-99, 99), st.booleans(),
                     st.text(st.sampled_from("ab c\n{}"), max_size=6)), max_size=3)),
    min_size=1, max_size=3, unique_by=lambda call: call[0]),
    after=PROSE, cuts=st.lists(st.integers(0, 10**4), max_size=12))
def test_qwen3_coder_types_parameters_by_the_tool_schema(calls, after, cuts):
    """String parameters stay text (braces and newlines included); integers and booleans
    are read as JSON, because the tool's schema says so."""
    tools = []
    for name, arguments in calls:
        properties = {k: {"type": "string" if isinstance(v, str) else
                          "boolean" if isinstance(v, bool) else "integer"}
                      for k, v in arguments.items()}
        tools.append({"type": "function", "function": {
            "name": name, "parameters": {"type": "object", "properties": properties}}})
    blocks = []
    for name, arguments in calls:
        params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n"
                         "</parameter>\n" for k, v in arguments.items())
        blocks.append(f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>")
    text = "\n".join(blocks) + after
    whole = merged(TOOL_PARSERS["qwen3_coder"](tools).parse(text))
    assert streamed(TOOL_PARSERS["qwen3_coder"](tools), text, cuts) == whole
    assert calls_of(whole) == calls
    assert content_of(whole) == after.lstrip()


@pytest.mark.parametrize("parser_name", sorted(TOOL_PARSERS))
@settings(max_examples=300, deadline=None)
@given(text=NOISE, cuts=st.lists(st.integers(0, 10**4), max_size=12))
def test_arbitrary_text_never_raises_nor_yields_bad_arguments(parser_name, text, cuts):
    whole = merged(TOOL_PARSERS[parser_name]().parse(text))
    assert streamed(TOOL_PARSERS[parser_name](), text, cuts) == whole
    calls_of(whole)  # every call's arguments are a JSON object, every name whole


def test_content_that_only_looks_like_a_call_stays_content():
    text = 'a <tool_call>{"name": "f", "arguments": [1]}</tool_call> <tool_call>{"nam'
    assert merged(TOOL_PARSERS["hermes"]().parse(text)) == [Content(text)]
    assert merged(TOOL_PARSERS["llama3_json"]().parse("Hello {}")) == [Content("Hello {}")]


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@settings(max_examples=200, deadline=None)
@given(reasoning=PROSE.filter(lambda t: "</think>" not in t and t.strip()),
       answer=PROSE.filter(lambda t: not t.startswith("\n")), opened=st.booleans(),
       cuts=st.lists(st.integers(0, 10**4), max_size=12))
def test_reasoning_split_streamed_or_whole(name, reasoning, answer, opened, cuts):
    """`</think>` (and `<think>`) may arrive in any pieces; deepseek_r1's reply starts in
    the reasoning (the template opened it), qwen3's only when it opens <think>."""
    reasoning = reasoning.lstrip()
    text = ("<think>" if opened else "") + reasoning + "</think>\n\n" + answer
    whole = merged(REASONING_PARSERS[name]().parse(text))
    assert streamed(REASONING_PARSERS[name](), text, cuts) == whole
    if opened or name == "deepseek_r1":
        assert whole == merged([Reasoning(reasoning), Content(answer)])
    else:
        assert whole == [Content(text)]


def test_deepseek_r1_reply_cut_while_thinking_is_all_reasoning():
    assert REASONING_PARSERS["deepseek_r1"]().parse("still thinking") == [
        Reasoning("still thinking")]


TOOLS = [{"type": "function", "function": {"name": n, "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}}}} for n in ("f", "g")]


@settings(max_examples=150, deadline=None)
@given(calls=st.lists(st.tuples(st.sampled_from(["f", "g"]), ARGUMENTS), min_size=1,
                      max_size=3), cuts=st.lists(st.integers(0, 10**4), max_size=12))
def test_required_choice_streams_names_whole_and_arguments_in_pieces(calls, cuts):
    """The constrained reply of tool_choice "required", compact as llguidance writes it:
    each call's arguments are exactly the JSON text the model wrote."""
    choice = check_tool_choice(TOOLS, "required", None)
    text = json.dumps([{"name": n, "parameters": a} for n, a in calls], separators=(",", ":"))
    events = streamed(ConstrainedCalls(choice), text, cuts)
    assert calls_of(events) == calls
    pieces = [e.text for e in events if isinstance(e, ArgumentsPiece)]
    assert pieces == [json.dumps(a, separators=(",", ":")) for _, a in calls]


def test_named_choice_streams_the_reply_as_arguments():
    choice = check_tool_choice(TOOLS, {"type": "function", "function": {"name": "g"}}, None)
    parser = ConstrainedCalls(choice)
    events = parser.feed('{"x"') + parser.feed(":1}") + parser.finish()
    assert events == [CallStart(0, "g"), ArgumentsPiece(0, '{"x"'), ArgumentsPiece(0, ":1}")]
    assert choice.constraint().json == bounded(TOOLS[1]["function"]["parameters"])


def test_required_schema_is_a_json_schema_of_the_calls():
    jsonschema = pytest.importorskip("jsonschema")
    schema = check_tool_choice(TOOLS, "required", False).constraint().json
    jsonschema.Draft202012Validator.check_schema(schema)
    valid = [{"name": "g", "parameters": {"x": 1}}]
    jsonschema.validate(valid, schema)
    for bad in ([], valid * 2, [{"name": "h", "parameters": {}}],
                [{"name": "f", "parameters": {"x": "one"}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


@pytest.mark.parametrize("tools, choice, field", [
    (TOOLS, {"type": "function", "function": {"name": "h"}}, "tool_choice.function.name"),
    (TOOLS, "sometimes", "tool_choice"),
    (TOOLS, {"type": "function"}, "tool_choice"),
    (None, "required", "tool_choice"),
    ([], None, "tools"),
    ([{"type": "retrieval"}], None, "tools.0.type"),
    ([{"type": "function", "function": {"name": "has space"}}], None, "tools.0.function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], None,
     "tools.0.function.parameters.type"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], None,
     "tools.0.function.parameters"),
])
def test_bad_tools_and_choices_name_the_field(tools, choice, field):
    with pytest.raises(ValueError) as err:
        check_tool_choice(tools, choice, None)
    assert err.value.field == field


def test_auto_needs_a_parser_and_a_template_that_writes_its_format():
    choice = check_tool_choice(TOOLS, None, None)
    assert choice.mode == "auto"
    with pytest.raises(ValueError, match="--enable-auto-tool-choice") as err:
        ChatParsing().check(choice, "<tool_call>")
    assert err.value.field == "tool_choice"
    hermes = ChatParsing("hermes", True)
    with pytest.raises(ValueError, match="never writes hermes") as err:
        hermes.check(choice, "{{ messages }}")
    assert err.value.field == "tool_choice"
    hermes.check(choice, "... <tool_call> ...")
    hermes.check(check_tool_choice(TOOLS, "required", None), "{{ messages }}")
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ChatParsing(None, True)
