"""Request bodies in (JSON or msgpack, size-limited) and responses out (by the Accept header)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from .. import bodies
from ..contracts import ErrorCode
from ..contracts.wire import JSON, MSGPACK, NestingTooDeep, WireError, loads_json, packb, unpack_request
from .errors import ExchangeFault

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)


async def read_body(request: Request, max_bytes: int) -> bytes:
    try:
        return await bodies.read_body(request, max_bytes)
    except bodies.BodyError as exc:
        raise ExchangeFault(ErrorCode.payload_too_large, str(exc), details={"limit": max_bytes}) from None


def media_type(request: Request) -> str:
    return request.headers.get("content-type", JSON).split(";")[0].strip().lower() or JSON


def decode(body: bytes, content_type: str) -> Any:
    """Plain data from a request body; malformed, ambiguous or too deeply nested bodies are 400."""
    loads: Callable[[bytes], Any]
    if content_type == MSGPACK:
        loads = unpack_request
    elif content_type in (JSON, "text/json") or content_type.endswith("+json"):
        # NaN and Infinity parse, so that such logprobs reach the gate and get their own typed
        # rejection instead of a parse error.
        loads = loads_json
    else:
        raise ExchangeFault(ErrorCode.unsupported_media_type,
                            f"content type {content_type[:100]!r} is not {JSON} or {MSGPACK}")
    try:
        return loads(body)
    except NestingTooDeep as exc:
        raise ExchangeFault(ErrorCode.malformed_body, str(exc), details={"reason": "too_deep"}) from None
    except WireError as exc:
        raise ExchangeFault(ErrorCode.malformed_body, str(exc)) from None


def validate(model: type[M], data: Any) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = [{"loc": [clip(str(p), 64) for p in e.get("loc", ())], "msg": clip(str(e.get("msg")), 500),
                   "type": e.get("type")}
                  for e in exc.errors(include_url=False, include_input=False, include_context=False)]
        first = errors[0] if errors else {"loc": [], "msg": "invalid"}
        where = ".".join(first["loc"]) or "body"
        raise ExchangeFault(
            ErrorCode.invalid_request,
            f"{model.__name__}: {where}: {first['msg']} ({len(errors)} error(s))",
            details={"errors": errors[:20]},
        ) from None


def clip(text: str, limit: int) -> str:
    """Client-chosen text (a map key, a value) quoted back in an error, cut to a readable size."""
    return text if len(text) <= limit else text[:limit - 1] + "…"


async def parse(request: Request, model: type[M], max_bytes: int) -> tuple[M, bytes, str]:
    """The validated model, the raw body and its media type.

    This is the boundary where a client's bytes become a contract: whatever goes wrong in here
    is the client's input, so it is a typed 4xx, never a 500. The expected failures (bad bytes,
    off-contract data) have their own codes; anything else a decoder or validator raises is
    logged with its traceback (so that a gap in the contracts gets noticed and fixed) and answered
    as `invalid_request`.
    """
    body = await read_body(request, max_bytes)
    kind = media_type(request)
    try:
        return validate(model, decode(body, kind)), body, kind
    except ExchangeFault:
        raise
    except Exception as exc:
        log.warning("unexpected %s from a %s body on %s; answered 422", type(exc).__name__,
                    model.__name__, request.url.path, exc_info=True)
        raise ExchangeFault(ErrorCode.invalid_request,
                            f"{model.__name__}: the body could not be read ({type(exc).__name__})") from None


def wants_msgpack(request: Request) -> bool:
    return MSGPACK in request.headers.get("accept", "")


def respond(request: Request, value: BaseModel | Any, status: int = 200) -> Response:
    if wants_msgpack(request):
        return Response(packb(value), status_code=status, media_type=MSGPACK)
    if isinstance(value, BaseModel):
        return Response(value.model_dump_json(), status_code=status, media_type=JSON)
    return Response(json.dumps(value, default=_json_default), status_code=status, media_type=JSON)


def _json_default(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    raise TypeError(f"cannot encode {type(value).__name__}")
