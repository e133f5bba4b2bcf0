"""Every number and string a contract holds is bounded, and hostile values are validation errors.

The exchange turned integers past 64 bits, deep nesting, bytes inside free-form JSON and the like
into 500s (SQLite's OverflowError, msgpack's, RecursionError) or stored them and then broke
every answer that carried them. These tests pin the rule down where it is made
(`rollmarket.contracts.limits`, `rollmarket.contracts.wire`): a walk over the JSON Schema of every
contract that crosses a process boundary fails on an integer without both bounds, a string
without a maximum length, or a list or map without a maximum size; then the hostile values
themselves must be pydantic ValidationErrors (a 422 at the exchange), never another exception.
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgpack
import numpy as np
import pytest
from helpers import TOKENIZER, job, manifest, policy, sha, trajectories
from pydantic import BaseModel, ValidationError

import rollmarket.contracts as contracts
from rollmarket.contracts import RolloutJob, SampleGroup, TaskSpec, WorkerManifest
from rollmarket.contracts.limits import INT64_MAX, MAX_DEPTH, MAX_JSON_DEPTH, check_json_data
from rollmarket.contracts.wire import NestingTooDeep, WireError, embed, loads_json, packb, unpack_request
from rollmarket.exchange.app import create_app
from rollmarket.exchange.settings import ExchangeSettings


def every_contract() -> list[type[BaseModel]]:
    return [value for value in vars(contracts).values()
            if isinstance(value, type) and issubclass(value, BaseModel) and value is not contracts.Record]


def unbounded(schema: dict, where: str, defs: dict, seen: set[str]) -> list[str]:
    """Every place in a JSON Schema where an integer, string, array or map has no bound."""
    found: list[str] = []
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        if name not in seen:
            seen.add(name)
            found += unbounded(defs[name], name, defs, seen)
        return found
    kind = schema.get("type")
    if kind == "integer":
        has_min = "minimum" in schema or "exclusiveMinimum" in schema
        has_max = "maximum" in schema or "exclusiveMaximum" in schema
        if not (has_min and has_max):
            found.append(f"{where}: integer without both bounds")
    elif kind == "string" and "enum" not in schema and "const" not in schema and schema.get("format") != "date-time":
        if "maxLength" not in schema:
            found.append(f"{where}: string without maxLength")
    elif kind == "array":
        if "maxItems" not in schema:
            found.append(f"{where}: array without maxItems")
    elif kind == "object" and schema.get("additionalProperties") not in (None, False):
        if "maxProperties" not in schema:
            found.append(f"{where}: map without maxProperties")
        if "propertyNames" in schema:
            found += unbounded({"type": "string", **schema["propertyNames"]}, f"{where}.<key>", defs, seen)
    for key in ("anyOf", "oneOf", "allOf"):
        for index, option in enumerate(schema.get(key, [])):
            found += unbounded(option, f"{where}|{index}", defs, seen)
    for name, sub in schema.get("properties", {}).items():
        found += unbounded(sub, f"{where}.{name}", defs, seen)
    if isinstance(schema.get("items"), dict):
        found += unbounded(schema["items"], f"{where}[]", defs, seen)
    if isinstance(schema.get("additionalProperties"), dict):
        found += unbounded(schema["additionalProperties"], f"{where}{{}}", defs, seen)
    return found


@pytest.mark.parametrize("model", every_contract(), ids=lambda m: m.__name__)
def test_every_contract_field_is_bounded(model):
    """Integers have a minimum and a maximum, strings a maximum length, lists and maps a
    maximum size (free-form JSON fields are bounded by check_json_data instead)."""
    schema = model.model_json_schema(mode="validation")
    problems = unbounded(schema, model.__name__, schema.get("$defs", {}), set())
    assert problems == []


def test_every_body_answer_and_parameter_of_the_exchange_is_bounded(tmp_path):
    """The same over the exchange's OpenAPI document: its own request and answer models, and
    every query and path parameter of every route."""
    spec = create_app(ExchangeSettings(db=tmp_path / "x.db", trainer_token="t")).openapi()
    components = spec["components"]["schemas"]
    problems = []
    for name, schema in components.items():
        if name in ("HTTPValidationError", "ValidationError"):
            continue  # FastAPI's own, never sent: our handler answers with ErrorBody
        problems += unbounded(schema, name, components, set())
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            for parameter in operation.get("parameters", []):
                where = f"{method.upper()} {path} {parameter['in']}:{parameter['name']}"
                schema = parameter["schema"]
                options = schema.get("anyOf", [schema])
                for option in options:
                    if option.get("type") == "number":
                        assert "maximum" in option, f"{where}: number without a maximum"
                    else:
                        problems += unbounded(option, where, components, set())
    assert problems == []


# -- hostile values are validation errors -------------------------------------------------------

BIG = 2**64
HOSTILE = {
    "policy version past 64 bits": lambda: policy(BIG),
    "policy version past int32": lambda: policy(2**31),
    "parent version past 64 bits": lambda: policy(3, parent_version=BIG),
    "vocab size past 64 bits": lambda: policy(0, vocab_size=BIG),
    "manifest context past 64 bits": lambda: manifest(max_context_tokens=2**70),
    "manifest context past the token limit": lambda: manifest(max_context_tokens=2**24 + 1),
    "manifest device count past 64 bits": lambda: manifest(device_count=BIG),
    "manifest price not finite": lambda: manifest(price_hint=math.inf),
    "manifest engine name of 10k chars": lambda: manifest(engine_name="x" * 10_000),
    "manifest 100k precision classes": lambda: manifest(precision_classes=["bf16"] * 100_000),
    "job priority past 64 bits": lambda: job(0, priority=2**63),
    "job context past 64 bits": lambda: job(0, max_context_tokens=2**70),
    "job version past 64 bits": lambda: job(0, version=BIG),
    "sampling seed past 64 bits": lambda: job(0, sampling_config={"seed": 2**70}),
    "sampling max_tokens past 64 bits": lambda: job(0, sampling_config={"max_tokens": BIG}),
    "task answer past 64 bits": lambda: job(0, task=TaskSpec(task_id="t", prompt="p", verifier="v", answer=2**70)),
    "task answer as bytes": lambda: TaskSpec(task_id="t", prompt="p", verifier="v", answer=b"\xff"),
    "task metadata holding an array": lambda: TaskSpec(task_id="t", prompt="p", verifier="v",
                                                       metadata={"a": np.zeros(3)}),
    "task metadata holding NaN": lambda: TaskSpec(task_id="t", prompt="p", verifier="v", metadata={"a": math.nan}),
    "task metadata nested too deep": lambda: TaskSpec(task_id="t", prompt="p", verifier="v",
                                                      metadata={"a": json.loads("[" * 40 + "]" * 40)}),
    "task verifier args with an int key": lambda: TaskSpec(task_id="t", prompt="p", verifier="v",
                                                           verifier_args={"a": {1: 2}}),
    "task prompt of 2M chars": lambda: TaskSpec(task_id="t", prompt="x" * 2_000_000, verifier="v"),
    "heartbeat queue depth past 64 bits": lambda: contracts.WorkerHeartbeat(worker_id="w1", queue_depth=BIG),
    "ack version past 64 bits": lambda: contracts.ReloadAck(worker_id="w1", policy_version=BIG,
                                                            checkpoint_digest=sha("c"), engine_fingerprint="f"),
    "policy created before UTC year 1": lambda: contracts.PolicyManifest.model_validate(
        {**policy(0).model_dump(mode="json"), "created_at": "0001-01-01T00:00:00+05:00"}),
    "trajectory turn boundary past 64 bits": lambda: trajectories(1)[0].model_copy().model_validate(
        {**{k: getattr(trajectories(1)[0], k) for k in contracts.Trajectory.model_fields}, "turn_boundaries": [BIG]}),
    "routed experts with 2000 layers": lambda: contracts.Trajectory(
        sample_index=0, prompt_token_ids=[1], response_token_ids=[1], routed_experts=np.zeros((1, 2000, 2), np.int16)),
    "sample index past the group size limit": lambda: contracts.Trajectory(
        sample_index=1024, prompt_token_ids=[1], response_token_ids=[1]),
    "error detail with a 100k message": lambda: contracts.ErrorDetail(code="internal", message="x" * 100_000),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_values_are_validation_errors(case):
    with pytest.raises(ValidationError):
        HOSTILE[case]()


def test_values_at_the_limits_are_accepted():
    assert policy(2**31 - 1, parent_version=2**31 - 2).policy_version == 2**31 - 1
    assert manifest(max_context_tokens=2**24).max_context_tokens == 2**24
    assert job(0, priority=-(2**31 - 1), sampling_config={"seed": INT64_MAX}).sampling_config.seed == INT64_MAX
    deep: Any = "leaf"
    for _ in range(MAX_JSON_DEPTH - 1):
        deep = [deep]
    spec = TaskSpec(task_id="t", prompt="p", verifier="v", answer=deep, metadata={"a": [1, 2.5, None, True, "x"]})
    assert spec.model_dump_json()
    assert RolloutJob(task=spec, policy_version=0, group_size=1).digest()


def test_json_data_walk_needs_no_recursion():
    """A nesting far past Python's recursion limit is refused without a RecursionError."""
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(Exception) as caught:
        check_json_data(deep)
    assert not isinstance(caught.value, RecursionError)
    assert "nested deeper" in str(caught.value)


