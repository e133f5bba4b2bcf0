"""Bearer tokens: workers get one at registration (stored only as a hash), trainers share one."""

from __future__ import annotations

import hashlib
import hmac
import secrets

from ..contracts import ErrorCode
from .errors import ExchangeFault

WORKER_PREFIX = "rmw."


def new_worker_token(worker_id: str) -> tuple[str, str]:
    """A fresh token for `worker_id` and the hash the exchange keeps of it."""
    secret = secrets.token_urlsafe(32)
    return f"{WORKER_PREFIX}{worker_id}.{secret}", hash_secret(secret)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def split_worker_token(token: str) -> tuple[str, str] | None:
    """(worker_id, secret) of a worker token, or None when it is not shaped like one."""
    if not token.startswith(WORKER_PREFIX):
        return None
    worker_id, dot, secret = token[len(WORKER_PREFIX):].rpartition(".")
    if not dot or not worker_id or not secret:
        return None
    return worker_id, secret


def worker_from_token(token: str | None, hashes: dict[str, str]) -> str | None:
    """The worker a token belongs to, compared in constant time; None when it matches none."""
    if token is None:
        return None
    parts = split_worker_token(token)
    if parts is None:
        return None
    worker_id, secret = parts
    # Compare against a dummy when the worker is unknown so that timing does not reveal ids.
    expected = hashes.get(worker_id, "0" * 64)
    if hmac.compare_digest(expected.encode(), hash_secret(secret).encode()) and worker_id in hashes:
        return worker_id
    return None


def is_trainer(token: str | None, trainer_token: str) -> bool:
    return token is not None and bool(trainer_token) and hmac.compare_digest(
        token.encode(), trainer_token.encode()
    )


def unauthorized(message: str = "missing or invalid bearer token") -> ExchangeFault:
    return ExchangeFault(ErrorCode.unauthorized, message)


def forbidden(message: str) -> ExchangeFault:
    return ExchangeFault(ErrorCode.forbidden, message)
