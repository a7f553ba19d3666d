"""Property-based fuzzing of the HTTP API (hypothesis), generated from the server's own
OpenAPI schema.

The request bodies and their fields are read from `app.openapi()`, so a new endpoint or field
is fuzzed without touching this file. Each field gets values of its schema, values at and
beyond its bounds, and junk of every other type (null, bools, 2**70, negatives, floats, NaN,
empty and 1 MiB strings, lone surrogates, lists, nested dicts); whole bodies lose required
fields and gain unknown ones; raw bodies are bytes that are not UTF-8, not JSON, or JSON that
is not an object; token-id prompts leave the vocabulary; chat messages get bad roles and
contents.

Properties: every answer is a 2xx or a 4xx, never a 5xx or a dropped connection; a 4xx has
OpenAI's error body, whose `param` names a field of the request (or a required field that is
missing), and is None when the body as a whole is wrong; a stream ends with [DONE] and holds no
error event; and the server goes on serving a plain request throughout (every CHECK_EVERY
requests and after each test). Requests stay cheap on a 2-core CPU: max_tokens is at most
CHEAP unless it is the field being fuzzed. With -s, each test prints how many requests it sent
and their status codes.
"""

import collections
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from jaxserve.engine.step_results import MAX_CONSECUTIVE_FAILURES
from jaxserve.lora.runtime import RuntimeLoRAUpdating
from jaxserve.server.app import create_app
from jaxserve.server.state import ServerOptions, ServerState
from server_helpers import ADMIN_KEY, AS_ADMIN, serving
from tiny_models import SMALL_ENGINE, VOCAB

NAME = "tiny"
ENGINE = {**SMALL_ENGINE, "max_num_seqs": 8, "num_pages": 96}
MAX_MODEL_LEN = ENGINE["max_model_len"]
CHEAP = 4  # most tokens a generated request asks for, unless its max_tokens is fuzzed
LIMITS = ("max_tokens", "max_completion_tokens")  # fields that bound the generated tokens
PROMPTS = ("prompt", "messages")  # a prompt that leaves too little room blames a limit
CHECK_EVERY = 50  # requests between two checks that a plain request is still served
EXAMPLES = 400  # hypothesis examples per test
MIB = 1 << 20
PLAIN = {"model": NAME, "prompt": "ok", "max_tokens": 2}
BASES = {  # a valid, cheap body per endpoint; fuzzing changes it
    "/v1/completions": PLAIN,
    "/v1/chat/completions": {"model": NAME, "messages": [{"role": "user", "content": "ok"}],
                             "max_tokens": 2, "logprobs": True},  # top_logprobs is used
    "/tokenize": {"model": NAME, "prompt": "ok"},
    "/detokenize": {"model": NAME, "tokens": [5, 6]},
    # LoRA routes (runtime updating on, from the Hub; the fuzzer sends the admin key): this
    # server runs without --enable-lora, so they refuse (400) once the body validates;
    # tests/server/test_lora_server.py covers them with adapters
    "/v1/load_lora_adapter": {"lora_name": "fuzz", "lora_path": "no-such-folder"},
    "/v1/unload_lora_adapter": {"lora_name": "fuzz"},
    # pooling routes: this server generates, so a body that validates is refused naming
    # `model` (400); tests/server/test_pooling_server.py covers them on a pooling server
    **{path: {"model": NAME, "input": "ok"} for path in ("/v1/embeddings", "/pooling")},
    **{path: {"model": NAME, "text_1": "ok", "text_2": "fine"}
       for path in ("/score", "/v1/score")},
    **{path: {"model": NAME, "query": "ok", "documents": ["fine"]}
       for path in ("/rerank", "/v1/rerank", "/v2/rerank")},
}
POOLING = ("/v1/embeddings", "/pooling", "/score", "/v1/score", "/rerank", "/v1/rerank",
           "/v2/rerank")

