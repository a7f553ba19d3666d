"""`jaxserve serve`'s flags: help that says what runs, vLLM's flags with vLLM's meanings, and
vLLM flags jaxserve cannot honour refused with the equivalent named. No engine is built."""

import argparse
import json
import re

import pytest
from fastapi.testclient import TestClient

from jaxserve.cli.main import build_parser
from jaxserve.cli.serve_values import read_chat_template, server_url, with_revision
from jaxserve.default_model import DEFAULT_MODEL_DIR
from jaxserve.errors import InvalidRequestError
from jaxserve.server.generation_defaults import read_generation_defaults, with_defaults
from jaxserve.server.limits import RequestLimits
from jaxserve.server.protocol import ChatCompletionRequest, CompletionRequest

pytestmark = pytest.mark.quick  # seconds, no engine: `pytest -m quick`


def serve_actions() -> list[argparse.Action]:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [a for a in commands.choices["serve"]._actions
            if a.option_strings and a.help != argparse.SUPPRESS and a.dest != "help"]


def test_every_serve_flag_has_help_and_shows_one_default():
    for action in serve_actions():
        assert action.help and len(action.help) > 10, action.option_strings
        assert action.help.count("(default:") <= 1, (action.option_strings, action.help)


def test_the_defaults_serve_help_shows_are_the_ones_that_run():
    """Engine options: what `LLM` resolves for the shipped model on CPU with no flags (the
    model's own max_model_len from its config.json, the cpu preset's values); other flags:
    the parser's own default."""
    from jaxserve.llm import resolve_settings

    engine = resolve_settings(str(DEFAULT_MODEL_DIR), None, None, {}).engine_config
    max_len = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    assert engine.max_model_len == max_len["max_position_embeddings"] == 512
    checked = 0
    for action in serve_actions():
        if action.dest == "max_model_len":
            assert "the model's max_position_embeddings" in action.help
            continue
        cpu = re.search(r"(?:default: |; )([\w. ]+?) on CPU \(the cpu preset\)", action.help)
        plain = re.search(r"\(default: (-?[\d.]+|[A-Za-z*]+)\)$", action.help)
        if hasattr(engine, action.dest) and (cpu or plain):  # an engine option
            runs = getattr(engine, action.dest)
            runs = " ".join(map(str, runs)) if isinstance(runs, tuple) else str(runs)
            assert (cpu or plain).group(1) == runs, (action.dest, action.help)
            checked += 1
        elif plain and action.default is not None and not isinstance(action.default, bool):
            default = action.default
            default = default[0] if isinstance(default, list) else default
            assert plain.group(1) == str(default), (action.dest, action.help)
            checked += 1
    assert checked >= 20


@pytest.mark.parametrize("argv, instead", [
    (["--swap-space", "4"], "recomputed"),
    (["--enforce-eager"], "--strict-compile"),
    (["--block-size", "16"], "--page-size"),
])
def test_a_vllm_flag_jaxserve_cannot_honour_is_one_line_naming_the_equivalent(argv, instead,
                                                                              capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", *argv])
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"jaxserve: error: {argv[0]} is a vLLM flag jaxserve does not support: ")
    assert instead in lines[0]


def test_chat_template_is_a_file_or_the_template_itself(tmp_path):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    assert read_chat_template(str(tmp_path / "t.jinja")) == template
    assert read_chat_template(template) == template
    with pytest.raises(ValueError, match="--chat-template .*no such file"):
        read_chat_template(str(tmp_path / "missing.jinja"))


def test_revision_folds_into_the_hub_id_and_urls_say_where_to_connect(tmp_path):
    assert with_revision("org/name", "v2") == "org/name@v2"
    with pytest.raises(ValueError, match="--revision .* local folder"):
        with_revision(str(tmp_path), "v2")
    assert server_url("0.0.0.0", 8000, None, False) == "http://127.0.0.1:8000"
    assert server_url("::1", 9, "/api/", True) == "https://[::1]:9/api"