# -- request bodies: depth, duplicates, surrogates, embedded documents ----------------------------

@pytest.mark.parametrize("body", [b"[" * 100_000 + b"]" * 100_000, b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1),
                                  b'{"a":' * 5000 + b"1" + b"}" * 5000, b"[" * 100_000],
                         ids=["100k", "limit+1", "objects", "unclosed"])
def test_deep_json_is_refused_before_parsing(body):
    with pytest.raises(NestingTooDeep):
        loads_json(body)


def test_json_at_the_depth_limit_and_brackets_inside_strings_parse():
    assert loads_json(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH) is not None
    assert loads_json(json.dumps({"s": "[" * 1000, "t": '\\"[[' * 300}).encode())["s"] == "[" * 1000


@pytest.mark.parametrize("body,word", [
    (b'{"a": 1, "a": 2}', "duplicate"), (b'{"b": {"x": 1, "x": 1}}', "duplicate"),
    (b'"\\ud800"', "surrogate"), (b'["ok", "\\udfff tail"]', "surrogate"),
    ('"\udcff"'.encode("utf-8", "surrogatepass"), "UTF-8"), (b"\xff\xfe[]", "UTF-8"), (b"", "malformed"),
])
def test_ambiguous_or_unstorable_json_is_refused(body, word):
    with pytest.raises(WireError) as caught:
        loads_json(body)
    assert word.lower() in str(caught.value).lower()


