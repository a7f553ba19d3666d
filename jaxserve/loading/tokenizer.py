"""Tokenizer of a Hugging Face model folder, its chat template, and streaming detokenization.

`tokenizer.json` is run by the `tokenizers` library; special tokens and the chat template come
from `tokenizer_config.json`. Chat templates are untrusted input (they ship with downloaded
models), so they render in jinja2's immutable sandbox.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from jaxserve.errors import InvalidRequestError


def _token_text(value: Any) -> str | None:
    """A special token as `tokenizer_config.json` writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


class Tokenizer:
    """Encode, decode and render chat prompts for one model folder."""

    def __init__(self, model_dir: str | Path):
        folder = Path(model_dir)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"model folder {str(model_dir)!r} has no tokenizer.json")
        self._tok = HFTokenizer.from_file(str(path))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.chat_template: str | None = config.get("chat_template")
        jinja_file = folder / "chat_template.jinja"
        if self.chat_template is None and jinja_file.is_file():
            self.chat_template = jinja_file.read_text()
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Through `encode_batch`, which releases the GIL (`encode`
        holds it): a long prompt tokenized on a server's worker thread then stalls no
        other thread, the event loop included."""
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def id_to_token(self, token: int) -> str | None:
        """The vocabulary's string of one id ("Ġword" in byte-level BPE), None if unknown."""
        return self._tok.id_to_token(token)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict] | None = None,
                            template_kwargs: dict[str, Any] | None = None) -> str:
        """Render `messages` with the model's chat template (sandboxed jinja2), as Hugging
        Face's `apply_chat_template` does: `tools` (OpenAI's function entries) and
        `template_kwargs` (e.g. Qwen3's `enable_thinking`) are template variables."""
        if not self.chat_template:
            raise ValueError("this model's tokenizer_config.json has no chat_template")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda value, indent=None: json.dumps(
            value, indent=indent, ensure_ascii=False)
        variables = {**(template_kwargs or {}), "messages": messages, "tools": tools,
                     "add_generation_prompt": add_generation_prompt,
                     "bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        try:
            return env.from_string(self.chat_template).render(**variables)
        except jinja2.exceptions.SecurityError as err:  # the sandbox refused it
            raise InvalidRequestError("messages", f"the chat template was refused by the "
                                      f"sandbox: {err}") from None
        except jinja2.TemplateError as err:  # the template rejects these messages
            raise InvalidRequestError("messages", f"the chat template failed: {err}") from None

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of a chat prompt; the template writes its own special tokens."""
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, never splitting a UTF-8 character.

    It decodes a short window (from `prefix_offset`) twice: up to the last emitted token and up
    to the newest one; the difference is the new text, held back while it ends in U+FFFD
    (bytes of a character still to come). Decoding a window rather than single tokens keeps
    tokenizers that strip a leading space per decode call correct.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0

    def add(self, new_ids: list[int]) -> str:
        """Append tokens; return the text they complete (possibly empty)."""
        self.token_ids.extend(new_ids)
        decode = lambda ids: self.tokenizer.decode(ids, self.skip_special_tokens)  # noqa: E731
        prefix_text = decode(self.token_ids[self._prefix_offset:self._read_offset])
        full_text = decode(self.token_ids[self._prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self.text += delta
        return delta
