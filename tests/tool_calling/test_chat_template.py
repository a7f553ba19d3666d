"""Tools and tool-call history rendered by a model's chat template, against transformers'
`apply_chat_template` (the reference) on a Qwen2.5-style template that prints tools,
assistant calls and tool results, and reads Qwen3's `enable_thinking` (TOOLS_CHAT_TEMPLATE)."""

import json

import pytest
import transformers

from jaxserve.loading.tokenizer import Tokenizer
from jaxserve.server.protocol import ChatMessage
from tiny_models import TOOLS_CHAT_TEMPLATE, build_tokenizer

pytestmark = pytest.mark.quick  # seconds, no engine: `pytest -m quick`

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
ARGUMENTS = {"city": "Bath", "note": "café"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen_like")
    build_tokenizer(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(chat_template=TOOLS_CHAT_TEMPLATE, eos_token="</s>")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("thinking", [None, False])
def test_tools_and_call_history_render_as_transformers_does(folder, thinking):
    """OpenAI's history (arguments as JSON text) renders as transformers renders the same
    history in its own convention (arguments as an object)."""
    openai_history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Bath?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps(ARGUMENTS)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "grey"}]
    hf_history = [dict(m) for m in openai_history]
    hf_history[2] = {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": ARGUMENTS}}]}
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    reference = transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(
        hf_history, tools=TOOLS, tokenize=False, add_generation_prompt=True, **kwargs)
    rendered = Tokenizer(folder).apply_chat_template(
        [ChatMessage(**m).as_template_message() for m in openai_history], tools=TOOLS,
        template_kwargs=kwargs)
    assert rendered == reference
    assert ("<think>" in rendered) == (thinking is False)
