"""The binary wire format: msgpack with numpy arrays as raw little-endian bytes.

An array travels as msgpack ext type 1 whose payload is::

    u8 dtype code | u8 ndim | ndim x u32 little-endian shape | raw C-order little-endian data

Decoding hands back a read-only ``numpy.frombuffer`` view of the message, so a 512-token
logprob array costs no per-element work on either side. Datetimes use msgpack's timestamp ext.
"""

from __future__ import annotations

import json
import math
import re
import struct
from enum import Enum
from typing import Any

import msgpack
import numpy as np
from pydantic import BaseModel

from .limits import MAX_DEPTH

MSGPACK = "application/msgpack"
JSON = "application/json"
ARRAY_EXT = 1
EMBEDDED_EXT = 2
"""A msgpack document carried whole inside another, so a server can forward stored bytes as-is."""

_DTYPES = ["int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
           "float16", "float32", "float64", "bool"]
_CODE_OF = {np.dtype(name).newbyteorder("<") if np.dtype(name).itemsize > 1 else np.dtype(name): i
            for i, name in enumerate(_DTYPES)}
_DTYPE_OF = {i: dtype for dtype, i in _CODE_OF.items()}
_MAX_NDIM = 8


class WireError(ValueError):
    """The bytes are not a well-formed rollmarket message."""


class NestingTooDeep(WireError):
    """A document nests containers deeper than MAX_DEPTH."""


class LoneSurrogate(WireError):
    """A JSON document holds a lone UTF-16 surrogate: valid JSON text, but not Unicode."""


def _encode_array(array: np.ndarray) -> msgpack.ExtType:
    dtype = array.dtype.newbyteorder("<") if array.dtype.itemsize > 1 else array.dtype
    code = _CODE_OF.get(dtype)
    if code is None:
        raise TypeError(f"arrays of dtype {array.dtype} do not travel on the wire")
    if array.ndim > _MAX_NDIM:
        raise TypeError(f"arrays of rank {array.ndim} do not travel on the wire (at most {_MAX_NDIM})")
    if array.dtype != dtype or not array.flags.c_contiguous:
        array = np.ascontiguousarray(array, dtype=dtype)
    header = struct.pack(f"<BB{array.ndim}I", code, array.ndim, *array.shape)
    return msgpack.ExtType(ARRAY_EXT, header + array.tobytes())


def _default(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return _encode_array(value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, BaseModel):
        return value.model_dump(mode="python")
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    raise TypeError(f"cannot encode {type(value).__name__} as msgpack")


def embed(document: bytes) -> msgpack.ExtType:
    """Wrap already-encoded msgpack bytes so they decode in place as part of the outer message."""
    return msgpack.ExtType(EMBEDDED_EXT, document)


def _ext_hook(code: int, data: bytes) -> Any:
    if code == EMBEDDED_EXT:
        return unpackb(data)
    return _array_ext(code, data)


def _array_ext(code: int, data: bytes) -> Any:
    if code != ARRAY_EXT:
        raise WireError(f"unknown msgpack ext type {code}")
    if len(data) < 2:
        raise WireError("truncated array header")
    dtype = _DTYPE_OF.get(data[0])
    ndim = data[1]
    if dtype is None or ndim > _MAX_NDIM:
        raise WireError(f"bad array header (dtype code {data[0]}, ndim {ndim})")
    offset = 2 + 4 * ndim
    if len(data) < offset:
        raise WireError("truncated array shape")
    shape = struct.unpack_from(f"<{ndim}I", data, 2)
    count = math.prod(shape)
    if len(data) - offset != count * dtype.itemsize:
        raise WireError(f"array payload of {len(data) - offset} bytes does not fit shape {shape}")
    return np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape)


