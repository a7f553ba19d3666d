"""`RequestLimits`: each cap admits a request exactly at it and refuses one past it, naming
the field; the bounds are counted by hand here (characters of a stop string, bytes of
compact JSON), not by the code under test. Over HTTP: tests/server/test_structured_and_echo.py
and tests/server/test_tool_calling_server.py."""

import pytest

from jaxserve.errors import InvalidRequestError
from jaxserve.server.limits import RequestLimits
from jaxserve.server.protocol import ChatCompletionRequest, CompletionRequest

pytestmark = pytest.mark.quick
LIMITS = RequestLimits(max_stop_strings=3, max_stop_string_chars=4, max_tools=2,
                       max_schema_bytes=20)
TOOL = {"type": "function", "function": {"name": "f"}}  # {"type":"function",...}: 43 bytes


def completion(**fields) -> CompletionRequest:
    return CompletionRequest(prompt="x", **fields)


def refused_field(body) -> str:
    with pytest.raises(InvalidRequestError) as caught:
        LIMITS.check(body)
    return caught.value.field


def test_stop_strings_are_capped_in_count_and_length():
    LIMITS.check(completion(stop=["a", "b", "cdef"]))  # 3 strings, the longest 4 characters
    LIMITS.check(completion(stop="éééé"))  # characters, not bytes (8 in UTF-8)
    assert refused_field(completion(stop=["a", "b", "c", "d"])) == "stop"
    assert refused_field(completion(stop="abcde")) == "stop"
    assert refused_field(completion(stop=["a", "abcde"])) == "stop"


def test_tools_are_capped_in_count_and_size():
    limits = RequestLimits(max_tools=2, max_schema_bytes=43)
    messages = [{"role": "user", "content": "hi"}]
    limits.check(ChatCompletionRequest(messages=messages, tools=[TOOL, TOOL]))
    with pytest.raises(InvalidRequestError) as caught:
        limits.check(ChatCompletionRequest(messages=messages, tools=[TOOL] * 3))
    assert caught.value.field == "tools"
    bigger = {"type": "function", "function": {"name": "fg"}}  # 44 bytes
    with pytest.raises(InvalidRequestError) as caught:
        limits.check(ChatCompletionRequest(messages=messages, tools=[TOOL, bigger]))
    assert caught.value.field == "tools.1"


@pytest.mark.parametrize("field, fits, too_big", [
    ("guided_regex", "a" * 20, "a" * 21),
    ("guided_grammar", 'start: "é" "abcdef"', 'start: "é" "abcdefg"'),  # é: 2 bytes
    ("guided_choice", ["abcdefghijk", "lm"], ["abcdefghijk", "lmn"]),  # 20 bytes compact
    ("guided_json", {"type": "string123"}, {"type": "string1234"}),  # 20 bytes compact
])
def test_output_constraints_are_capped_in_bytes(field, fits, too_big):
    LIMITS.check(completion(**{field: fits}))
    assert refused_field(completion(**{field: too_big})) == field


def test_the_caps_must_be_positive_integers():
    with pytest.raises(ValueError, match="max_tools"):
        RequestLimits(max_tools=0)
    with pytest.raises(ValueError, match="max_schema_bytes"):
        RequestLimits(max_schema_bytes=1.5)
