"""The msgpack wire format (contracts/wire.py): arrays as raw little-endian bytes, zero-copy decode.

Anything that is not a well-formed message must raise WireError and nothing else, because the
exchange turns exactly that exception into a 400 and any other one into a 500.
"""

from __future__ import annotations

import random
import struct
from datetime import datetime, timedelta, timezone

import msgpack
import numpy as np
import pytest
from helpers import TOKENIZER, sha, trajectories

from rollmarket.contracts import (
    BudgetReport,
    DecisionStatus,
    SampleGroup,
    SamplingConfig,
    Trajectory,
    content_hash,
)
from rollmarket.contracts.wire import ARRAY_EXT, EMBEDDED_EXT, WireError, embed, packb, unpackb

DTYPES = ["int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
          "float16", "float32", "float64", "bool"]
SHAPES = [(), (0,), (1,), (5,), (3, 4), (0, 3), (2, 3, 4), (4, 0, 2), (2, 1, 3, 1), (1,) * 8]


def _sample(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape, dtype=np.int64))
    if dtype == "bool":
        flat = rng.integers(0, 2, n).astype(bool)
    else:
        # Random bytes cover every bit pattern, NaN payloads and -0.0 included.
        flat = np.frombuffer(rng.bytes(n * np.dtype(dtype).itemsize), dtype=dtype).copy()
    return flat.reshape(shape)


def _array_ext(code: int, shape: tuple[int, ...], payload: bytes) -> bytes:
    header = struct.pack(f"<BB{len(shape)}I", code, len(shape), *shape)
    return msgpack.packb(msgpack.ExtType(ARRAY_EXT, header + payload))


def make_group(**overrides) -> SampleGroup:
    fields = dict(job_id="job-1", lease_id="lease-1", worker_id="w1", task_id="task-1",
                  policy_version=2, checkpoint_digest=sha("ckpt-2"), tokenizer_hash=TOKENIZER,
                  sampling_config_hash=SamplingConfig().digest(), engine_name="hf",
                  engine_version="1.0", engine_fingerprint=sha("fp"), device_type="cpu",
                  precision_class="bf16", quantization_class="none",
                  trajectories=trajectories(3, tokens=12, seed=4))
    fields.update(overrides)
    return SampleGroup(**fields)


# --------------------------------------------------------------------------------------------
# Arrays
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_arrays_round_trip_byte_exactly(dtype, shape):
    original = _sample(dtype, shape)
    decoded = unpackb(packb(original))
    assert isinstance(decoded, np.ndarray)
    assert decoded.dtype == np.dtype(dtype)
    assert decoded.shape == shape
    assert decoded.tobytes() == original.tobytes()


def test_payload_is_header_then_raw_little_endian_bytes():
    """The documented layout: u8 dtype code | u8 ndim | ndim x u32 LE shape | C-order LE data.

    Other languages implement this by hand; do not 'fix' this test without a decision.
    """
    array = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int32)
    ext = msgpack.unpackb(packb(array), ext_hook=lambda code, data: (code, data))
    assert ext[0] == ARRAY_EXT == 1
    assert ext[1] == bytes([4, 2]) + struct.pack("<2I", 2, 3) + struct.pack("<6i", 1, 2, 3, 4, 5, 6)


@pytest.mark.parametrize("dtype", ["int16", "int32", "int64", "uint32", "float32", "float64"])
def test_big_endian_arrays_travel_as_little_endian_values(dtype):
    values = np.arange(-3, 3).astype(dtype) if dtype[0] != "u" else np.arange(6).astype(dtype)
    big = values.astype(np.dtype(dtype).newbyteorder(">"))
    decoded = unpackb(packb(big))
    assert decoded.dtype == np.dtype(dtype).newbyteorder("<")
    assert decoded.tolist() == values.tolist()


def test_non_contiguous_arrays_travel_in_c_order():
    base = np.arange(24, dtype=np.int32).reshape(4, 6)
    for view in (base.T, base[:, ::2], base[::-1]):
        decoded = unpackb(packb(view))
        assert decoded.shape == view.shape
        assert decoded.tolist() == view.tolist()


def test_decoded_arrays_are_read_only_views_of_the_message():
    message = packb({"ids": np.arange(6, dtype=np.int32).reshape(2, 3), "lp": np.zeros(4, np.float32)})
    decoded = unpackb(message)
    for array in decoded.values():
        assert not array.flags.writeable
        assert not array.flags.owndata  # a view, not a copy
        with pytest.raises(ValueError):
            array.flat[0] = 1
        with pytest.raises(ValueError):
            array.flags.writeable = True


@pytest.mark.parametrize("bad", [np.array([1 + 2j]), np.array(["a"]), np.array([object()]),
                                 np.array(["2024-01-01"], dtype="datetime64[D]"), np.zeros((1,) * 9)],
                         ids=["complex", "str", "object", "datetime64", "rank-9"])