RUNTIME_LORA = RuntimeLoRAUpdating(allow_hub=True)  # registers the LoRA routes
OPENAPI = create_app(ServerState(ServerOptions(model=NAME, runtime_lora=RUNTIME_LORA))).openapi()
SCHEMAS = OPENAPI["components"]["schemas"]
ENDPOINTS = {path: operation["requestBody"]["content"]["application/json"]["schema"]
             for path, item in OPENAPI["paths"].items()
             for method, operation in item.items()
             if method == "post" and "requestBody" in operation}

FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.large_base_example,
                                       HealthCheck.filter_too_much])


# ---- the schema ---------------------------------------------------------------------------
def resolve(schema: dict) -> dict:
    while "$ref" in schema:
        schema = SCHEMAS[schema["$ref"].rsplit("/", 1)[1]]
    return schema


def variants(schema: dict) -> list[dict]:
    """The alternatives of an `anyOf` schema (the schema itself otherwise), resolved."""
    schema = resolve(schema)
    return [resolve(s) for s in schema.get("anyOf", [schema])]


def fields(path: str) -> dict[str, dict]:
    return resolve(ENDPOINTS[path])["properties"]


def required(path: str) -> set[str]:
    return set(resolve(ENDPOINTS[path]).get("required", ()))


def from_schema(schema: dict) -> st.SearchStrategy:
    """Small values that fit `schema`, a JSON schema as FastAPI writes it."""
    options = []
    for s in variants(schema):
        kind = s.get("type")
        if "enum" in s:
            options.append(st.sampled_from(s["enum"]))
        elif kind == "object" and "properties" in s:
            props, needed = s["properties"], set(s.get("required", ()))
            options.append(st.fixed_dictionaries(
                {k: from_schema(v) for k, v in props.items() if k in needed},
                optional={k: from_schema(v) for k, v in props.items() if k not in needed}))
        elif kind == "array":
            options.append(st.lists(from_schema(s["items"]), min_size=s.get("minItems", 0),
                                    max_size=3))
        elif kind == "integer":
            low, high = (int(s[k]) if k in s else None for k in ("minimum", "maximum"))
            options.append(st.integers(low, high))
        elif kind == "number":
            options.append(st.floats(s.get("minimum"), s.get("maximum"), allow_nan=False,
                                     allow_infinity=False))
        else:
            options.append(SIMPLE.get(kind, JSON))
    return st.one_of(options)


def edges(schema: dict) -> list[tuple[int, bool | None]]:
    """(value, fits) at (True) and one past (False) each bound of an integer schema; past a
    missing maximum, huge values that may or may not fit (None)."""
    out = []
    for s in variants(schema):
        if s.get("type") == "integer":
            if "minimum" in s:
                out += [(int(s["minimum"]), True), (int(s["minimum"]) - 1, False)]
            if "maximum" in s:
                out += [(int(s["maximum"]), True), (int(s["maximum"]) + 1, False)]
            else:
                out += [(2**31, None), (2**63, None), (2**70, None)]
    return out


# ---- values -------------------------------------------------------------------------------
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
                    st.text(max_size=12))
JSON = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8)
STRING = st.one_of(st.text(max_size=12), st.text(st.one_of(  # lone surrogates too
    st.characters(), st.characters(categories=["Cs"])), max_size=12))
SIMPLE = {"string": STRING, "boolean": st.booleans(), "null": st.none()}
HUGE = "x" * MIB
NESTED = {"a": {"b": [{"c": None}, [1, 2.5, "d", {"e": [[[]]]}]]}}
DEEP: list = []
for _ in range(200):
    DEEP = [DEEP]
JUNK = [None, True, False, 0, -1, 2**70, -(2**70), 1.5, -0.5, 1e308, float("nan"),
        float("inf"), "", " ", HUGE, "\ud800", "\x00", [], [None], [[]], [-1], [2**70], [""],
        [HUGE] * 5, {}, NESTED, [NESTED], DEEP]
