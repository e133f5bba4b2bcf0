"""The binary wire format: msgpack with numpy arrays as raw little-endian bytes.

An array travels as msgpack ext type 1 whose payload is::

    u8 dtype code | u8 ndim | ndim x u32 little-endian shape | raw C-order little-endian data

Decoding hands back a read-only ``numpy.frombuffer`` view of the message, so a 512-token
logprob array costs no per-element work on either side. Datetimes use msgpack's timestamp ext.
"""

from __future__ import annotations

import math
import struct
from enum import Enum
from typing import Any

import msgpack
import numpy as np
from pydantic import BaseModel

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
