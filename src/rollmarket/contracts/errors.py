"""Errors as data: every 4xx/5xx from the exchange carries one of these bodies."""

from __future__ import annotations

from enum import Enum
from pydantic import Field

from .base import Record
from .limits import MAX_NAMES, JsonObject, Message, Name


class ErrorCode(str, Enum):
    malformed_body = "malformed_body"
    """The body is not valid JSON or msgpack (400)."""
    invalid_request = "invalid_request"
    """The body parsed but does not fit the contract (422)."""
    unsupported_media_type = "unsupported_media_type"
    payload_too_large = "payload_too_large"
    unauthorized = "unauthorized"
    """No credentials, or wrong ones (401)."""
    forbidden = "forbidden"
    """Valid credentials, but not for this resource (403)."""
    not_found = "not_found"
    rejected = "rejected"
    """A submission failed validation; `reasons` holds RejectionReason values (422)."""
    idempotency_conflict = "idempotency_conflict"
    """A different payload under an idempotency key already used (409)."""
    version_conflict = "version_conflict"
    """A policy version that is not newer than the last, or differs from a stored one (409)."""
    digest_mismatch = "digest_mismatch"
    """A reload ack whose digest differs from the published manifest or another ack (409)."""
    worker_exists = "worker_exists"
    lease_not_active = "lease_not_active"
    """The lease was already submitted, failed, expired or abandoned (409)."""
    internal = "internal"
    upstream_error = "upstream_error"
    """A server this one depends on (a model server, a resources server) failed or could not be reached (502)."""
    store_unavailable = "store_unavailable"
    """The exchange's database could not be reached, or went away mid-write (503): try again, here
    or on another replica; an idempotent call finds what an earlier try wrote."""


class ErrorDetail(Record):
    code: ErrorCode
    message: Message
    reasons: list[Name] = Field(default_factory=list, max_length=MAX_NAMES)
    details: JsonObject = Field(default_factory=dict)


class ErrorBody(Record):
    error: ErrorDetail