WRONG = st.one_of(st.sampled_from(JUNK), JSON)


def any_value(schema: dict) -> st.SearchStrategy:
    """A value of the schema, at or past its bounds, or junk."""
    bounds = [value for value, _ in edges(schema)]
    return st.one_of(from_schema(schema), WRONG, *([st.sampled_from(bounds)] if bounds else []))


# ---- sending and checking -----------------------------------------------------------------
class Fuzzer:
    """Sends bodies, checks every answer, counts status codes, and every CHECK_EVERY requests
    checks that a plain request is still served."""

    def __init__(self, url: str):
        self.client = httpx.Client(base_url=url, headers=AS_ADMIN, timeout=120)
        self.statuses: collections.Counter = collections.Counter()
        self.total: collections.Counter = collections.Counter()
        self.checks = 0

    def send(self, path: str, body=None, raw: bytes | None = None,
             content_type: str | None = "application/json") -> tuple[httpx.Response, dict]:
        """POST `body` as JSON (NaN allowed, surrogates escaped), or `raw` bytes; the answer
        and its error body ({} for a 2xx)."""
        content = json.dumps(body).encode() if raw is None else raw
        headers = {} if content_type is None else {"content-type": content_type}
        response = self.client.post(path, content=content, headers=headers)
        self.statuses[response.status_code] += 1
        if raw is not None:
            body = parsed(raw)
        error = check(path, body, response)
        if sum(self.statuses.values()) % CHECK_EVERY == 0:
            self.assert_serving()
        return response, error

    def assert_serving(self) -> None:
        """A plain request is served."""
        self.checks += 1
        ok = self.client.post("/v1/completions", json=PLAIN)
        assert ok.status_code == 200, f"the server stopped serving: {ok.text[:300]}"

    def report(self, name: str) -> None:
        """Check that the server serves; print and add up the status codes since the last."""
        self.assert_serving()
        print(f"\n{name}: {sum(self.statuses.values())} requests, status codes "
              f"{dict(sorted(self.statuses.items()))}")
        self.total.update(self.statuses)
        self.statuses.clear()


def parsed(raw: bytes):
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def check(path: str, body, response: httpx.Response) -> dict:
    """The properties of every answer to `body` (the sent JSON; None if not JSON); returns
    the error body of a 4xx, {} for a 2xx."""
    status, text = response.status_code, response.text
    assert 200 <= status < 300 or 400 <= status < 500, f"{status} for {short(body)}: {text[:500]}"
    if status >= 400:
        answer = response.json()
        assert set(answer) == {"error"}, text[:500]
        error = answer["error"]
        assert set(error) == {"message", "type", "param", "code"}, text[:500]
        assert isinstance(error["message"], str) and error["message"], text[:500]
        assert isinstance(error["type"], str) and error["type"], text[:500]
        assert error["code"] is None or isinstance(error["code"], str), text[:500]
        param = error["param"]
        if param is not None:
            assert isinstance(param, str), text[:500]
            assert isinstance(body, dict), f"param {param!r} for a body that is no object"
            head = param.split(".")[0]
            assert head in body or head in required(path), (
                f"param {param!r} is no field of {short(body)}: {text[:500]}")
        return error
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", text[-500:]
        assert not any("error" in json.loads(e) for e in events[:-1]), text[:500]
    elif path in ("/tokenize", "/detokenize"):
        assert set(response.json()) >= {"/tokenize": {"tokens", "count"},
                                        "/detokenize": {"prompt"}}[path], text[:500]
    else:
        assert response.json()["choices"], text[:500]
    return {}


def short(body) -> str:
    text = repr(body)
    return text if len(text) < 300 else f"{text[:300]}... ({len(text)} characters)"