def test_arrays_that_cannot_travel_are_refused_when_packing(bad):
    """The encoder must never write what the decoder refuses to read."""
    with pytest.raises(TypeError):
        packb({"x": bad})


def test_numpy_scalars_enums_and_models_become_plain_values():
    report = BudgetReport(group_id="g", n_tokens=0, n_sequences=0, clamp=20.0, token_ess=1.0,
                          sequence_ess=1.0, mean_delta=0.0, mean_abs_delta=0.0, max_abs_delta=0.0,
                          clipped_fraction=0.0, veto_fraction=0.0, second_moment=1.0,
                          top1pct_mass=0.0, kl_k1=0.0, kl_k3=0.0, chi2=0.0, mean_prob_diff=0.0)
    decoded = unpackb(packb({"n": np.int64(3), "x": np.float32(0.5), "status": DecisionStatus.replay,
                             "report": report, "tags": {"b", "a"}}))
    assert decoded["n"] == 3 and type(decoded["n"]) is int
    assert decoded["x"] == 0.5 and type(decoded["x"]) is float
    assert decoded["status"] == "replay"
    assert decoded["tags"] == ["a", "b"]
    assert BudgetReport.model_validate(decoded["report"]) == report


def test_objects_without_a_wire_form_are_refused_when_packing():
    with pytest.raises(TypeError):
        packb({"x": object()})


# --------------------------------------------------------------------------------------------
# Datetimes and embedded documents
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("moment", [
    datetime(2024, 5, 1, 12, 30, 15, 123456, tzinfo=timezone.utc),
    datetime(2024, 5, 1, 18, 0, 15, 999999, tzinfo=timezone(timedelta(hours=5, minutes=30))),
    datetime(1969, 12, 31, 23, 59, 59, 999999, tzinfo=timezone.utc),
    datetime(1970, 1, 1, tzinfo=timezone.utc),
    datetime(2106, 2, 7, 6, 28, 16, 1, tzinfo=timezone.utc),  # past the 32-bit seconds range
    datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=timezone.utc),
], ids=["utc", "plus-0530", "pre-epoch", "epoch", "past-2106", "max"])
def test_datetimes_round_trip_as_the_same_instant_in_utc(moment):
    decoded = unpackb(packb({"at": moment}))["at"]
    assert decoded == moment
    assert decoded.utcoffset() == timedelta(0)
    assert decoded.microsecond == moment.microsecond


# --------------------------------------------------------------------------------------------
# Embedded documents
# --------------------------------------------------------------------------------------------


def test_embedded_documents_decode_in_place():
    inner = packb({"ids": np.arange(3, dtype=np.int32), "name": "x"})
    outer = packb({"groups": [embed(inner), embed(packb(7))], "count": 2})
    decoded = unpackb(outer)
    assert decoded["count"] == 2
    assert decoded["groups"][1] == 7
    assert decoded["groups"][0]["name"] == "x"
    assert decoded["groups"][0]["ids"].tolist() == [0, 1, 2]


def test_embedded_documents_nest():
    innermost = packb({"v": np.array([1.5], np.float64)})
    decoded = unpackb(packb({"a": embed(packb({"b": embed(innermost)}))}))
    assert decoded["a"]["b"]["v"].tolist() == [1.5]


def test_an_embedded_sample_group_is_the_same_group():
    group = make_group().sealed()
    decoded = unpackb(packb({"group": embed(packb(group)), "tier": "fresh"}))
    assert SampleGroup.model_validate(decoded["group"]) == group


def test_a_malformed_embedded_document_raises_wire_error():
    with pytest.raises(WireError):
        unpackb(msgpack.packb({"g": msgpack.ExtType(EMBEDDED_EXT, b"\x92\x01")}))  # list of 2, one item
    with pytest.raises(WireError):
        unpackb(msgpack.packb({"g": msgpack.ExtType(EMBEDDED_EXT, _array_ext(4, (3,), b"\x00" * 4))}))


