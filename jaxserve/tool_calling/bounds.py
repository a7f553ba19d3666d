"""Bounds for what a function's parameters schema leaves unbounded, so a forced call ends.

A `"required"` or named tool choice makes the model write arguments whatever it would rather
write. A model that cannot call tools then never picks the token that closes a string or a
number: with `{"type": "string"}` it writes until `max_tokens`, and the reply ends cut, with
arguments that do not parse. `bounded(schema)` returns a copy of the schema with a bound
added wherever the schema sets none, through keywords llguidance enforces:

| what | bound added | unless the schema sets |
|---|---|---|
| a string | `maxLength` 256 (or its `minLength`) | `maxLength`, `enum`, `const` |
| an integer or number | `minimum`/`maximum` ±(2**53 - 1), JSON's safe integers | either |
| a number's fraction | `multipleOf` 1e-6: at most 6 decimals | `multipleOf` |
| an array | `maxItems` 16 (or its `minItems`); untyped items as below | `maxItems` |
| an object listing properties | no extra keys (`additionalProperties: false`) | - |
| an object listing none (a map) | 16 keys of at most 64 characters | `maxProperties` |
| a value of any type (`{}`, `true`) | a bounded scalar, or a flat list or map of them | a type |

The schema's own bounds always win: a bound is added only where none is set, never
tightened, and never below the matching minimum. Extra keys beside listed properties are
dropped because llguidance can neither count them nor bound their names (`propertyNames` is
not implemented); the model writes the properties the function declares, as OpenAI's strict
mode requires. Recursive `$ref`s still nest without end.
"""

from __future__ import annotations

import copy
from typing import Any

MAX_LENGTH = 256  # characters of a string
MAX_MAGNITUDE = 2**53 - 1  # integers JSON carries exactly (RFC 7493)
MULTIPLE_OF = 1e-6  # a number's smallest step: 6 decimals
MAX_ITEMS = 16  # entries of an array
MAX_PROPERTIES = 16  # keys of an object that lists none (a map)
MAX_KEY_LENGTH = 64  # characters of such a key

_SCALAR = {"type": ["null", "boolean", "number", "string"], "maxLength": MAX_LENGTH,
           "minimum": -MAX_MAGNITUDE, "maximum": MAX_MAGNITUDE, "multipleOf": MULTIPLE_OF}
_ANY = {"anyOf": [_SCALAR,
                  {"type": "array", "items": _SCALAR, "maxItems": MAX_ITEMS},
                  {"type": "object", "patternProperties": {f"^.{{0,{MAX_KEY_LENGTH}}}$": _SCALAR},
                   "additionalProperties": False, "maxProperties": MAX_PROPERTIES}]}
_COMBINATORS = ("anyOf", "oneOf", "allOf", "$ref", "enum", "const", "not", "if")
_INFERRED = (("object", ("properties", "additionalProperties", "required")),
             ("array", ("items", "prefixItems", "minItems")),
             ("string", ("minLength", "pattern", "format")),
             ("number", ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")))


def bounded(schema: dict) -> dict:
    """A copy of `schema` (a JSON schema) with the bounds of the module docstring added."""
    return _bound(copy.deepcopy(schema))


def _bound(node: Any) -> Any:
    """`node` (a subschema, modified in place) bounded; `true` becomes a bounded any-value."""
    if node is True:
        return copy.deepcopy(_ANY)
    if not isinstance(node, dict):
        return node
    for key in ("properties", "$defs", "definitions"):
        if isinstance(node.get(key), dict):
            node[key] = {name: _bound(sub) for name, sub in node[key].items()}
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(node.get(key), list):
            node[key] = [_bound(sub) for sub in node[key]]
    if isinstance(node.get("items"), list):  # draft 4-2019 tuples
        node["items"] = [_bound(sub) for sub in node["items"]]
    types = _types(node)
    if types is None:
        return {**copy.deepcopy(_ANY), **node}
    if "string" in types and not {"maxLength", "enum", "const"} & node.keys():
        node["maxLength"] = max(MAX_LENGTH, node.get("minLength", 0))
    if {"integer", "number"} & types:
        _bound_numbers(node, "number" in types)
    if "array" in types:
        node["items"] = _bound(node.get("items", True))
        if "maxItems" not in node:
            node["maxItems"] = max(MAX_ITEMS, node.get("minItems", 0))
    if "object" in types:
        _bound_object(node)
    return node


def _types(node: dict) -> set[str] | None:
    """The JSON types `node` may be: its `type`, else those its keywords imply; an empty set
    when its combinators or `enum` decide; None when it allows any value."""
    kind = node.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return set(kind)
    implied = {name for name, keys in _INFERRED if any(k in node for k in keys)}
    if implied or any(k in node for k in _COMBINATORS):
        return implied
    return None


def _bound_numbers(node: dict, fractional: bool) -> None:
    """Add the missing end of the range, beyond the other end if that is already far out;
    and a number's step."""
    if {"enum", "const"} & node.keys():
        return
    low = node.get("minimum", node.get("exclusiveMinimum"))
    high = node.get("maximum", node.get("exclusiveMaximum"))
    if high is None:
        node["maximum"] = MAX_MAGNITUDE if low is None or low < MAX_MAGNITUDE \
            else low + MAX_MAGNITUDE
    if low is None:
        node["minimum"] = -MAX_MAGNITUDE if high is None or high > -MAX_MAGNITUDE \
            else high - MAX_MAGNITUDE
    if fractional and "multipleOf" not in node:
        node["multipleOf"] = MULTIPLE_OF


def _bound_object(node: dict) -> None:
    """Bound the extra keys of an object open to them. One that lists its properties is
    closed (llguidance can neither count nor name-bound extra keys beside listed ones); a map
    (no listed properties) takes keys of at most MAX_KEY_LENGTH characters, MAX_PROPERTIES of
    them, each value bounded."""
    extra = node.get("additionalProperties", True)
    if extra is False:
        return
    if "properties" in node or "patternProperties" in node:
        node["additionalProperties"] = False
        return
    node["patternProperties"] = {f"^.{{0,{MAX_KEY_LENGTH}}}$": _bound(extra)}
    node["additionalProperties"] = False
    if "maxProperties" not in node:
        node["maxProperties"] = max(MAX_PROPERTIES, node.get("minProperties", 0))
