"""HTTP clients for workers and trainers (httpx; no torch)."""

from .errors import (
    Conflict,
    DigestMismatch,
    ExchangeError,
    ExchangeUnavailable,
    ExchangeUnreachable,
    Forbidden,
    IntegrityError,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    Rejected,
    ServerError,
    Unauthorized,
)
from .trainer import TrainerClient
from .worker import WorkerClient

__all__ = [name for name in dir() if not name.startswith("_")]