@pytest.fixture(scope="module")
def server(folder):
    options = ServerOptions(model=str(folder), served_model_name=[NAME],
                            dtype="float32", engine_options=ENGINE, admin_api_key=ADMIN_KEY,
                            runtime_lora=RUNTIME_LORA)
    with serving(options) as running:
        yield running


@pytest.fixture(scope="module")
def fuzz(server):
    fuzzer = Fuzzer(server.url)
    yield fuzzer
    fuzzer.report("since the last report")
    print(f"fuzzing in all: {sum(fuzzer.total.values())} requests and {fuzzer.checks} "
          f"serving checks, status codes {dict(sorted(fuzzer.total.items()))}")
    fuzzer.client.close()


# ---- tests --------------------------------------------------------------------------------
def test_every_endpoint_with_a_body_is_fuzzed():
    assert set(ENDPOINTS) == set(BASES), "add a valid, cheap body to BASES for a new endpoint"


@pytest.mark.parametrize("path", sorted(BASES))
def test_one_field_gets_any_value(fuzz, path):
    """One field of a valid body set to anything; a 400 blames that field."""
    @FUZZ
    @given(st.sampled_from(sorted(fields(path))).flatmap(
        lambda name: st.tuples(st.just(name), any_value(fields(path)[name]))))
    def run(case):
        name, value = case
        body = {**BASES[path], name: value}
        response, error = fuzz.send(path, body)
        if response.status_code == 400 and error["param"] is not None:
            head = error["param"].split(".")[0]
            assert (head == name or (name in PROMPTS and head in LIMITS)
                    or (path in POOLING and head == "model")), error
    run()
    fuzz.report(f"one field of {path}")


@pytest.mark.parametrize("path", sorted(BASES))
def test_whole_bodies_missing_and_unknown_fields(fuzz, path):
    """Bodies drawn from the schema, less some fields (required ones too), plus unknown ones."""
    known = fields(path)
    droppable = sorted(set(known) - set(LIMITS))  # without a limit, generation is long

    @FUZZ
    @given(from_schema(ENDPOINTS[path]), st.sets(st.sampled_from(droppable)),
           st.dictionaries(st.text(max_size=12).filter(lambda k: k not in known), JSON,
                           max_size=3),
           st.integers(1, CHEAP))
    def run(body, dropped, unknown, limit):
        body = {**body, "model": NAME, **{k: limit for k in LIMITS if k in known}}
        body = {k: v for k, v in body.items() if k not in dropped}
        fuzz.send(path, {**body, **unknown})
    run()
    fuzz.report(f"whole bodies of {path}")


RAW = [b"", b"\xff\xfe\xfd", b'{"prompt": "\xff\xfe", "max_tokens": 2}',
       b'{"prompt": "\xed\xa0\x80", "max_tokens": 2}',  # a surrogate, UTF-8 encoded
       b'{"prompt": "ok"',
       b"{,}", b"NaN", b"null", b"true", b"5", b"-0.0e-999", b'"ok"', b"[]", b"[1, 2]",
       b"[" * 100_000, b'{"a":' * 50_000, b"\x00" * 64,
       b'{"prompt": "ok", "max_tokens": 2, "deep": ' + b"[" * 900 + b"]" * 900 + b"}",
       json.dumps([PLAIN]).encode(), b"\xef\xbb\xbf" + json.dumps(PLAIN).encode(),
       json.dumps(PLAIN).encode("utf-16"), json.dumps(PLAIN).encode() * 2,
       json.dumps({**PLAIN, "prompt": "x" * (4 * MIB)}).encode()]
CONTENT_TYPES = ["application/json", "application/json; charset=utf-8", "text/plain",
                 "application/x-www-form-urlencoded", "multipart/form-data", None]


