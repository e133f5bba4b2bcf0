"""Typed failures raised inside the exchange; the HTTP layer turns each into an ErrorBody."""

from __future__ import annotations

from typing import Any

from ..contracts import ErrorBody, ErrorCode, ErrorDetail
from ..contracts.limits import MAX_MESSAGE_LENGTH

STATUS_OF = {
    ErrorCode.malformed_body: 400,
    ErrorCode.invalid_request: 422,
    ErrorCode.unsupported_media_type: 415,
    ErrorCode.payload_too_large: 413,
    ErrorCode.unauthorized: 401,
    ErrorCode.forbidden: 403,
    ErrorCode.not_found: 404,
    ErrorCode.rejected: 422,
    ErrorCode.idempotency_conflict: 409,
    ErrorCode.version_conflict: 409,
    ErrorCode.digest_mismatch: 409,
    ErrorCode.worker_exists: 409,
    ErrorCode.lease_not_active: 409,
    ErrorCode.internal: 500,
    ErrorCode.store_unavailable: 503,
}


class ExchangeFault(Exception):
    """A request the exchange refuses, with the code and reasons the client will see."""

    def __init__(self, code: ErrorCode, message: str, *, reasons: list[str] | None = None,
                 details: dict[str, Any] | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.reasons = reasons or []
        self.details = details or {}

    @property
    def status(self) -> int:
        return STATUS_OF[self.code]

    def body(self) -> ErrorBody:
        message = self.message if len(self.message) <= MAX_MESSAGE_LENGTH else self.message[:MAX_MESSAGE_LENGTH - 1] + "…"
        return ErrorBody(error=ErrorDetail(code=self.code, message=message,
                                           reasons=self.reasons, details=self.details))