# --------------------------------------------------------------------------------------------
# Malformed input: WireError and nothing else
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("data", [
    _array_ext(4, (3,), b"\x00" * 11),            # int32 [3] needs 12 bytes
    _array_ext(4, (3,), b"\x00" * 13),
    _array_ext(4, (2, 2), b"\x00" * 12),
    _array_ext(9, (2,), b"\x00" * 3),            # float32 [2] needs 8 bytes
    _array_ext(0, (0,), b"\x00"),                 # an empty array with a byte after it
    _array_ext(4, (), b"\x00" * 8),               # a 0-d int32 holds 4 bytes
    _array_ext(10, (2**31, 2**31, 4), b""),       # the element count wraps 2**64 to zero
    _array_ext(99, (1,), b"\x00"),                # no dtype has code 99
    _array_ext(len(DTYPES), (1,), b"\x00"),       # one past the last dtype
    msgpack.packb(msgpack.ExtType(ARRAY_EXT, bytes([4, 9]) + struct.pack("<9I", *[1] * 9) + b"\x00" * 4)),
    msgpack.packb(msgpack.ExtType(ARRAY_EXT, b"")),           # no header
    msgpack.packb(msgpack.ExtType(ARRAY_EXT, b"\x04")),       # half a header
    msgpack.packb(msgpack.ExtType(ARRAY_EXT, b"\x04\x02\x01\x00\x00\x00")),  # half a shape
    msgpack.packb(msgpack.ExtType(7, b"abc")),    # unknown ext code
    msgpack.packb(msgpack.ExtType(127, b"")),
    msgpack.packb({"a": 1}) + b"\x00",            # trailing bytes
    b"",
    b"\xc1",                                      # never used in msgpack
    b"\x92\x01",                                  # array of 2 with 1 element
    b"\xdb\xff\xff\xff\xff",                      # str of 4 GiB
    b"\xd6\xff\x00",                              # truncated timestamp
    b"\xc7\x05\xff" + b"\x00" * 5,                 # a 5-byte timestamp: msgpack has no such form
    b"\xd7\xff" + b"\xff" * 8,                       # a timestamp past datetime's range
], ids=lambda d: d[:12].hex())
def test_malformed_messages_raise_wire_error(data):
    with pytest.raises(WireError):
        unpackb(data)


def test_an_array_used_as_a_map_key_raises_wire_error():
    key = msgpack.ExtType(ARRAY_EXT, struct.pack("<BBI", 4, 1, 1) + b"\x00" * 4)
    data = b"\x81" + msgpack.packb(key) + msgpack.packb(1)
    with pytest.raises(WireError):
        unpackb(data)


@pytest.mark.parametrize("bad", ["a string", None, 12, [1, 2]], ids=["str", "none", "int", "list"])
def test_things_that_are_not_bytes_raise_wire_error(bad):
    with pytest.raises(WireError):
        unpackb(bad)


def _decode_or_wire_error(data: bytes) -> None:
    try:
        unpackb(data)
    except WireError:
        pass  # anything else propagates and fails the test


def test_every_truncation_of_a_real_message_raises_wire_error():
    message = packb(make_group().sealed())
    for cut in range(len(message)):
        with pytest.raises(WireError):
            unpackb(message[:cut])


def test_bit_flips_in_a_real_message_decode_or_raise_wire_error():
    message = packb(make_group().sealed())
    rng = random.Random(1234)
    for _ in range(3000):
        corrupt = bytearray(message)
        for _ in range(rng.randint(1, 3)):
            corrupt[rng.randrange(len(corrupt))] ^= 1 << rng.randrange(8)
        _decode_or_wire_error(bytes(corrupt))


def test_random_garbage_decodes_or_raises_wire_error():
    rng = random.Random(99)
    prefixes = [b"", b"\xc7", b"\xc8", b"\xd4\x01", b"\xd5\x01", b"\xd6\x01", b"\xd7\x02", b"\xc7\x06\x01"]
    for _ in range(3000):
        body = bytes(rng.randrange(256) for _ in range(rng.randint(0, 40)))
        _decode_or_wire_error(rng.choice(prefixes) + body)


# --------------------------------------------------------------------------------------------
# Sample groups
# --------------------------------------------------------------------------------------------


def test_a_sample_group_round_trips_with_its_content_hash():
    plain = trajectories(3, tokens=5, seed=1)
    experts_TLK = np.arange(5 * 2 * 2, dtype=np.int16).reshape(5, 2, 2)
    with_experts = Trajectory.model_validate({**plain[0].model_dump(), "routed_experts": experts_TLK,
                                             "turn_boundaries": [0, 3], "reward_components": {"a": 0.5}})
    group = make_group(trajectories=[with_experts, *plain[1:]], wall_time_s=0.1).sealed()

    again = SampleGroup.model_validate(unpackb(packb(group)))
    assert again == group
    assert again.content_hash == group.content_hash == content_hash(again)
    assert again.trajectories[0].routed_experts.dtype == np.dtype("int16")
    assert again.trajectories[0].routed_experts.shape == (5, 2, 2)
    assert again.created_at == group.created_at
    assert again.created_at.utcoffset() == timedelta(0)


def test_a_decoded_sample_group_keeps_its_arrays_without_copying():
    """The wire decoder hands out views of immutable bytes; validation must not copy them."""
    decoded = unpackb(packb(make_group()))
    again = SampleGroup.model_validate(decoded)
    for raw, trajectory in zip(decoded["trajectories"], again.trajectories):
        assert trajectory.response_token_ids is raw["response_token_ids"]
        assert trajectory.logprobs is raw["logprobs"]
        assert not trajectory.logprobs.flags.writeable
