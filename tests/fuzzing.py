"""Schema-driven fuzzing of the HTTP services with schemathesis: settings, checks, state snapshots.

`tests/test_fuzz.py` drives every operation of each service's OpenAPI document against the real
server process on loopback. Each generated call goes through `Target.exercise`, which asserts:

* **no 5xx** (schemathesis' `not_a_server_error`);
* **responses conform** to the schema where the service declares one
  (`response_schema_conformance`);
* **every rejection is typed**: a 4xx carries the service's error body with a machine-readable
  code (`typed_rejection`: the exchange's and the resources server's `ErrorBody`, OpenAI's
  `{"error": {message, type, param, code}}` for the model server and the proxy);
* **a rejection changes nothing**: the service's state is snapshotted before the call and compared
  after it (`Target.snapshot` / `Target.assert_unchanged`; each target says what its state is);
* **auth**: calls go out with the right token, and every few calls the same call is sent again
  without a token and with a wrong one, which must be refused (typed, nothing changed) on the
  routes that need one.

Bounded: `ROLLMARKET_FUZZ_EXAMPLES` examples per operation and phase (default `DEFAULT_EXAMPLES`),
a fixed seed (`ROLLMARKET_FUZZ_SEED`), so a CI failure reproduces locally with the same numbers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import requests
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from rollmarket.contracts import ErrorBody

DEFAULT_EXAMPLES = 12
FUZZ_EXAMPLES = int(os.environ.get("ROLLMARKET_FUZZ_EXAMPLES", DEFAULT_EXAMPLES))
"""Examples per operation in the fuzzing phase; raise it to fuzz longer locally."""
FUZZ_TIMEOUT_S = 900 * max(1.0, FUZZ_EXAMPLES / DEFAULT_EXAMPLES)
"""pytest-timeout of one service's fuzz test (all its operations), grown with the examples."""
FUZZ_SEED = int(os.environ.get("ROLLMARKET_FUZZ_SEED", "20261126"))
UNAUTHENTICATED_EVERY = 3
"""Every this many calls, the call is repeated without a token and with a wrong one."""
REQUEST_TIMEOUT_S = 60.0


HOSTILE_INTEGERS = [2**63, 2**64, 2**64 + 1, -(2**63) - 1, 10**30, -(10**30), 2**31, -1]
"""Integers past what SQLite, msgpack, numpy and C code hold; hypothesis rarely draws them alone."""
HOSTILE_STRINGS = ["\x00", "a\x00b", "\U0001f600", "../../../etc/passwd", "%00", "\u202e", "a" * 5000, "{" * 200]
"""NUL bytes, astral characters, path tricks, long and brace-heavy text. (Lone surrogates cannot go
here: schemathesis checks values with a Rust validator that refuses them; the hand-written hostile
bodies of the keep-alive tests and the regression tests send them.)"""
HOSTILE_PROBABILITY = 0.15
"""How often a generated integer or string is taken from the lists above."""


def fuzz_config() -> schemathesis.Config:
    """Positive and negative generation, the examples, coverage and fuzzing phases, fixed seed,
    no example database (nothing carried between runs), no stateful phase; integers and strings
    are drawn from `HOSTILE_INTEGERS` / `HOSTILE_STRINGS` some of the time."""
    return schemathesis.Config.from_dict({
        "seed": FUZZ_SEED,
        "dictionaries": {"hostile-integers": {"values": HOSTILE_INTEGERS},
                         "hostile-strings": {"values": HOSTILE_STRINGS}},
        "generation": {"max-examples": FUZZ_EXAMPLES, "mode": "all", "database": "none", "dictionaries": {
            "integer": {"dictionary": "hostile-integers", "probability": HOSTILE_PROBABILITY},
            "string": {"dictionary": "hostile-strings", "probability": HOSTILE_PROBABILITY}}},
        "phases": {"stateful": {"enabled": False}},
        "suppress-health-check": ["all"],
    })


def load_schema(url: str) -> schemathesis.BaseSchema:
    """The service's OpenAPI document, fetched from the running server."""
    schema = schemathesis.openapi.from_url(url + "/openapi.json", config=fuzz_config())
    schema.config.update(base_url=url)
    return schema


# -- typed rejections ----------------------------------------------------------------------------

def exchange_error(body: Any) -> str:
    """The code of the exchange's (and the resources server's) ErrorBody; raises if it is not one."""
    return ErrorBody.model_validate(body).error.code.value


def openai_error(body: Any) -> str:
    """The type/code of OpenAI's error body; raises if it is not one."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, dict) and isinstance(error.get("message"), str) and error["message"], error
    assert isinstance(error.get("type"), str) and error["type"], error
    assert {"param", "code"} <= set(error), error
    return error.get("code") or error["type"]


def typed_rejection(parse):
    """A schemathesis check: every 4xx/5xx carries a JSON error body that `parse` accepts."""

    def typed_rejection(ctx, response, case) -> None:
        if response.status_code < 400:
            return None
        try:
            body = response.json()
        except ValueError:
            raise AssertionError(f"{response.status_code} without a JSON body: {response.text[:300]!r}") from None
        try:
            parse(body)
        except Exception as exc:
            raise AssertionError(f"{response.status_code} body is not a typed error ({exc}): {body!r}"[:800]) from None
        return None

    return typed_rejection


# -- targets -------------------------------------------------------------------------------------

@dataclass
class Target:
    """One service under fuzzing: how to authenticate, what its state is, what its errors look like."""

    url: str
    parse_error: Any
    session: requests.Session = field(default_factory=requests.Session)
    calls: int = 0
    per_operation: dict[str, int] = field(default_factory=dict)

    def headers(self, case) -> dict[str, str]:
        """Credentials for this operation (none by default)."""
        return {}

    def requires_auth(self, case) -> bool:
        return False

    def prepare(self, case) -> None:
        """Adjust a generated case before it is sent (bounds that keep calls fast)."""

    def snapshot(self) -> Any:
        return None

    def assert_unchanged(self, before: Any, after: Any, case, response) -> None:
        assert before == after, f"a rejected call changed state ({response.status_code})"

    def after_accepted(self, before: Any, after: Any, case, response) -> None:
        """Checks on the state after a 2xx (by default none)."""

    def _send(self, case, headers: dict[str, str]):
        before = self.snapshot()
        response = case.call(session=self.session, headers=headers, timeout=REQUEST_TIMEOUT_S)
        case.validate_response(response, checks=[not_a_server_error, response_schema_conformance,
                                                 typed_rejection(self.parse_error)], headers=headers)
        after = self.snapshot()
        if 400 <= response.status_code < 500:
            self.assert_unchanged(before, after, case, response)
        elif response.status_code < 300:
            self.after_accepted(before, after, case, response)
        return response

    def exercise(self, case) -> None:
        """Send the case (authenticated), and every few calls unauthenticated too; check each answer."""
        self.prepare(case)
        self.calls += 1
        self.per_operation[case.operation.label] = self.per_operation.get(case.operation.label, 0) + 1
        self._send(case, self.headers(case))
        if self.calls % UNAUTHENTICATED_EVERY == 0 and self.requires_auth(case):
            for headers in ({"authorization": ""}, {"authorization": "Bearer wrong-token"}):
                response = self._send(case, headers)
                assert 400 <= response.status_code < 500, (
                    f"{case.operation.label} answered {response.status_code} without valid credentials")
