"""One API request turned into engine requests ("choices") and back into OpenAI bodies.

A job builds `n` choices per prompt (`request_id` = job id + choice index, so the choices
of a batch of prompts come back in order) off the event loop (tokenizing a long prompt takes
seconds), queues them on it (`start`), then either collects them into one JSON body or
streams them as server-sent events. Cancelling the job (client gone) ends every choice's
stream, which aborts it in the engine. The job id (the body's `id`) is always the server's
own, so engine request ids stay unique; the client's `X-Request-Id` is recorded as the job's
`request_id` (logged at debug level with its engine request ids) and echoed by the server.

Log-probabilities over the prompt: `echo` with `logprobs` on completions (what
lm-evaluation-harness's log-likelihood tasks send) returns the prompt's tokens and
log-probabilities (the first `null`, as OpenAI and vLLM do) before the generated ones; vLLM's
`prompt_logprobs` extra returns them in vLLM's shape under `choices[i].prompt_logprobs`.
Both come from `SamplingParams.prompt_logprobs`, computed in the prefill.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from typing import Any, AsyncIterator

from jaxserve.engine.output_processor import StreamDelta
from jaxserve.outputs import RequestOutput
from jaxserve.errors import InvalidRequestError
from jaxserve.server.protocol import (ChatCompletionRequest, CompletionRequest, Usage, new_id,
                                      now)
from jaxserve.tool_calling import ChatParsing, ReplyParser

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions

log = logging.getLogger("jaxserve.server")


@dataclasses.dataclass
class Choice:
    index: int
    request_id: str
    prompt_ids: list[int]
    logprobs: int | None
    prompt_text: str | None = None  # shown before the output (completions' echo)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


class Job:
    """Shared machinery of completion and chat jobs."""

    object_name = ""
    chunk_object = ""
    id_prefix = ""
    prompt_ids_on_choice = True  # where `return_token_ids` puts the prompt's ids

    def __init__(self, served, body, answer_as: str, request_id: str | None = None,
                 lora=None):
        """`served`: the `jaxserve.fleet.ServedModel` that runs it; `answer_as`: the
        `model` its bodies name; `request_id`: the client's `X-Request-Id` (recorded, never
        an engine request id: clients may repeat one); `lora`: the LoRA adapter
        (`jaxserve.lora.slots.Adapter`) its `model` named, if any."""
        self.body = body
        self.lora = lora
        self.engine = served.engine
        self.tokenizer = served.tokenizer
        self.max_model_len = served.max_model_len
        self.id = new_id(self.id_prefix)
        self.request_id = request_id or self.id
        self.created = now()
        self.model = answer_as
        self.choices: list[Choice] = []
        self._sequences: list = []  # built, queued by `start`
        try:
            self.structured = body.structured()
            for prompt_index, (text, ids) in enumerate(self.prompts()):
                max_tokens = self.max_tokens(len(ids))
                for j in range(body.n):
                    self._prepare(prompt_index * body.n + j, text, ids, max_tokens, j)
        except InvalidRequestError as err:
            err.field = self.param(err.field)
            raise

    def start(self) -> "Job":
        """Queue every choice in the engine, all or none (on the event loop; the
        constructor, which tokenizes, renders templates and compiles grammars, runs off
        it)."""
        self.engine.submit(self._sequences)
        self._sequences = []
        log.debug("request %s: job %s, engine requests %s", self.request_id, self.id,
                  [c.request_id for c in self.choices])
        return self

    def param(self, field: str | None) -> str | None:
        """The request field that an error about engine-level `field` names (OpenAI's
        `param`): one the client sent."""
        return field

    def prompts(self) -> list[tuple[str | None, list[int]]]:
        raise NotImplementedError

    def requested_max_tokens(self) -> int | None:
        raise NotImplementedError

    def logprobs_count(self) -> int | None:
        raise NotImplementedError

    def prompt_logprobs_count(self) -> int | None:
        """How many top tokens to score at each prompt position (None: no prompt scoring)."""
        return self.body.prompt_logprobs

    def echo_text(self, text: str | None, ids: list[int]) -> str | None:
        """The prompt text shown before a choice's output (None: no echo)."""
        return None

    def keeps_special_tokens(self) -> bool:
        """Whether the output's text keeps special tokens whatever the request says."""
        return False

    def max_tokens(self, prompt_len: int) -> int:
        """The choice's token limit; a prompt that leaves no room is an error, as in OpenAI."""
        room = self.max_model_len - prompt_len
        if room < 1:
            raise InvalidRequestError("prompt", f"prompt has {prompt_len} tokens; this model's "
                                      f"maximum context length is {self.max_model_len}")
        wanted = self.requested_max_tokens()
        if wanted is None:  # the model's default (--generation-config), capped at the room
            return min(room, self.body.default_max_tokens or room)
        if wanted > room:
            raise InvalidRequestError("max_tokens", f"max_tokens ({wanted}) plus the prompt "
                                      f"({prompt_len} tokens) exceeds this model's maximum "
                                      f"context length ({self.max_model_len})")
        return wanted

    def _prepare(self, index: int, text, ids, max_tokens: int, j: int) -> None:
        logprobs = self.logprobs_count()
        params = self.body.sampling_params(max_tokens, logprobs, j,
                                           self.prompt_logprobs_count(), self.structured,
                                           self.keeps_special_tokens())
        request_id = f"{self.id}-{index}"
        self._sequences.append(self.engine.prepare(request_id, ids, params, text,
                                                   self.body.cache_salt, self.lora))
        self.choices.append(Choice(index, request_id, ids, logprobs, self.echo_text(text, ids)))

    # ---- bodies -------------------------------------------------------------------------
    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False) if self.tokenizer else ""

    def choice_body(self, choice: Choice, output: RequestOutput) -> dict:
        raise NotImplementedError

    def with_prompt_logprobs(self, body: dict, choice: Choice, prompt_logprobs) -> dict:
        """`body` with vLLM's `prompt_logprobs` field, when the request asked for it: per
        prompt token None (the first) or {token id: {logprob, rank, decoded_token}}."""
        top = self.body.prompt_logprobs
        if top is None or prompt_logprobs is None:
            return body
        listed = []
        for token, entry in zip(choice.prompt_ids, prompt_logprobs):
            if entry is None:
                listed.append(None)
                continue
            ranked = most_likely(entry, top)
            kept = dict(ranked)
            kept[token] = entry[token]
            ranks = {t: r + 1 for r, (t, _) in enumerate(ranked)}
            listed.append({str(t): {"logprob": v, "rank": ranks.get(t),
                                    "decoded_token": self.token_text(t)}
                           for t, v in kept.items()})
        body["prompt_logprobs"] = listed
        return body

    def delta_body(self, choice: Choice, delta: StreamDelta, first: bool) -> dict | None:
        raise NotImplementedError

    def usage(self, completion_tokens: int) -> dict:
        prompt_tokens = sum(c.prompt_tokens for c in self.choices[::self.body.n])
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens).model_dump()

    async def collect(self) -> dict:
        """Run every choice to the end; one JSON body."""
        async def finish(choice: Choice):
            async for _ in self.engine.stream(choice.request_id):
                pass
            return self.engine.result(choice.request_id)

        outputs = await asyncio.gather(*(finish(c) for c in self.choices))
        choices = [self.choice_body(c, out) for c, out in zip(self.choices, outputs)]
        response = {"id": self.id, "object": self.object_name, "created": self.created,
                    "model": self.model, "choices": choices,
                    "usage": self.usage(sum(len(o.outputs[0].token_ids) for o in outputs))}
        for choice, body, output in zip(self.choices, choices, outputs):
            self.add_token_ids(response, body, choice, output.outputs[0].token_ids, True)
        return response

    def add_token_ids(self, response: dict, body: dict, choice: Choice, token_ids,
                      first: bool) -> None:
        """vLLM's `return_token_ids`: the choice's generated ids (a chunk's new ones) in
        `token_ids`, and with a choice's first body the prompt's ids, in the choice
        (completions) or the response (chat): `prompt_token_ids`."""
        if not self.body.return_token_ids:
            return
        body["token_ids"] = list(token_ids)
        if first:
            (body if self.prompt_ids_on_choice else response)["prompt_token_ids"] = list(
                choice.prompt_ids)

    async def _deltas(self, choice: Choice) -> AsyncIterator[tuple[Choice, Any]]:
        """One choice's deltas, then its failure if it failed (reported in the stream)."""
        try:
            async for delta in self.engine.stream(choice.request_id):
                yield choice, delta
            self.engine.result(choice.request_id)
        except Exception as err:  # noqa: BLE001 - reported in the stream
            yield choice, err

    async def _interleaved(self) -> AsyncIterator[tuple[Choice, Any]]:
        """Every choice's deltas as they arrive; one choice is read directly (no task)."""
        if len(self.choices) == 1:
            async for item in self._deltas(self.choices[0]):
                yield item
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(choice: Choice):
            async for item in self._deltas(choice):
                await queue.put(item)
            await queue.put(None)

        tasks = [asyncio.ensure_future(pump(c)) for c in self.choices]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()

    async def sse(self) -> AsyncIterator[str]:
        """Server-sent events of every choice, interleaved as tokens arrive."""
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        started, generated = set(), 0
        async for choice, delta in self._interleaved():
            if isinstance(delta, Exception):  # the raw error to the log, never the client
                log.error("request %s: choice %d failed: %s", self.request_id, choice.index,
                          delta)
                yield _event({"error": {"message": "the engine failed while serving this "
                                        f"request (request id {self.request_id})",
                                        "type": "server_error"}})
                continue
            generated += len(delta.new_token_ids)
            first = choice.index not in started
            body = self.delta_body(choice, delta, first)
            started.add(choice.index)
            if body is not None:
                chunk = {"id": self.id, "object": self.chunk_object, "created": self.created,
                         "model": self.model, "choices": [body]}
                self.add_token_ids(chunk, body, choice, delta.new_token_ids, first)
                if include_usage:
                    chunk["usage"] = None
                yield _event(chunk)
        if include_usage:
            yield _event({"id": self.id, "object": self.chunk_object, "created": self.created,
                          "model": self.model, "choices": [], "usage": self.usage(generated)})
        yield "data: [DONE]\n\n"


