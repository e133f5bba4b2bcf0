"""Token arrays: numpy in memory, little-endian bytes on the wire and at rest, lists in JSON.

A contract field declared as ``TokenIds`` or ``Logprobs`` accepts a numpy array, a (nested) list,
or the binary form that :mod:`rollmarket.contracts.wire` decodes, and always holds a read-only,
C-contiguous numpy array of one canonical dtype. In Python mode it dumps as that array (so the
msgpack encoder can ship its bytes); in JSON mode it dumps as a list, because JSON is for people.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Annotated, Any

import numpy as np
from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic_core import PydanticCustomError, core_schema

from .limits import MAX_LAYERS, MAX_TOKENS


@lru_cache(maxsize=64)
def _dtype_bounds(dtype: np.dtype) -> tuple[float, float]:
    """The smallest and largest value a dtype can hold."""
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return info.min, info.max
    if dtype.kind == "b":
        return 0, 1
    return -np.inf, np.inf


@dataclass(frozen=True)
class ArraySpec:
    """How one kind of array is validated: its canonical dtype, rank and value range."""

    name: str
    dtype: str
    ndim: int
    kinds: str
    """numpy dtype kinds accepted before casting (``i`` signed, ``u`` unsigned, ``f`` float, ``b`` bool)."""
    min_value: float | None = None
    max_value: float | None = None
    max_shape: tuple[int, ...] = ()
    """The longest each axis may be (docs/contracts.md, 'Limits'); empty for no limit."""

    def validate(self, value: Any) -> np.ndarray:
        if isinstance(value, np.ndarray):
            array = value
        elif isinstance(value, (list, tuple)):
            try:
                array = np.asarray(value)
            except (ValueError, TypeError) as exc:
                raise PydanticCustomError(
                    "array_ragged", "{name}: not a rectangular array ({error})",
                    {"name": self.name, "error": str(exc)},
                ) from None
            if array.size == 0:
                # `[]` stands for an empty array of any rank; `[[]]` keeps its (wrong) rank.
                shape = (0,) * self.ndim if array.shape == (0,) else array.shape
                array = np.zeros(shape, dtype=self.dtype)
        else:
            raise PydanticCustomError(
                "array_type", "{name}: expected an array or a list, got {got}",
                {"name": self.name, "got": type(value).__name__},
            )
        if array.ndim != self.ndim:
            raise PydanticCustomError(
                "array_rank", "{name}: expected {ndim} dimension(s), got {got}",
                {"name": self.name, "ndim": self.ndim, "got": array.ndim},
            )
        shape = array.shape
        if self.max_shape and (shape[0] > self.max_shape[0] or (
                array.ndim > 1 and any(size > most for size, most in zip(shape[1:], self.max_shape[1:])))):
            raise PydanticCustomError(
                "array_too_long", "{name}: shape {shape} exceeds the limit {limit}",
                {"name": self.name, "shape": str(array.shape), "limit": str(self.max_shape)},
            )
        if array.dtype.kind not in self.kinds:
            raise PydanticCustomError(
                "array_dtype", "{name}: dtype {got} is not allowed (want {want})",
                {"name": self.name, "got": str(array.dtype), "want": self.dtype},
            )
        if array.size and (self.min_value is not None or self.max_value is not None):
            # Range-check before any cast so that 2**40 cannot wrap into a valid token id. Bounds
            # the dtype already guarantees are skipped: an int32 id array needs only its minimum.
            low_bound, high_bound = _dtype_bounds(array.dtype)
            if (self.min_value is not None and low_bound < self.min_value and array.min() < self.min_value) or (
                self.max_value is not None and high_bound > self.max_value and array.max() > self.max_value
            ):
                raise PydanticCustomError(
                    "array_range", "{name}: values must lie in [{lo}, {hi}]",
                    {"name": self.name, "lo": self.min_value, "hi": self.max_value},
                )
        target = np.dtype(self.dtype)
        if array.dtype != target:
            array = array.astype(target)
        if not array.flags.c_contiguous:
            array = np.ascontiguousarray(array)
        root: object = array
        while isinstance(root, np.ndarray):
            root = root.base
        if array is value and not isinstance(root, bytes):
            # Never freeze or alias an array the caller still holds and may write to (a read-only
            # view of a writeable array, or one whose flag can be set back): own a copy. Only
            # views of immutable bytes, as the wire decoder makes, are kept without a copy.
            array = array.copy()
        array.flags.writeable = False
        return array

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        def serialize(array: np.ndarray, info: core_schema.SerializationInfo) -> Any:
            return array.tolist() if info.mode_is_json() else array

        return core_schema.no_info_plain_validator_function(
            self.validate,
            serialization=core_schema.plain_serializer_function_ser_schema(
                serialize, info_arg=True
            ),
        )

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> dict[str, Any]:
        item: dict[str, Any] = {"type": "number" if self.dtype.startswith("float") else "integer"}
        if self.min_value is not None:
            item["minimum"] = self.min_value
        if self.max_value is not None:
            item["maximum"] = self.max_value
        for axis in reversed(range(self.ndim)):
            item = {"type": "array", "items": item}
            if axis < len(self.max_shape):
                item["maxItems"] = self.max_shape[axis]
        item["description"] = (
            f"{self.dtype} array of rank {self.ndim}; msgpack carries it as raw "
            "little-endian bytes (ext type 1), JSON as nested lists"
        )
        return item


TOKEN_IDS = ArraySpec("token_ids", "int32", 1, "iu", 0, 2**31 - 1, (MAX_TOKENS,))
LOGPROBS = ArraySpec("logprobs", "float32", 1, "fiu", max_shape=(MAX_TOKENS,))
MASK = ArraySpec("mask", "uint8", 1, "iub", 0, 1, (MAX_TOKENS,))
ROUTED_EXPERTS = ArraySpec("routed_experts", "int16", 3, "iu", 0, 2**15 - 1, (MAX_TOKENS, MAX_LAYERS, MAX_LAYERS))

TokenIds = Annotated[np.ndarray, TOKEN_IDS]
"""int32 [T]: token ids, never re-tokenized text."""
Logprobs = Annotated[np.ndarray, LOGPROBS]
"""float32 [T]: log-probabilities of the sampled tokens."""
Mask = Annotated[np.ndarray, MASK]
"""uint8 [T] of 0/1."""
RoutedExperts = Annotated[np.ndarray, ROUTED_EXPERTS]
"""int16 [T, L, K]: top-k expert ids per token per MoE layer."""