def test_json_surrogate_pairs_and_escaped_backslashes_parse():
    assert loads_json(b'["\\ud83d\\ude00", "\\\\ud800"]') == ["\U0001F600", "\\ud800"]
    assert math.isnan(loads_json(b"[NaN]")[0])


def test_deep_msgpack_is_refused_without_recursion():
    for depth in (MAX_DEPTH + 1, 1000, 100_000):
        with pytest.raises(NestingTooDeep):
            unpack_request(b"\x91" * depth + b"\x00")
    assert unpack_request(b"\x91" * (MAX_DEPTH - 1) + b"\x00") is not None


@pytest.mark.parametrize("body", [
    b"\x82\xa1a\x01\xa1a\x02",  # {"a": 1, "a": 2}
    msgpack.packb({"group": embed(packb({"a": 1}))}),  # ext 2 is for answers a server forwards
    msgpack.packb({"a": msgpack.ExtType(42, b"x")}),
    msgpack.packb(["\udcff".encode("utf-8", "surrogatepass")], use_bin_type=False),  # str with a surrogate
], ids=["duplicate-key", "embedded-document", "unknown-ext", "surrogate-str"])
def test_msgpack_a_client_should_not_send_is_refused(body):
    with pytest.raises(WireError):
        unpack_request(body)


def test_a_real_group_round_trips_through_the_request_decoders():
    group = SampleGroup(job_id="j", lease_id="l", worker_id="w", task_id="t", policy_version=0,
                        checkpoint_digest=sha("c"), tokenizer_hash=TOKENIZER, sampling_config_hash=sha("s"),
                        engine_name="hf", engine_version="1", engine_fingerprint="f", device_type="cpu",
                        precision_class="bf16", quantization_class="none", trajectories=trajectories(4)).sealed()
    assert SampleGroup.model_validate(unpack_request(packb(group))) == group
    assert SampleGroup.model_validate(loads_json(group.model_dump_json().encode())) == group
    assert isinstance(WorkerManifest.model_validate(loads_json(manifest().model_dump_json().encode())), WorkerManifest)
