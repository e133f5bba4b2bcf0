"""The capture proxy's OpenAPI document (`GET /openapi.json`).

The proxy forwards any `/v1/*` call, so its own schema describes what it reads on the way: the
generation bodies (the fields it looks at or adds; every other field passes through untouched),
and its own routes. The upstream decides what is valid; its errors reach the client unchanged,
and the proxy's own errors (unreachable or silent upstream, unknown route) are OpenAI-shaped.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from .. import __version__
from ..bodies import OPENAI_ERROR_SCHEMA, add_component_schemas, json_body


class _Generation(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(description="The model the client asks for; recorded as given.")
    stream: bool = Field(False, description="Server-sent events; each event passes through as it arrives.")
    n: int = Field(1, ge=1, le=64)
    max_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    return_token_ids: bool = Field(False, description="Added (and stripped from the answer) when left out.")
    return_routed_experts: bool = Field(False, description="Added (and stripped from the answer) when left out.")


class ChatCall(_Generation):
    """Body of POST /v1/chat/completions as the proxy reads it."""

    messages: list[dict[str, Any]] = Field(min_length=1, description="Hashed to link the turns of a conversation.")
    tools: list[dict[str, Any]] | None = None
    logprobs: bool = Field(False, description="Added as true when left out.")
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionCall(_Generation):
    """Body of POST /v1/completions as the proxy reads it."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20, description="Added as 0 when left out.")


class ResponsesCall(_Generation):
    """Body of POST /v1/responses as the proxy reads it."""

    input: str | list[dict[str, Any]] = Field(description="A user message, or a list of input items.")
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    previous_response_id: str | None = Field(
        None, description="Links the capture to the one whose answer had this id (the upstream keeps the turns).")
    store: bool | None = Field(None, description="`false`: the upstream keeps no turns, and no call may link to this one.")


_ERROR_SCHEMA: dict[str, Any] = copy.deepcopy(OPENAI_ERROR_SCHEMA)
_ERROR_SCHEMA["properties"]["error"]["required"] = ["message", "type"]  # an upstream's may leave param, code out


def _errors(*statuses: int) -> dict[str, Any]:
    text = {400: "The upstream's refusal, passed through", 404: "Unknown route (the proxy's own, or the upstream's)",
            405: "Method not allowed", 422: "The upstream's refusal, passed through",
            502: "The upstream is unreachable or broke off", 504: "The upstream did not answer in time"}
    return {str(s): {"description": text[s], "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/OpenAIErrorBody"}}}} for s in statuses}


def proxy_openapi() -> dict[str, Any]:
    """The document: the proxy's own routes and the generation calls it records."""
    generation = _errors(400, 404, 422, 502, 504)
    ok = {"200": {"description": "The upstream's answer (extras the proxy added are stripped)"}}
    schema: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "rollmarket capture proxy", "version": __version__,
                 "description": "Forwards every /v1/* call to the upstream and records the generation calls."},
        "paths": {
            "/healthz": {"get": {"summary": "Liveness", "operationId": "healthz",
                                 "responses": {"200": {"description": "status, version, time"}}}},
            "/proxy/status": {"get": {"summary": "Counters and settings", "operationId": "proxy_status",
                                      "responses": {"200": {"description": "calls, outcomes, store counters"}}}},
            "/v1/models": {"get": {"summary": "Forwarded byte for byte, not recorded", "operationId": "models",
                                   "responses": {**ok, **_errors(502, 504)}}},
            "/v1/chat/completions": {"post": {
                "summary": "Chat, recorded", "operationId": "chat_completions",
                **json_body(ChatCall), "responses": {**ok, **generation}}},
            "/v1/completions": {"post": {
                "summary": "Completions, recorded", "operationId": "completions",
                **json_body(CompletionCall), "responses": {**ok, **generation}}},
            "/v1/responses": {"post": {
                "summary": "Responses, recorded", "operationId": "responses",
                **json_body(ResponsesCall), "responses": {**ok, **generation}}},
        },
    }
    add_component_schemas(schema, [ChatCall, CompletionCall, ResponsesCall])
    schema["components"]["schemas"]["OpenAIErrorBody"] = _ERROR_SCHEMA
    return schema
