"""The base every contract derives from, and the small helpers contracts share."""

from __future__ import annotations

import json
import secrets
from datetime import datetime, timezone
from typing import Annotated, Any

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, StringConstraints

CONTRACT_VERSION = "rollmarket.contracts/1"
"""Bumped when a wire-visible change breaks old peers; workers and exchanges compare it."""

Sha256Hex = Annotated[str, StringConstraints(min_length=64, max_length=64, pattern=r"^[0-9a-f]{64}$")]
"""A lowercase sha256 digest in hex."""

ID_PATTERN = r"^[A-Za-z0-9_.:\-]+$"
ID_MAX_LENGTH = 128
Identifier = Annotated[str, StringConstraints(min_length=1, max_length=ID_MAX_LENGTH, pattern=ID_PATTERN)]
"""Ids that travel in URLs and logs: letters, digits and `_ . : -`."""


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


def _as_utc(value: datetime) -> datetime:
    # Naive datetimes are taken to be UTC so that a timestamp hashes the same on every host.
    if value.tzinfo is None:
        return value.replace(tzinfo=timezone.utc)
    try:
        return value.astimezone(timezone.utc)
    except OverflowError:  # 0001-01-01T00:00+05:00 has no UTC time; a validation error, not a crash
        raise ValueError("the time lies outside the years 1-9999 in UTC") from None


UtcDatetime = Annotated[datetime, AfterValidator(_as_utc)]


def new_id(prefix: str) -> str:
    """A random id such as ``job_3f9c...``; 96 bits keeps collisions out of reach."""
    return f"{prefix}_{secrets.token_hex(12)}"


def canonical_json(value: Any) -> bytes:
    """Sorted keys, no whitespace, no NaN: the bytes that hashes are taken over."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()


def _values_equal(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
            return False
        return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_values_equal(x, y) for x, y in zip(a, b))
    return a == b


class Record(BaseModel):
    """A frozen contract: unknown fields are an error, floats must be finite."""

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        allow_inf_nan=False,
        use_enum_values=False,
        ser_json_timedelta="float",
        ser_json_inf_nan="constants",
    )

    def __eq__(self, other: object) -> bool:
        # pydantic's default equality compares field dicts, which numpy arrays turn ambiguous.
        if type(self) is not type(other):
            return NotImplemented
        return all(
            _values_equal(getattr(self, name), getattr(other, name))
            for name in type(self).model_fields
        )

    __hash__ = None  # type: ignore[assignment]
