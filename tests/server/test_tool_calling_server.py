"""Tool calling and reasoning over HTTP with the `openai` client, on the shipped model's
weights with a chat template that writes hermes calls (`TOOLS_CHAT_TEMPLATE`: the shipped
template has no tools), served with `--enable-auto-tool-choice --tool-call-parser hermes
--reasoning-parser qwen3` (`jaxserve.tool_calling`).

References: `jsonschema` for the arguments of required and named choices (the shipped model
knows nothing of tools: only the grammar makes them valid); for "auto", the tool-call text
a `structured_outputs.regex` forces the model to write, which the parser must read back;
the unstreamed reply for the streamed one.
"""

import json
import re
import shutil
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from jaxserve.server.state import ServerOptions
from jaxserve.tool_calling import ChatParsing
from server_helpers import serving
from tiny_models import TOOLS_CHAT_TEMPLATE

MODEL = Path(__file__).resolve().parents[2] / "jaxserve" / "default_model"
NAME = "austen"
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 12},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
LETTER = {"type": "object",
          "properties": {"to": {"enum": ["Emma", "Anne"]}, "urgent": {"type": "boolean"}},
          "required": ["to", "urgent"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "send_letter", "parameters": LETTER}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Bath?"}]
MAX_TOKENS = 380  # all the shipped model's 512 positions leave past the prompt
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("austen_tools")
    for path in MODEL.iterdir():
        if path.is_file():
            shutil.copy(path, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    # tools by name only: their JSON would fill most of the shipped model's 512 positions
    config["chat_template"] = TOOLS_CHAT_TEMPLATE.replace("{{ tool | tojson }}",
                                                          "{{ tool.function.name }}")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def server(folder):
    options = ServerOptions(model=str(folder), served_model_name=[NAME],
                            engine_options={"strict_compile": True},
                            chat_parsing=ChatParsing("hermes", True, "qwen3"))
    with serving(options) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


def assert_valid_calls(message, names=None):
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def reassembled(chunks) -> dict:
    """The message and finish reason that a stream's deltas add up to."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for piece in delta.tool_calls or ():
                call = calls.setdefault(piece.index, {"name": "", "arguments": ""})
                if piece.function.name:
                    assert not call["name"], "a call's name comes whole, once"
                    call["name"] = piece.function.name
                call["arguments"] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return {"content": content or None, "reasoning": reasoning or None, "finish": finish,
            "calls": [calls[i] for i in sorted(calls)]}


def whole(response) -> dict:
    choice = response.choices[0]
    message = choice.message
    return {"content": message.content or None,
            "reasoning": getattr(message, "reasoning_content", None),
            "finish": choice.finish_reason,
            "calls": [{"name": c.function.name, "arguments": c.function.arguments}
                      for c in message.tool_calls or ()]}


@pytest.mark.parametrize("parallel", [False, None, True])
def test_required_choice_gives_valid_calls_streamed_or_not(client, parallel):
    """One call (parallel_tool_calls false or omitted), or as many as the model lists when
    true: the shipped model, greedy, lists calls until max_tokens cuts the last one
    (finish_reason "length", as OpenAI reports a cut reply); every whole call is valid."""
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    kwargs = dict(model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                  max_tokens=100, temperature=0, **extra)
    response = client.chat.completions.create(**kwargs)
    stream = list(client.chat.completions.create(stream=True, **kwargs))
    assert reassembled(stream) == whole(response)
    choice = response.choices[0]
    if not parallel:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    else:
        assert choice.finish_reason == "length" and len(choice.message.tool_calls) > 1
        choice.message.tool_calls.pop()
    assert_valid_calls(choice.message)
    assert sum(1 for c in stream for d in c.choices for _ in d.delta.tool_calls or ()) > 2


def test_named_choice_calls_that_function(client):
    choice = {"type": "function", "function": {"name": "send_letter"}}
    response = client.chat.completions.create(
        model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=60,
        temperature=0.8, seed=3)
    message = response.choices[0].message
    assert_valid_calls(message, {"send_letter"})
    assert len(message.tool_calls) == 1 and message.content is None


# No bounds at all: the grammar's own (`jaxserve.tool_calling.bounds`) must end the reply.
PLAIN = {"type": "object",
         "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                        "temperature": {"type": "number"}, "metric": {"type": "boolean"},
                        "hours": {"type": "array", "items": {"type": "integer"}},
                        "extra": {}},
         "required": ["city", "days"]}
PLAIN_TOOLS = [{"type": "function", "function": {"name": "forecast", "parameters": PLAIN}},
               {"type": "function", "function": {"name": "note", "parameters": {
                   "type": "object", "properties": {"text": {"type": "string"}}}}}]


@pytest.mark.parametrize("tool_choice", ["required", "forecast"])
def test_forced_calls_on_a_plain_schema_end_valid(client, tool_choice):
    """The shipped model cannot call tools: on a schema with no bounds (its strings, numbers,
    list and untyped value run on until max_tokens unbounded), the bounds the grammar adds
    must still end the reply, for every seed, with one call valid under the client's
    schema."""
    choice = tool_choice if tool_choice == "required" else {
        "type": "function", "function": {"name": tool_choice}}
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in PLAIN_TOOLS}
    for seed in range(6):
        response = client.chat.completions.create(
            model=NAME, messages=MESSAGES, tools=PLAIN_TOOLS, tool_choice=choice,
            max_tokens=MAX_TOKENS, temperature=1.0, seed=seed)
        reply = response.choices[0]
        assert reply.finish_reason == "tool_calls", (seed, reply)
        (call,) = reply.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


HERMES = ('I will look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bath", '
          '"days": 3}}\n</tool_call>\n<tool_call>\n{"name": "send_letter", "arguments": '
          '{"to": "Anne", "urgent": true}}\n</tool_call>')


@pytest.mark.parametrize("thinking", [False, True])
def test_auto_choice_parses_the_hermes_calls_the_model_writes(client, thinking):
    """The regex forces the reply text; the parser must find its two calls (and, with a
    think block first, the qwen3 reasoning parser its reasoning), streamed or not."""
    text = ("<think>Bath is in Somerset.</think>\n\n" if thinking else "") + HERMES
    kwargs = dict(model=NAME, messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=0,
                  extra_body={"structured_outputs": {"regex": re.escape(text)}})
    response = client.chat.completions.create(**kwargs)
    expected = {"content": "I will look.", "finish": "tool_calls",
                "reasoning": "Bath is in Somerset." if thinking else None,
                "calls": [{"name": "get_weather", "arguments": '{"city": "Bath", "days": 3}'},
                          {"name": "send_letter",
                           "arguments": '{"to": "Anne", "urgent": true}'}]}
    assert whole(response) == expected
    assert_valid_calls(response.choices[0].message)
    assert reassembled(client.chat.completions.create(stream=True, **kwargs)) == expected


def test_history_with_calls_and_tool_results_is_accepted(client):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Bath", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "grey"}'}]
    response = client.chat.completions.create(model=NAME, messages=history, tools=TOOLS,
                                              tool_choice="none", max_tokens=8,
                                              temperature=0)  # unseeded, it may stop early
    message = response.choices[0].message
    assert message.tool_calls is None and response.choices[0].finish_reason == "length"


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}},
     "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}}}]},
     "tools.0.function.parameters"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS * 65}, "tools"),  # 130 tools: past the default cap of 128
    ({"tools": [TOOLS[0], {"type": "function", "function": {
        **TOOLS[1]["function"], "description": "x" * (64 << 10)}}]}, "tools.1"),
])
def test_bad_tools_are_refused_naming_the_field(server, body, param):
    answer = httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": NAME, "messages": MESSAGES, "max_tokens": 4, **body})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


def test_nothing_compiled_after_warm_up(server, client):
    """Every reply above ran on the warmed-up programs (`strict_compile` would fail)."""
    assert server.state.engine.engine.stats().compiles_after_warmup == 0
