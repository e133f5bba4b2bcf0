"""JSON request bodies of the HTTP services: one parse with limits, and their OpenAPI entries.

The model server, the capture proxy and the resources server read their bodies themselves (they
answer in their own error shapes, and the proxy forwards bytes). They all parse through
`parse_json`, which turns every way a body can be unreadable into one typed `BodyError` instead
of an exception deep inside a route:

* not JSON, or not UTF-8 (`BodyProblem.not_json`);
* nested deeper than `MAX_JSON_DEPTH` (`too_deep`): Python's parser recurses and would raise
  `RecursionError` near 1,000 levels, and msgpack, Jinja templates and pydantic all have their own
  limits below or near that, so the limit is applied once, at the door;
* strings with a lone UTF-16 surrogate (`lone_surrogate`): JSON's `\\ud800` escape is valid JSON
  text but not Unicode, and tokenizers, file systems and UTF-8 encoders refuse it later.

Routes that read the raw request have no body in FastAPI's generated schema; `json_body` gives
them their real one (`openapi_extra`), and `add_component_schemas` puts the models it refers to
into the document.
"""

from __future__ import annotations

import json
import re
from enum import Enum
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

MAX_JSON_DEPTH = 64
"""Most levels of nested arrays and objects in a request body (the body itself is level 1)."""

_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
"""A `\\uD800`–`\\uDFFF` escape, or the bytes of a surrogate (which `json.loads` decodes with
`surrogatepass`): the ways a body can carry one."""


class BodyProblem(str, Enum):
    not_json = "not_json"
    too_deep = "too_deep"
    lone_surrogate = "lone_surrogate"


class BodyError(ValueError):
    """A request body that cannot be read; `problem` says why."""

    def __init__(self, problem: BodyProblem, message: str):
        super().__init__(message)
        self.problem = problem


def nesting_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """Levels of nested lists and dicts in `value` (a scalar is 0), counted up to `limit` + 1.

    Iterative, so a structure deeper than the interpreter's recursion limit is measured too."""
    if not isinstance(value, (dict, list)):
        return 0
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > deepest:
            deepest = depth
            if deepest > limit:
                return deepest
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def _has_lone_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def parse_json(body: bytes | str, *, max_depth: int = MAX_JSON_DEPTH, allow_surrogates: bool = False) -> Any:
    """The JSON value of a request body, or a `BodyError` saying why it cannot be read.

    Strings are checked for lone surrogates only when the text has a surrogate escape at all, so
    ordinary bodies pay one regex scan for it."""
    try:
        value = json.loads(body)
    except RecursionError:
        raise BodyError(BodyProblem.too_deep, f"the body is nested deeper than {max_depth} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise BodyError(BodyProblem.not_json, f"the body is not valid JSON: {exc}") from None
    if nesting_depth(value, max_depth) > max_depth:
        raise BodyError(BodyProblem.too_deep, f"the body is nested deeper than {max_depth} levels")
    raw = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
    if not allow_surrogates and _SURROGATE.search(raw) and _has_lone_surrogate(value):
        raise BodyError(BodyProblem.lone_surrogate,
                        "the body has a string with a lone UTF-16 surrogate escape (not Unicode text)")
    return value


def json_body(model: type[BaseModel], *, required: bool = True, description: str | None = None) -> dict[str, Any]:
    """`openapi_extra` for a route that reads its body itself: the body is `model` as JSON."""
    body: dict[str, Any] = {"required": required,
                            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    if description:
        body["description"] = description
    return {"requestBody": body}


def add_component_schemas(schema: dict[str, Any], models: list[type[BaseModel]]) -> dict[str, Any]:
    """Put the validation schemas of `models` (and the models they use) into `schema`'s components."""
    _, defs = models_json_schema([(m, "validation") for m in models], ref_template="#/components/schemas/{model}")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name, model_schema in defs.get("$defs", {}).items():
        components.setdefault(name, model_schema)
    return schema