def most_likely(entry: dict[int, float], top: int) -> list[tuple[int, float]]:
    """The `top` most likely (token id, log-probability) pairs of a log-probability entry."""
    return sorted(entry.items(), key=lambda kv: -kv[1])[:top]


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class CompletionJob(Job):
    object_name = chunk_object = "text_completion"
    id_prefix = "cmpl"
    prompt_ids_on_choice = True
    body: CompletionRequest

    def prompts(self):
        prompt = self.body.prompt
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        if not prompt:
            raise InvalidRequestError("prompt", "prompt is empty")
        out = []
        for item in prompt:
            if isinstance(item, str):
                if not item:
                    raise InvalidRequestError("prompt", "prompt is empty")
                if self.tokenizer is None:
                    raise InvalidRequestError(
                        "prompt", "prompt must be token ids: this model has no tokenizer")
                out.append((item, self.tokenizer.encode(item)))
            else:
                out.append((None, list(item)))
        return out

    def requested_max_tokens(self):
        return self.body.max_tokens

    def max_tokens(self, prompt_len: int) -> int:
        """OpenAI's default of 16 new tokens, capped at the room the prompt leaves; 0
        generates nothing (with echo: the prompt and, if asked, its log-probabilities)."""
        if self.body.max_tokens is None:
            return min(DEFAULT_COMPLETION_TOKENS, super().max_tokens(prompt_len))
        return super().max_tokens(prompt_len)

    def logprobs_count(self):
        return self.body.logprobs

    def prompt_logprobs_count(self):
        """Echo with log-probabilities scores the prompt with the same top count; max_tokens
        0 scores it too (the engine's prompt-only mode, which generates nothing)."""
        wanted = self.body.prompt_logprobs
        if (self.body.echo and self.body.logprobs is not None) or self.body.max_tokens == 0:
            wanted = max(wanted or 0, self.body.logprobs or 0)
        return wanted

    def echo_text(self, text, ids):
        if not self.body.echo:
            return None
        if text is not None:
            return text
        # special tokens kept, as vLLM echoes token prompts, so `text_offset` (which counts
        # every token's text) lines up with the echoed text
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _logprobs(self, token_ids: list[int], entries, offset: int = 0) -> dict:
        """OpenAI's completion logprobs: per token its text, log-probability (None for an
        entry of None: the prompt's first token), the `logprobs` most likely, and where its
        text starts in the choice's text (from `offset`)."""
        top = self.body.logprobs or 0
        texts = [self.token_text(t) for t in token_ids]
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        tops = []
        for token, entry in zip(token_ids, entries):
            if entry is None:
                tops.append(None)
                continue
            ranked = dict(most_likely(entry, top))
            ranked.setdefault(token, entry[token])
            tops.append({self.token_text(k): v for k, v in ranked.items()})
        return {"tokens": texts,
                "token_logprobs": [None if e is None else e[t] for t, e in zip(token_ids, entries)],
                "top_logprobs": tops, "text_offset": offsets}

    def _echoed_logprobs(self, choice: Choice, prompt_logprobs, token_ids, entries) -> dict:
        """Log-probabilities of the prompt's tokens, then of the generated ones."""
        return self._logprobs(choice.prompt_ids + list(token_ids),
                              list(prompt_logprobs) + list(entries))

    def choice_body(self, choice, output):
        completion = output.outputs[0]
        text, logprobs = completion.text, None
        if choice.prompt_text is not None:
            text = choice.prompt_text + text
            if self.body.logprobs is not None:
                logprobs = self._echoed_logprobs(choice, output.prompt_logprobs,
                                                 completion.token_ids, completion.logprobs)
        elif completion.logprobs is not None:
            logprobs = self._logprobs(completion.token_ids, completion.logprobs)
        body = {"index": choice.index, "text": text, "finish_reason": completion.finish_reason,
                "logprobs": logprobs}
        return self.with_prompt_logprobs(body, choice, output.prompt_logprobs)

    def delta_body(self, choice, delta, first):
        echo = first and choice.prompt_text is not None
        if (not delta.new_text and not delta.finished and delta.new_logprobs is None
                and not echo):
            return None
        text, logprobs = delta.new_text, None
        if echo:
            text = choice.prompt_text + text
            if self.body.logprobs is not None:
                logprobs = self._echoed_logprobs(choice, delta.prompt_logprobs,
                                                 delta.new_token_ids, delta.new_logprobs or [])
        elif delta.new_logprobs is not None:
            logprobs = self._logprobs(delta.new_token_ids, delta.new_logprobs)
        body = {"index": choice.index, "text": text, "logprobs": logprobs,
                "finish_reason": delta.finish_reason}
        return self.with_prompt_logprobs(body, choice, delta.prompt_logprobs)