@pytest.mark.parametrize("path", sorted(BASES))
def test_raw_bodies(fuzz, path):
    """Bytes that are not UTF-8, not JSON, JSON that is not an object, truncated bodies."""
    valid = json.dumps(BASES[path]).encode()

    @FUZZ
    @given(st.one_of(st.binary(max_size=64), st.sampled_from(RAW),
                     st.text(max_size=40).map(str.encode),
                     JSON.filter(lambda v: not isinstance(v, dict)).map(
                         lambda v: json.dumps(v).encode()),
                     st.integers(0, len(valid)).map(lambda k: valid[:k])),
           st.sampled_from(CONTENT_TYPES))
    def run(raw, content_type):
        fuzz.send(path, raw=raw, content_type=content_type)
    run()
    fuzz.report(f"raw bodies of {path}")


TOKENS = st.one_of(st.integers(0, VOCAB - 1),
                   st.sampled_from([VOCAB, VOCAB + 1, -1, -VOCAB, 2**31, 2**63, 2**70, -(2**70)]))


def test_token_id_prompts(fuzz):
    """Token ids in and out of the vocabulary, negative, huge; no prompt, empty prompts,
    several prompts, prompts at the context length."""
    @FUZZ
    @given(st.one_of(st.lists(TOKENS, max_size=6), st.lists(st.lists(TOKENS, max_size=6),
                                                            max_size=3),
                     st.integers(MAX_MODEL_LEN - 4, MAX_MODEL_LEN + 1).map(lambda k: [5] * k)),
           st.integers(1, 2), st.sampled_from([None, 0, 5]), st.booleans())
    def run(prompt, n, logprobs, stream):
        body = {**PLAIN, "prompt": prompt, "n": n, "logprobs": logprobs, "stream": stream}
        response, error = fuzz.send("/v1/completions", body)
        prompts = prompt if prompt and isinstance(prompt[0], list) else [prompt]
        if not prompt or not all(prompts) or not all(0 <= t < VOCAB for p in prompts for t in p):
            assert response.status_code == 400 and error["param"] == "prompt", error
        elif max(map(len, prompts)) + PLAIN["max_tokens"] > MAX_MODEL_LEN:
            assert response.status_code == 400, error
            assert error["param"] in ("prompt", "max_tokens"), error
        else:
            assert response.status_code == 200
    run()
    fuzz.report("token-id prompts")


ROLES = resolve(SCHEMAS["ChatMessage"]["properties"]["role"])["enum"]
PART = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"])},
                             optional={"text": st.one_of(STRING, st.none())})
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(ROLES)},
    optional={"content": st.one_of(STRING, st.none(), st.lists(PART, max_size=3))})
BAD_ROLES = st.one_of(st.sampled_from(["wizard", "", "USER", " user", None, ["user"]]),
                      st.text(max_size=8), WRONG)
BAD_PARTS = st.one_of(st.fixed_dictionaries({"type": st.one_of(st.just("text"), WRONG),
                                             "text": WRONG}), WRONG)


@st.composite
def messages(draw):
    """Valid messages with at most one defect: a bad role, content or content part, a
    message or the whole list that is junk."""
    out = draw(st.lists(MESSAGE, min_size=1, max_size=3))
    i = draw(st.integers(0, len(out) - 1))
    defect = draw(st.sampled_from(["none", "role", "content", "part", "message", "list"]))
    if defect == "role":
        out[i] = {**out[i], "role": draw(BAD_ROLES)}
    elif defect == "content":
        out[i] = {**out[i], "content": draw(WRONG)}
    elif defect == "part":
        out[i] = {**out[i], "content": [*draw(st.lists(PART, max_size=2)), draw(BAD_PARTS)]}
    elif defect == "message":
        out[i] = draw(WRONG)
    elif defect == "list":
        return draw(WRONG)
    return out


def fits(message) -> bool:
    """Whether the chat schema accepts `message`."""
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        return False
    content = message.get("content")
    if isinstance(content, list):
        return all(isinstance(part, dict) and isinstance(part.get("type"), str)
                   and (part.get("text") is None or unicode(part["text"])) for part in content)
    return content is None or unicode(content)