def packb(value: Any) -> bytes:
    """Encode a model, or plain data holding models and arrays, as msgpack."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="python")
    return msgpack.packb(value, default=_default, use_bin_type=True, datetime=True)


def unpackb(data: bytes) -> Any:
    """Decode msgpack into plain data with numpy arrays; raise WireError on malformed bytes."""
    try:
        return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, timestamp=3,
                               strict_map_key=False)
    except WireError:
        raise
    except Exception as exc:  # msgpack raises a zoo of types; all mean the same to a caller
        raise WireError(f"malformed msgpack: {exc}") from None


# -- request bodies: what a server accepts from anyone ---------------------------------------

def _unique_keys(pairs: list[tuple[Any, Any]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        for key, _ in pairs:
            if key in seen:
                raise WireError(f"duplicate key {str(key)[:64]!r} in one map")
            seen.add(key)
    return out


def _check_depth(value: Any) -> Any:
    """`value` when its containers nest at most MAX_DEPTH deep; walked level by level, without
    recursion (and without per-item tuples: this runs on every msgpack request)."""
    level = [value]
    depth = 1
    while level:
        if depth > MAX_DEPTH:
            raise NestingTooDeep(f"containers nest deeper than {MAX_DEPTH} levels")
        below = []
        for item in level:
            for child in (item.values() if type(item) is dict else item):
                kind = type(child)
                if kind is dict or kind is list:
                    below.append(child)
        level = below
        depth += 1
    return value


def unpack_request(data: bytes) -> Any:
    """Decode a request body sent as msgpack, refusing what only a hostile or broken peer sends.

    Beyond `unpackb`: no embedded documents (ext type 2 is for answers a server forwards), no map
    with a key twice, and no nesting deeper than MAX_DEPTH. msgpack's C decoder keeps its own
    stack (it refuses beyond 1024 levels), so nothing recurses in Python before the depth check.
    Raises WireError.
    """
    try:
        value = msgpack.unpackb(data, ext_hook=_array_ext, raw=False, timestamp=3,
                                strict_map_key=False, object_pairs_hook=_unique_keys)
    except WireError:
        raise
    except msgpack.StackError:
        raise NestingTooDeep(f"containers nest deeper than {MAX_DEPTH} levels") from None
    except Exception as exc:
        raise WireError(f"malformed msgpack: {type(exc).__name__}: {exc}") from None
    return _check_depth(value) if isinstance(value, (dict, list)) else value


_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"?')
"""A JSON string, or the rest of the body after an unterminated quote: possessive, so linear."""
_NOT_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def json_too_deep(body: bytes) -> bool:
    """True when the arrays and objects of a JSON text nest deeper than MAX_DEPTH, found from
    the bytes alone (strings removed, brackets counted) without parsing anything."""
    if body.count(b"[") + body.count(b"{") <= MAX_DEPTH:
        return False
    brackets = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    codes = np.frombuffer(brackets, np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)
    return int(np.cumsum(steps).max(initial=0)) > MAX_DEPTH


def loads_json(body: bytes | str, *, unique_keys: bool = True) -> Any:
    """Decode a request body sent as JSON, refusing what only a hostile or broken peer sends.

    UTF-8 only; at most MAX_DEPTH levels of nesting, measured on the bytes before the (recursive)
    parser sees them; no lone UTF-16 surrogates (LoneSurrogate: they cannot be stored or
    re-encoded); with `unique_keys` (the exchange's contracts), no object with a key twice. The
    words NaN and Infinity parse, so that such logprobs reach the gate and get their own typed
    rejection. Raises WireError (NestingTooDeep and LoneSurrogate for those two causes).
    """
    if isinstance(body, str):
        try:
            body = body.encode("utf-8")
        except UnicodeEncodeError:
            raise LoneSurrogate("JSON holds a lone UTF-16 surrogate") from None
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise WireError(f"JSON must be UTF-8: {exc}") from None
    if json_too_deep(body):
        raise NestingTooDeep(f"JSON nests deeper than {MAX_DEPTH} levels")
    try:
        value = json.loads(text, object_pairs_hook=_unique_keys if unique_keys else None)
    except WireError:
        raise
    except (ValueError, RecursionError) as exc:
        raise WireError(f"malformed JSON: {exc}") from None
    if _SURROGATE_ESCAPE.search(body):
        try:  # escapes of surrogate pairs are fine; a lone one cannot be encoded
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise LoneSurrogate("JSON holds a lone UTF-16 surrogate escape") from None
    return value
