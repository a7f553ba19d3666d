"""`StructuredOutputsParams`: what a request's output must match, from the Python API or
the HTTP fields (OpenAI's `response_format`, vLLM's `structured_outputs`, `guided_*`).

Only shapes are checked here; whether a regex, schema or grammar compiles is checked by
`GrammarCompiler.compile`.
"""

from __future__ import annotations

import dataclasses
import json as jsonlib
from typing import Any

from jaxserve.errors import InvalidRequestError

KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _checked(kind: str, value: Any, field: str) -> Any:
    """`value` of constraint `kind` as it is stored (a schema's JSON text parsed to a dict);
    InvalidRequestError naming `field` when its shape is wrong."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = jsonlib.loads(value)
            except ValueError as err:
                raise InvalidRequestError(field, f"the JSON schema is not valid JSON: {err}") \
                    from None
        if not isinstance(value, dict):
            raise InvalidRequestError(field, "the JSON schema must be a JSON object, got "
                                      f"{type(value).__name__}")
        try:
            jsonlib.dumps(value, sort_keys=True)
        except (TypeError, ValueError) as err:
            raise InvalidRequestError(field, f"the JSON schema is not JSON: {err}") from None
        return value
    if kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise InvalidRequestError(field, f"the {kind} must be a non-empty string, got "
                                      f"{value!r}")
        return value
    if kind == "choice":
        if (not isinstance(value, (list, tuple)) or not value
                or not all(isinstance(c, str) for c in value)):
            raise InvalidRequestError(field, f"choice must be a non-empty list of strings, got "
                                      f"{value!r}")
        return list(value)
    if not isinstance(value, bool):
        raise InvalidRequestError(field, f"json_object must be true or false, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's StructuredOutputsParams: exactly one of the fields is set.

    json: a JSON schema, a dict or its JSON text (stored parsed, as a dict). regex: the whole
    output matches it. choice: the output is exactly one of these strings. grammar: Lark
    (llguidance's dialect) or GBNF, told apart as the package docstring says. json_object:
    any JSON object (OpenAI's `response_format` json_object).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self):
        for kind in KINDS:
            value = getattr(self, kind)
            if value is not None:
                object.__setattr__(self, kind, _checked(kind, value, "structured_outputs"))
        given = [k for k in KINDS[:-1] if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise InvalidRequestError("structured_outputs", "set exactly one of "
                                      f"{', '.join(KINDS)}; got {given or 'none'}")

    @property
    def kind(self) -> str:
        """The field that is set."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> str:
        """Canonical text identifying the grammar: equal specs, equal keys."""
        return jsonlib.dumps({self.kind: getattr(self, self.kind)}, sort_keys=True)

    @classmethod
    def from_request(cls, *, response_format: dict | None = None,
                     structured_outputs: dict | None = None, guided_json=None,
                     guided_regex=None, guided_choice=None, guided_grammar=None,
                     ) -> StructuredOutputsParams | None:
        """From the HTTP fields: OpenAI's `response_format` ({"type": "text"} is no
        constraint; "json_object"; "json_schema" with {"name", "schema", "strict"}), vLLM's
        `structured_outputs` ({"json"|"regex"|"choice"|"grammar": ..., or "json_object": true})
        and the older guided_json / guided_regex / guided_choice / guided_grammar. None when
        none is given. Errors name the field: the first of two given ("response_format"), or
        the bad part ("response_format.json_schema.schema", "structured_outputs.choice",
        "guided_regex", ...)."""
        found: list[tuple[str, str, Any]] = []  # (request field, kind, checked value)
        if response_format is not None:
            found += _from_response_format(response_format)
        if structured_outputs is not None:
            if not isinstance(structured_outputs, dict):
                raise InvalidRequestError("structured_outputs", "structured_outputs must be an "
                                          f"object, got {structured_outputs!r}")
            unknown = sorted(set(structured_outputs) - set(KINDS))
            if unknown:
                raise InvalidRequestError(f"structured_outputs.{unknown[0]}", "not supported; "
                                          f"structured_outputs takes one of {', '.join(KINDS)}")
            given = [(k, v) for k, v in structured_outputs.items() if v not in (None, False)]
            if len(given) != 1:
                raise InvalidRequestError("structured_outputs", "set exactly one of "
                                          f"{', '.join(KINDS)}; got {[k for k, _ in given]}")
            kind, value = given[0]
            found.append(("structured_outputs", kind,
                          _checked(kind, value, f"structured_outputs.{kind}")))
        for kind, value in (("json", guided_json), ("regex", guided_regex),
                            ("choice", guided_choice), ("grammar", guided_grammar)):
            if value is not None:
                found.append((f"guided_{kind}", kind, _checked(kind, value, f"guided_{kind}")))
        if not found:
            return None
        if len(found) > 1:
            raise InvalidRequestError(found[0][0], "give one output constraint, not several: "
                                      f"{', '.join(f for f, _, _ in found)}")
        _, kind, value = found[0]
        return cls(**{kind: value})


def _from_response_format(fmt: Any) -> list[tuple[str, str, Any]]:
    """The constraint OpenAI's `response_format` asks for: [] for text, else one entry."""
    if not isinstance(fmt, dict):
        raise InvalidRequestError("response_format", f"response_format must be an object, got "
                                  f"{fmt!r}")
    kind = fmt.get("type")
    if kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", "json_object", True)]
    if kind != "json_schema":
        raise InvalidRequestError("response_format.type", "response_format.type must be "
                                  f"'text', 'json_object' or 'json_schema', got {kind!r}")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequestError("response_format.json_schema", "response_format.json_schema "
                                  "must be an object with a 'schema'")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise InvalidRequestError("response_format.json_schema.schema", "the JSON schema must "
                                  f"be a JSON object, got {schema!r}")
    return [("response_format", "json",
             _checked("json", schema, "response_format.json_schema.schema"))]