def unicode(value) -> bool:
    """Whether `value` is a string that UTF-8 can hold (no lone surrogate)."""
    try:
        return isinstance(value, str) and value.encode() is not None
    except UnicodeEncodeError:
        return False


def test_chat_messages(fuzz):
    """Bad roles, contents of every type, content parts with bad texts, lone surrogates; a
    400 names `messages` (or, for a prompt too long, the token limit)."""
    path = "/v1/chat/completions"

    @FUZZ
    @given(messages())
    def run(messages):
        response, error = fuzz.send(path, {**BASES[path], "messages": messages})
        if isinstance(messages, list) and messages and all(map(fits, messages)):
            assert response.status_code == 200 or (
                response.status_code == 400 and "context length" in error["message"]), error
        else:
            assert response.status_code == 413 or (  # 413: a body past 4 MiB
                response.status_code == 400
                and (error["param"] or "").startswith("messages")), error
    run()
    fuzz.report("chat messages")


BOUNDS = [(path, name, value, fit) for path in sorted(BASES)
          for name, schema in sorted(fields(path).items()) for value, fit in edges(schema)]


@pytest.mark.parametrize("path, name, value, fits", BOUNDS)
def test_integers_at_and_past_their_bounds(fuzz, path, name, value, fits):
    """n, max_tokens, logprobs, top_logprobs, ... at their bounds are served, one past is a
    400 naming the field."""
    response, error = fuzz.send(path, {**BASES[path], name: value})
    if fits is True:
        assert response.status_code == 200, error
    elif fits is False:
        assert response.status_code == 400 and error["param"] == name, error


CHAT = BASES["/v1/chat/completions"]
REGRESSIONS = [  # what fuzzing found, with what the server answered before its fix
    ("/v1/completions", {**PLAIN, "top_k": 2**31}, 400, "top_k"),  # 500: int32 overflow
    ("/v1/completions", {**PLAIN, "top_k": 2**70}, 400, "top_k"),  # in the engine step
    ("/v1/completions", {**PLAIN, "prompt": "\ud800"}, 400, "prompt"),  # 500: TypeError in
    ("/v1/completions", {**PLAIN, "prompt": ["ok", "\udfff"]}, 400, "prompt"),  # tokenizer
    ("/v1/completions", {**PLAIN, "model": "\ud800"}, 400, "model"),  # 500: 404 not UTF-8
    ("/v1/completions", {**PLAIN, "temperature": float("nan")}, 400,  # 200: NaN passed
     "temperature"),  # every range check
    ("/v1/completions", {**PLAIN, "repetition_penalty": float("inf")}, 400,
     "repetition_penalty"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "\ud800"}]},
     400, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [
        {"role": "user", "content": [{"type": "text", "text": 5}]}]},  # 500: TypeError
     400, "messages.0.content"),  # joining the parts
    ("/v1/chat/completions", {**CHAT, "messages": [
        {"role": "user", "content": [{"type": "text", "text": None}]}]}, 200, None),  # 500
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x" * 300}]},
     400, "messages"),  # was "prompt"
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 300}, 400,
     "max_completion_tokens"),  # was "max_tokens"
]


@pytest.mark.parametrize("path, body, status, param", REGRESSIONS)
def test_regressions(fuzz, path, body, status, param):
    """Each answers `status`, its `param` starting with `param` (None: no error)."""
    response, error = fuzz.send(path, body)
    assert response.status_code == status, error
    assert (error["param"] or "").startswith(param) if param else not error, error


def test_a_top_k_past_int32_does_not_kill_the_engine(fuzz):
    """It failed the engine step; that many requests in a row made the engine give up."""
    for _ in range(MAX_CONSECUTIVE_FAILURES + 1):
        response, error = fuzz.send("/v1/completions", {**PLAIN, "top_k": 2**31})
        assert response.status_code == 400 and error["param"] == "top_k", error
    fuzz.report("top_k past int32")