class ChatJob(Job):
    """A chat request: messages (and tools) rendered by the model's chat template; each
    reply read by a `ReplyParser` into content, reasoning and tool calls."""

    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"
    prompt_ids_on_choice = False
    body: ChatCompletionRequest

    def __init__(self, served, body, answer_as: str, request_id: str | None = None,
                 lora=None, parsing: ChatParsing = ChatParsing()):
        self.parsing = parsing
        self.tool_choice = body.tool_choice_checked
        parsing.check(self.tool_choice, getattr(served.tokenizer, "chat_template", None))
        self.replies: dict[int, ReplyParser] = {}  # choice index → its parser
        super().__init__(served, body, answer_as, request_id, lora)

    def prompts(self):
        if self.tokenizer is None:
            raise InvalidRequestError(
                "messages", "messages need a chat template: this model has no tokenizer")
        messages = [m.as_template_message() for m in self.body.messages]
        tools = self.body.tools if self.tool_choice is not None else None  # as the client wrote
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, template_kwargs=self.body.chat_template_kwargs)
        return [(text, self.tokenizer.encode(text, add_special_tokens=False))]

    def keeps_special_tokens(self):
        return self.parsing.keeps_special_tokens(self.tool_choice)

    def reply(self, choice: Choice) -> ReplyParser:
        if choice.index not in self.replies:
            self.replies[choice.index] = self.parsing.reply_parser(
                self.tool_choice, self.body.include_reasoning)
        return self.replies[choice.index]

    def requested_max_tokens(self):
        return self.body.max_completion_tokens or self.body.max_tokens

    def param(self, field):
        """A chat request has messages, not a prompt, and may give its token limit as
        max_completion_tokens."""
        if field == "prompt":
            return "messages"
        if field == "max_tokens" and self.body.max_completion_tokens:
            return "max_completion_tokens"
        return field

    def logprobs_count(self):
        return (self.body.top_logprobs or 0) if self.body.logprobs else None

    def _logprobs(self, token_ids, entries) -> dict | None:
        if entries is None:
            return None
        top = self.body.top_logprobs or 0
        content = []
        for token, entry in zip(token_ids, entries):
            ranked = most_likely(entry, top)
            content.append({
                "token": self.token_text(token), "logprob": entry[token],
                "bytes": list(self.token_text(token).encode()),
                "top_logprobs": [{"token": self.token_text(k), "logprob": v,
                                  "bytes": list(self.token_text(k).encode())} for k, v in ranked]})
        return {"content": content}

    def choice_body(self, choice, output):
        completion = output.outputs[0]
        reply = self.reply(choice)
        body = {"index": choice.index,
                "message": reply.message(reply.feed(completion.text) + reply.finish()),
                "logprobs": self._logprobs(completion.token_ids, completion.logprobs),
                "finish_reason": reply.finish_reason(completion.finish_reason)}
        return self.with_prompt_logprobs(body, choice, output.prompt_logprobs)

    def delta_body(self, choice, delta, first):
        reply = self.reply(choice)
        events = reply.feed(delta.new_text) + (reply.finish() if delta.finished else [])
        message = reply.delta(events)
        if first:
            message = {"role": "assistant", "content": "", **message}
        if not message and not delta.finished and delta.new_logprobs is None:
            return None
        logprobs = (self._logprobs(delta.new_token_ids, delta.new_logprobs)
                    if delta.new_logprobs is not None else None)
        body = {"index": choice.index, "delta": message, "logprobs": logprobs,
                "finish_reason": reply.finish_reason(delta.finish_reason)}
        return self.with_prompt_logprobs(body, choice, delta.prompt_logprobs)
