"""Bounds on every value a contract holds: what SQLite and msgpack can store, and sane domain maxima.

A number or string beyond these is refused when the contract is validated (422 at the exchange),
never later, where it would break a SQLite bind (OverflowError), a msgpack encode or every lease
of a worker. docs/contracts.md has the table; `tests/test_contract_limits.py` walks every
contract's JSON Schema and fails on an integer without both bounds, a string without a maximum
length, or a list or map without a maximum size.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Annotated, Any

from pydantic import AfterValidator, Field, StringConstraints
from pydantic_core import PydanticCustomError

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
"""What a SQLite INTEGER and a msgpack signed integer hold."""

MAX_VERSION = 2**31 - 1
"""Policy versions (a trainer's step counter) and anything counted in versions (lag, staleness)."""
MAX_COUNT = 2**31 - 1
"""Counts and indices: attempts, acks, workers, served counts, sample and turn indices."""
MAX_TOKENS = 2**24
"""Context sizes, max_tokens, token positions and the token axis of arrays (16,777,216)."""
MAX_GROUP_SIZE = 1024
"""Samples in one group, and a worker's concurrent groups."""
MAX_LAYERS = 1024
"""MoE layers and top-k experts: the two inner axes of routed_experts."""
MAX_DEVICES = 65_536
MAX_PRIORITY = 2**31 - 1
"""Job priorities lie in [-MAX_PRIORITY, MAX_PRIORITY]."""

MAX_NAME_LENGTH = 128
"""Names: engines, versions, devices, precision and quantization classes, regions, verifiers, tools."""
MAX_KEY_LENGTH = 256
"""Opaque keys: fingerprints, idempotency keys, conversation ids, base64 keys and signatures."""
MAX_URL_LENGTH = 4096
MAX_MESSAGE_LENGTH = 4096
"""Error and failure messages."""
MAX_TEXT_LENGTH = 1_000_000
"""Free text: prompts, message contents, answers, tool output, reasoning."""
MAX_NAMES = 256
"""Items of a list of names or keys (precisions, tokenizers, engines, tools, stop strings, lease ids)."""
MAX_ITEMS = 10_000
"""Items of any other list or map (messages, steps, turn boundaries, reward components, JSON containers)."""
MAX_JSON_ITEMS = MAX_TOKENS
"""Items of one list or map inside free-form JSON data (a completions prompt may be token ids)."""
MAX_DEPTH = 64
"""Nesting of a whole request body (JSON or msgpack), refused before anything recurses into it."""
MAX_JSON_DEPTH = 32
"""Nesting inside one free-form JSON field (a task's answer, metadata, verifier args, messages)."""

Version = Annotated[int, Field(ge=0, le=MAX_VERSION)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
TokenCount = Annotated[int, Field(ge=0, le=MAX_TOKENS)]
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]

Name = Annotated[str, StringConstraints(max_length=MAX_NAME_LENGTH)]
Key = Annotated[str, StringConstraints(max_length=MAX_KEY_LENGTH)]
Url = Annotated[str, StringConstraints(max_length=MAX_URL_LENGTH)]
Message = Annotated[str, StringConstraints(max_length=MAX_MESSAGE_LENGTH)]
Text = Annotated[str, StringConstraints(max_length=MAX_TEXT_LENGTH)]


def _refuse(message: str, **context: Any) -> PydanticCustomError:
    return PydanticCustomError("json_data", message, context)


def check_json_data(value: Any) -> Any:
    """`value` unchanged when it is plain JSON data within the limits; else a validation error.

    JSON data is None, bool, an int64, a finite float, a string of at most MAX_TEXT_LENGTH, or a
    list or string-keyed map of at most MAX_JSON_ITEMS of those, nested at most MAX_JSON_DEPTH deep.
    Bytes, arrays, datetimes and big integers are refused here, so that a stored job or capture
    always encodes as JSON and as msgpack. The walk is iterative: depth cannot exhaust the stack.
    """
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if item is None or isinstance(item, bool):
            continue
        if isinstance(item, str):
            if len(item) > MAX_TEXT_LENGTH:
                raise _refuse("a string longer than {limit} characters", limit=MAX_TEXT_LENGTH)
        elif isinstance(item, int):
            if not INT64_MIN <= item <= INT64_MAX:
                raise _refuse("an integer outside the 64-bit range")
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise _refuse("a non-finite number")
        elif isinstance(item, (list, tuple, dict)):
            if depth >= MAX_JSON_DEPTH:
                raise _refuse("nested deeper than {limit} levels", limit=MAX_JSON_DEPTH)
            if len(item) > MAX_JSON_ITEMS:
                raise _refuse("a list or map of more than {limit} items", limit=MAX_JSON_ITEMS)
            if isinstance(item, dict):
                for key in item:
                    if not isinstance(key, str) or len(key) > MAX_KEY_LENGTH:
                        raise _refuse("a map key that is not a string of at most {limit} characters",
                                      limit=MAX_KEY_LENGTH)
                children: Iterable[Any] = item.values()
            else:
                children = item
            stack.extend((child, depth + 1) for child in children)
        else:
            raise _refuse("a value of type {kind}, which is not JSON data", kind=type(item).__name__)
    return value


JsonData = Annotated[Any, AfterValidator(check_json_data)]
"""Free-form JSON data within the limits above (see check_json_data)."""
JsonObject = Annotated[dict[Key, Any], Field(max_length=MAX_ITEMS), AfterValidator(check_json_data)]
"""A JSON object within the limits above."""
