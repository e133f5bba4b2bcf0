"""Typed errors the clients raise; each carries the exchange's code, message and reasons."""

from __future__ import annotations

from typing import Any

from ..contracts import ErrorCode, RejectionReason


class ExchangeError(Exception):
    """Any refusal or failure talking to the exchange."""

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None,
                 reasons: list[str] | None = None, details: dict[str, Any] | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.reasons = reasons or []
        self.details = details or {}

    def __str__(self) -> str:
        head = f"[{self.status} {self.code}] " if self.status else ""
        tail = f" (reasons: {', '.join(self.reasons)})" if self.reasons else ""
        return f"{head}{self.message}{tail}"


class ExchangeUnavailable(ExchangeError):
    """The exchange could not be reached, or kept answering 5xx, within the retries."""


class ExchangeUnreachable(ExchangeUnavailable):
    """The exchange did not answer at all within the time a process waits for it at start."""

    fix = ("start it (`rollmarket exchange serve`), or point the worker's --exchange or the trainer's "
           "exchange.url at it")
    """How to fix it, for the CLI's one-line error."""


class InvalidRequest(ExchangeError):
    """The request was malformed or did not fit the contract (400, 415, 422)."""


class Unauthorized(ExchangeError):
    """Missing or wrong token (401)."""


class Forbidden(ExchangeError):
    """The token is valid but not for this resource (403)."""


class NotFound(ExchangeError):
    """(404)"""


class Conflict(ExchangeError):
    """An idempotency, version or state conflict (409)."""


class DigestMismatch(Conflict):
    """A reload ack's digest contradicts the published manifest (409 digest_mismatch)."""


class PayloadTooLarge(ExchangeError):
    """(413)"""


class Rejected(ExchangeError):
    """The gate refused a submission; `rejection_reasons` says why."""

    @property
    def rejection_reasons(self) -> list[RejectionReason]:
        known = {reason.value for reason in RejectionReason}  # a newer exchange may send reasons this client lacks
        return [RejectionReason(r) for r in self.reasons if r in known]


class ServerError(ExchangeError):
    """The exchange failed (5xx)."""


class IntegrityError(ExchangeError):
    """A fetched group's content does not match its content hash."""


_BY_CODE: dict[str, type[ExchangeError]] = {
    ErrorCode.malformed_body.value: InvalidRequest,
    ErrorCode.invalid_request.value: InvalidRequest,
    ErrorCode.unsupported_media_type.value: InvalidRequest,
    ErrorCode.payload_too_large.value: PayloadTooLarge,
    ErrorCode.unauthorized.value: Unauthorized,
    ErrorCode.forbidden.value: Forbidden,
    ErrorCode.not_found.value: NotFound,
    ErrorCode.rejected.value: Rejected,
    ErrorCode.idempotency_conflict.value: Conflict,
    ErrorCode.version_conflict.value: Conflict,
    ErrorCode.worker_exists.value: Conflict,
    ErrorCode.lease_not_active.value: Conflict,
    ErrorCode.digest_mismatch.value: DigestMismatch,
    ErrorCode.internal.value: ServerError,
    ErrorCode.store_unavailable.value: ExchangeUnavailable,
}
_BY_STATUS = {400: InvalidRequest, 401: Unauthorized, 403: Forbidden, 404: NotFound, 409: Conflict,
              413: PayloadTooLarge, 415: InvalidRequest, 422: InvalidRequest}


def error_for(status: int, body: Any) -> ExchangeError:
    """The typed error for an HTTP error response (body already parsed, or None)."""
    detail = body.get("error") if isinstance(body, dict) else None
    if isinstance(detail, dict):
        code = str(detail.get("code", ""))
        cls = _BY_CODE.get(code) or _BY_STATUS.get(status) or (ServerError if status >= 500 else ExchangeError)
        return cls(str(detail.get("message", "")), status=status, code=code,
                   reasons=list(detail.get("reasons") or []), details=dict(detail.get("details") or {}))
    cls = _BY_STATUS.get(status) or (ServerError if status >= 500 else ExchangeError)
    return cls(f"HTTP {status}", status=status)
