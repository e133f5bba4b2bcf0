"""Request bodies of the HTTP services: a bounded read, one JSON parse with limits, and their
OpenAPI entries.

Every service reads its bodies itself (each answers in its own error shape, and the proxy forwards
bytes), through the same two steps, which turn every way a body can be unusable into one typed
`BodyError` instead of an exception deep inside a route:

* `read_body`: at most a limit of bytes, refused from the declared Content-Length or while
  streaming, before it is buffered (`BodyProblem.too_large`);
* `parse_json`: the contracts' decoder (`contracts.wire.loads_json`): not JSON or not UTF-8
  (`not_json`), nested deeper than `contracts.limits.MAX_DEPTH` (`too_deep`, found on the bytes
  before the recursive parser runs), or a string with a lone UTF-16 surrogate (`lone_surrogate`:
  valid JSON text but not Unicode, refused later by tokenizers, file systems and UTF-8 encoders).

Routes that read the raw request have no body in FastAPI's generated schema; `json_body` gives
them their real one (`openapi_extra`), and `add_component_schemas` puts the models it refers to
into the document.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request

from .contracts.limits import MAX_DEPTH
from .contracts.wire import JSON, LoneSurrogate, NestingTooDeep, WireError, loads_json

OPENAI_ERROR_SCHEMA: dict[str, Any] = {
    "title": "OpenAIErrorBody", "type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
"""OpenAI's error body, which the model server's (and the proxy's own) 4xx and 5xx carry."""


class BodyProblem(str, Enum):
    too_large = "too_large"
    not_json = "not_json"
    too_deep = "too_deep"
    lone_surrogate = "lone_surrogate"


class BodyError(ValueError):
    """A request body that cannot be read; `problem` says why."""

    def __init__(self, problem: BodyProblem, message: str):
        super().__init__(message)
        self.problem = problem


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, or BodyError(too_large) as soon as it is known to exceed `limit` bytes:
    from its Content-Length, or while it streams in (chunked bodies), never after buffering it."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise BodyError(BodyProblem.too_large, f"body of {declared} bytes exceeds the limit of {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyError(BodyProblem.too_large, f"body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(body: bytes | str) -> Any:
    """The JSON value of a request body, or a `BodyError` saying why it cannot be read. Objects may
    repeat a key (the last wins, as in OpenAI-compatible servers); the exchange's stricter
    decoding calls `loads_json` directly."""
    try:
        return loads_json(body, unique_keys=False)
    except NestingTooDeep:
        raise BodyError(BodyProblem.too_deep, f"the body is nested deeper than {MAX_DEPTH} levels") from None
    except LoneSurrogate:
        raise BodyError(BodyProblem.lone_surrogate,
                        "the body has a string with a lone UTF-16 surrogate escape (not Unicode text)") from None
    except WireError as exc:
        raise BodyError(BodyProblem.not_json, f"the body is not valid JSON: {exc}") from None


def json_body(model: type[BaseModel], *, required: bool = True, description: str | None = None,
              media_types: tuple[str, ...] = (JSON,)) -> dict[str, Any]:
    """`openapi_extra` for a route that reads its body itself: the body is `model` in each of
    `media_types` (JSON by default; the exchange also takes msgpack)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    body: dict[str, Any] = {"required": required, "content": {kind: {"schema": ref} for kind in media_types}}
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
