"""`json_schema`: the answer holds a JSON value that validates against a JSON Schema.

The value is read from the whole answer, else the last ```json fenced block, else the first
`{...}`/`[...]` in prose. Components:

* valid: 1 if a value was found and validates against args.schema, else 0;
* fields: the fraction of `expected` top-level keys whose values equal the answer's (numbers
  compare within 1e-9 relative, 1 == 1.0); 1 when nothing is expected.

reward = valid * fields with partial_credit, else 1 if valid and every expected field matches,
else 0. `expected` defaults to task.answer when that is an object.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from jsonschema import SchemaError, validators
from pydantic import Field

from ...contracts import TaskSpec, ToolCallRecord, VerifyResult
from ..extract import NoJSON, extract_json
from ..verifier import (
    Verifier,
    VerifierArgs,
    VerifierConfigError,
    register_verifier,
    result,
)

MAX_ERRORS = 5
"""Validation errors quoted in the info."""


class JsonSchemaArgs(VerifierArgs):
    schema_: dict[str, Any] | bool = Field(alias="schema", description="The JSON Schema (draft 2020-12 unless $schema says).")
    expected: dict[str, Any] | None = Field(
        None, description="Top-level fields the answer must have with these values; default task.answer if an object.")
    partial_credit: bool = Field(False, description="reward = valid * fraction of expected fields matched.")


def equal(a: Any, b: Any) -> bool:
    """JSON equality, with numbers compared by value (1 == 1.0) within 1e-9 relative; bools are not numbers."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@register_verifier
class JsonSchemaVerifier(Verifier):
    name = "json_schema"
    Args = JsonSchemaArgs

    def expected(self, task: TaskSpec, args: JsonSchemaArgs):
        cls = validators.validator_for(args.schema_)
        try:
            cls.check_schema(args.schema_)
        except SchemaError as exc:
            raise VerifierConfigError(f"verifier 'json_schema' on {task.task_id}: args.schema is not a valid "
                                      f"JSON Schema: {exc.message}") from None
        fields = args.expected if args.expected is not None else task.answer if isinstance(task.answer, dict) else {}
        return cls(args.schema_), fields

    def score(self, task: TaskSpec, answer: str | None, tool_calls: Sequence[ToolCallRecord],
              args: JsonSchemaArgs, expected) -> VerifyResult:
        validator, fields = expected
        shown = fields or None
        zeros = {"valid": 0.0, "fields": 0.0}
        if answer is None or not answer.strip():
            return result(0.0, components=zeros, canonical=None, expected=shown,
                          why="no answer" if answer is None else "empty answer")
        try:
            value, where = extract_json(answer)
        except NoJSON as exc:
            return result(0.0, components=zeros, canonical=None, expected=shown, why=str(exc))
        key = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        errors = sorted(validator.iter_errors(value), key=lambda e: list(e.absolute_path))
        messages = [f"{'/'.join(str(p) for p in e.absolute_path) or '(root)'}: {e.message[:200]}"
                    for e in errors[:MAX_ERRORS]]
        valid = 0.0 if errors else 1.0
        matched = [k for k in fields if isinstance(value, dict) and k in value and equal(value[k], fields[k])]
        missing = [k for k in fields if k not in matched]
        fraction = len(matched) / len(fields) if fields else 1.0
        reward = valid * fraction if args.partial_credit else float(valid == 1.0 and not missing)
        why = None
        if errors:
            why = f"does not match the schema: {messages[0]}"
        elif missing:
            why = f"fields differ from the expected: {', '.join(missing[:10])}"
        return result(reward, passed=valid == 1.0 and not missing, components={"valid": valid, "fields": fraction},
                      canonical=key, expected=shown, why=why if reward < 1 else None, found_in=where,
                      errors=messages, mismatched_fields=missing)