def test_generation_config_gives_request_defaults_as_vllm_reads_them(tmp_path):
    """vLLM's fields, only those differing from transformers' defaults (top_k 50 is its
    default), max_new_tokens as max_tokens; do_sample ignored; `vllm` reads none."""
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 50,
        "repetition_penalty": 1.1, "max_new_tokens": 100, "eos_token_id": 2}))
    expected = {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1, "max_tokens": 100}
    assert read_generation_defaults("auto", tmp_path) == expected
    assert read_generation_defaults(str(tmp_path), DEFAULT_MODEL_DIR) == expected
    assert read_generation_defaults("vllm", tmp_path) == {}
    assert read_generation_defaults("auto", DEFAULT_MODEL_DIR) == {}  # greedy by do_sample

    given = CompletionRequest(prompt="a", temperature=1.0)
    body = with_defaults(given, expected)
    assert (body.temperature, body.top_p, body.repetition_penalty) == (1.0, 0.9, 1.1)
    assert body.max_tokens is None  # a completion's default stays OpenAI's 16
    chat = with_defaults(ChatCompletionRequest(messages=[{"role": "user", "content": "a"}]),
                         expected)
    assert chat.temperature == 0.6 and chat.default_max_tokens == 100
    chat = with_defaults(ChatCompletionRequest(messages=[{"role": "user", "content": "a"}],
                                               max_tokens=5), expected)
    assert chat.default_max_tokens is None and chat.max_tokens == 5


def test_max_logprobs_caps_every_logprobs_field():
    limits = RequestLimits(max_logprobs=3)
    limits.check(CompletionRequest(prompt="a", logprobs=3))
    for body, field in ((CompletionRequest(prompt="a", logprobs=4), "logprobs"),
                        (CompletionRequest(prompt="a", prompt_logprobs=4), "prompt_logprobs"),
                        (ChatCompletionRequest(messages=[{"role": "user", "content": "a"}],
                                               logprobs=True, top_logprobs=4),
                         "top_logprobs")):
        with pytest.raises(InvalidRequestError, match=f"{field} is 4; at most 3") as err:
            limits.check(body)
        assert err.value.field == field
    with pytest.raises(ValueError, match="max_logprobs must be at most 20"):
        RequestLimits(max_logprobs=21)


@pytest.mark.parametrize("cors", [None, {"allow_origins": ["https://app.example"],
                                         "allow_credentials": False, "allow_methods": ["*"],
                                         "allow_headers": ["*"]}])
def test_allowed_origins_answer_a_browser_preflight(cors):
    """Without --allowed-origins no cross-origin access; with it, CORS headers for that
    origin only (the app is not started: no model loads)."""
    from jaxserve.server.app import create_app
    from jaxserve.server.state import ServerOptions, ServerState

    state = ServerState(ServerOptions(model=str(DEFAULT_MODEL_DIR), cors=cors))
    client = TestClient(create_app(state))
    headers = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "content-type"}
    answer = client.options("/v1/completions", headers=headers)
    allowed = answer.headers.get("access-control-allow-origin")
    assert allowed == (None if cors is None else "https://app.example")
    other = client.options("/v1/completions", headers={**headers, "Origin": "https://evil"})
    assert other.headers.get("access-control-allow-origin") is None


def test_download_dir_is_where_hub_models_are_looked_for(tmp_path, monkeypatch):
    """--download-dir points the Hugging Face cache at the folder (offline here: a model
    not in it is an error naming that cache)."""
    from huggingface_hub import constants

    from jaxserve.cli.serve_values import use_download_dir
    from jaxserve.loading.hub import resolve_model

    monkeypatch.setattr(constants, "HF_HUB_CACHE", constants.HF_HUB_CACHE)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", "unused")
    use_download_dir(str(tmp_path))
    with pytest.raises(ValueError, match=f"cache: {tmp_path}$"):
        resolve_model("org/name")


def test_gpu_memory_utilization_is_vllms_option_here_too():
    """Not refused: the KV pool is sized after compiling from this share of the device
    (`jaxserve.engine.memory_budget`), as vLLM sizes it after profiling."""
    args = build_parser().parse_args(["serve", "--gpu-memory-utilization", "0.9"])
    assert args.gpu_memory_utilization == 0.9
