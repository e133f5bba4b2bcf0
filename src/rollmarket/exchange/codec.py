"""Request bodies in (JSON or msgpack, size-limited) and responses out (by the Accept header)."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from ..contracts import ErrorCode
from ..contracts.wire import JSON, MSGPACK, WireError, packb, unpackb
from .errors import ExchangeFault

M = TypeVar("M", bound=BaseModel)


async def read_body(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ExchangeFault(ErrorCode.payload_too_large,
                            f"body of {declared} bytes exceeds the limit of {max_bytes}",
                            details={"limit": max_bytes})
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ExchangeFault(ErrorCode.payload_too_large,
                                f"body exceeds the limit of {max_bytes} bytes", details={"limit": max_bytes})
        chunks.append(chunk)
    return b"".join(chunks)


def media_type(request: Request) -> str:
    return request.headers.get("content-type", JSON).split(";")[0].strip().lower() or JSON


def decode(body: bytes, content_type: str) -> Any:
    if content_type == MSGPACK:
        try:
            return unpackb(body)
        except WireError as exc:
            raise ExchangeFault(ErrorCode.malformed_body, str(exc)) from None
    if content_type in (JSON, "text/json") or content_type.endswith("+json"):
        try:
            # json.loads accepts NaN and Infinity, so that such logprobs reach the gate and get
            # their own typed rejection instead of a parse error.
            return json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ExchangeFault(ErrorCode.malformed_body, f"malformed JSON: {exc}") from None
    raise ExchangeFault(ErrorCode.unsupported_media_type,
                        f"content type {content_type!r} is not {JSON} or {MSGPACK}")


def validate(model: type[M], data: Any) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False, include_context=False)
        first = errors[0] if errors else {"loc": (), "msg": str(exc)}
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        raise ExchangeFault(
            ErrorCode.invalid_request,
            f"{model.__name__}: {where}: {first.get('msg')} ({len(errors)} error(s))",
            details={"errors": [{"loc": [str(p) for p in e.get("loc", ())], "msg": e.get("msg"),
                                 "type": e.get("type")} for e in errors[:20]]},
        ) from None


async def parse(request: Request, model: type[M], max_bytes: int) -> tuple[M, bytes, str]:
    """The validated model, the raw body and its media type."""
    body = await read_body(request, max_bytes)
    kind = media_type(request)
    return validate(model, decode(body, kind)), body, kind


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
