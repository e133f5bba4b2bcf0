"""No 500 for a client's mistake, nothing learned about other workers, keep-alive after errors,
idempotent re-publishes, and /docs without the internet — against a real exchange process.

Every hostile request below gets a typed 4xx (an ErrorBody whose code is an ErrorCode) and
changes nothing: the SQLite file is snapshotted (every state table and the audit log) before and
after, from outside the server. The routes that take a body come from the running server's
OpenAPI document, so a route added later gets the generic hostile bodies without an edit here.
Before this work, deep nesting and integers past 64 bits answered 500, and a manifest or job
holding such a number was stored and then broke every lease that touched it.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import httpx
import msgpack
import pytest
import uvicorn
from helpers import (
    TRAINER_TOKEN,
    ExchangeProcess,
    Snapshot,
    assert_unchanged,
    job,
    lease_one,
    manifest,
    policy,
    ready_worker,
    sha,
    snapshot,
    trajectories,
)

from rollmarket import TrainerClient, WorkerClient
from rollmarket.client.errors import Conflict, Rejected
from rollmarket.contracts import ErrorBody, ErrorCode, LeaseGrant, RejectionReason, SubmissionReceipt
from rollmarket.contracts.wire import JSON, MSGPACK, embed, packb
from rollmarket.localhost import free_port

CALM = ("--heartbeat-ttl-s", "3600", "--lease-ttl-s", "3600", "--reaper-interval-s", "0.1",
        "--preference-hold-s", "0", "--max-body-bytes", str(1 << 20))
BIG = 2**64 - 1
"""The largest integer msgpack can carry (uint64): past SQLite's int64."""


@dataclass
class Bed:
    server: ExchangeProcess
    trainer: TrainerClient
    w1: WorkerClient
    w2: WorkerClient
    stored: SubmissionReceipt
    """A group w1 delivered."""
    held: LeaseGrant
    """A lease w1 still holds."""

    def snapshot(self) -> Snapshot:
        return snapshot(self.server.db)


@pytest.fixture(scope="module")
def bed(tmp_path_factory) -> Iterator[Bed]:
    root = tmp_path_factory.mktemp("hostile")
    server = ExchangeProcess(db=root / "exchange.db", log=root / "exchange.log", args=list(CALM)).start(timeout=120)
    trainer = server.trainer()
    trainer.publish_policy(policy(0))
    w1 = ready_worker(server.url, "w1", max_concurrent_groups=64)
    w2 = ready_worker(server.url, "w2", max_concurrent_groups=64)
    trainer.enqueue(job(0))
    grant = lease_one(w1)
    stored = w1.submit(w1.group_for(grant, trajectories(2)))
    trainer.enqueue(job(1))
    held = lease_one(w1)
    try:
        yield Bed(server, trainer, w1, w2, stored, held)
    finally:
        for client in (w1, w2, trainer):
            client.close()
        server.stop()


def send(bed: Bed, method: str, path: str, *, token: str | None = None, body: bytes | None = None,
         content_type: str = JSON, headers: dict[str, str] | None = None) -> httpx.Response:
    sent = {"content-type": content_type, **(headers or {})}
    if token is not None:
        sent["authorization"] = f"Bearer {token}"
    return httpx.request(method, bed.server.url + path, content=body, headers=sent, timeout=60)


def typed_4xx(response: httpx.Response) -> ErrorCode:
    assert 400 <= response.status_code < 500, f"{response.status_code}: {response.text[:500]}"
    return ErrorBody.model_validate(response.json()).error.code


def assert_refused_and_unchanged(bed: Bed, request) -> httpx.Response:
    """Send `request(bed)`; it must be a typed 4xx that changed nothing (a gate rejection may add
    its one audit event and its quality accounting, as documented in docs/dev-notes.md)."""
    before = bed.snapshot()
    response = request(bed)
    code = typed_4xx(response)
    if code is ErrorCode.rejected:
        sender = "w1" if "w1" in response.request.headers.get("authorization", "") else "w2"
        assert_unchanged(before, bed.snapshot(), audit=("submission.rejected",), rejected_by=sender)
    else:
        assert_unchanged(before, bed.snapshot())
    return response


# -- the generic hostile bodies on every route that takes one -----------------------------------

def body_routes(url: str) -> list[tuple[str, str, str]]:
    """(method, path template, OpenAPI tag) of every operation with a request body."""
    spec = httpx.get(url + "/openapi.json", timeout=30).json()
    return sorted((method.upper(), path, (op.get("tags") or ["?"])[0])
                  for path, operations in spec["paths"].items() for method, op in operations.items()
                  if "requestBody" in op)


def concrete(bed: Bed, path: str) -> str:
    return path.replace("{lease_id}", bed.held.lease.lease_id).replace("{group_id}", bed.stored.group_id)


def token_for(bed: Bed, tag: str, path: str) -> str | None:
    if path == "/v1/workers/register":
        return None
    return TRAINER_TOKEN if tag == "trainer" else bed.w1.http.token


GENERIC_BODIES = {
    "json-nested-100k": (b"[" * 100_000 + b"]" * 100_000, JSON),
    "json-objects-nested-5k": (b'{"a":' * 5_000 + b"1" + b"}" * 5_000, JSON),
    "msgpack-nested-100k": (b"\x91" * 100_000 + b"\xc0", MSGPACK),
    "msgpack-nested-900": (b"\x81\xa1a" * 900 + b"\xc0", MSGPACK),
    "json-duplicate-keys": (b'{"worker_id": "w1", "worker_id": "w2"}', JSON),
    "json-lone-surrogate": (b'{"worker_id": "\\ud800"}', JSON),
    "json-utf16": ('{"worker_id": "w1"}'.encode("utf-16"), "application/json; charset=utf-16"),
    "json-nul-bytes": (b'{"worker_id": "w\\u0000"}', JSON),
    "json-integer-200-digits": (b'{"policy_version": ' + b"9" * 200 + b"}", JSON),
    "json-nan-everywhere": (b'{"price_hint": NaN, "score": Infinity, "wall_time_s": -Infinity}', JSON),
    "json-empty": (b"", JSON),
    "json-whitespace": (b" \n\t ", JSON),
    "json-null": (b"null", JSON),
    "msgpack-empty": (b"", MSGPACK),
    "msgpack-embedded-document": (msgpack.packb({"a": embed(packb({"b": 1}))}), MSGPACK),
    "msgpack-unknown-ext": (msgpack.packb({"a": msgpack.ExtType(99, b"\x00" * 8)}), MSGPACK),
    "msgpack-timestamp-out-of-range": (b"\x81\xa2at\xc7\x0c\xff" + b"\x7f" * 12, MSGPACK),
    "msgpack-bin-and-int-keys": (msgpack.packb({1: b"\xff", b"k": [BIG, -(2**63)]}, use_bin_type=True), MSGPACK),
    "msgpack-uint64": (msgpack.packb({"policy_version": BIG, "queue_depth": BIG}), MSGPACK),
    "json-as-msgpack": (b'{"worker_id": "w1"}', MSGPACK),
    "text-plain": (b"hello", "text/plain"),
    "no-content-type": (b'{"a": 1}', ""),
    "form": (b"a=1&b=2", "application/x-www-form-urlencoded"),
    "multipart": (b"--x\r\n\r\n--x--", "multipart/form-data; boundary=x"),
    "oversized": (b"[" + b"0," * (600_000) + b"0]", JSON),
}


def pytest_generate_tests(metafunc):
    if "body_route" in metafunc.fixturenames:
        # The route list is known only once a server runs; a throwaway one answers the question.
        from rollmarket.exchange.app import create_app
        from rollmarket.exchange.settings import ExchangeSettings

        spec = create_app(ExchangeSettings(db=Path("/nonexistent/x.db"), trainer_token="t")).openapi()
        found = sorted((method.upper(), path, (op.get("tags") or ["?"])[0])
                       for path, operations in spec["paths"].items() for method, op in operations.items()
                       if "requestBody" in op)
        cases = [(route, name) for route in found for name in GENERIC_BODIES]
        metafunc.parametrize("body_route,body_name", cases, ids=[f"{r[0]}{r[1]}-{n}" for r, n in cases])


def test_every_body_route_refuses_hostile_bodies(bed: Bed, body_route, body_name):
    method, path, tag = body_route
    body, content_type = GENERIC_BODIES[body_name]
    response = assert_refused_and_unchanged(bed, lambda b: send(
        b, method, concrete(b, path), token=token_for(b, tag, path), body=body, content_type=content_type))
    if body_name.startswith(("json-nested", "json-objects", "msgpack-nested")):
        assert response.status_code == 400 and response.json()["error"]["details"]["reason"] == "too_deep"


def test_the_route_list_is_what_this_file_expects(bed: Bed):
    """A guard for the generator above: it saw the same body routes as the running server."""
    assert {(m, p) for m, p, _ in body_routes(bed.server.url)} >= {
        ("POST", "/v1/workers/register"), ("POST", "/v1/workers/heartbeat"), ("POST", "/v1/groups"),
        ("POST", "/v1/leases/{lease_id}/fail"), ("POST", "/v1/reload-acks"), ("POST", "/v1/policies"),
        ("POST", "/v1/jobs"), ("POST", "/v1/groups/{group_id}/report")}


# -- values a contract must refuse, in bodies that are otherwise right ---------------------------

def _json(value) -> bytes:
    return json.dumps(value).encode()


def _manifest(**changes) -> bytes:
    return _json(manifest("w-new").model_dump(mode="json") | changes)


def _jobs(**changes) -> bytes:
    return _json({"jobs": [job(50).model_dump(mode="json") | changes]})


def _task(**changes) -> bytes:
    data = job(51).model_dump(mode="json")
    data["task"] |= changes
    return _json({"jobs": [data]})


def _policy(**changes) -> bytes:
    return _json(policy(1).model_dump(mode="json") | changes)


def _group(bed: Bed, **changes) -> bytes:
    group = bed.w1.seal(bed.w1.group_for(bed.held, trajectories(2)))
    return packb(group.model_dump(mode="python") | changes)


def _trajectory_field(bed: Bed, name: str, value) -> bytes:
    data = bed.w1.seal(bed.w1.group_for(bed.held, trajectories(2))).model_dump(mode="python")
    data["trajectories"][0][name] = value
    return packb(data)


def _report(bed: Bed, **report_changes) -> bytes:
    decision = {"group_id": bed.stored.group_id, "status": "train", "recommended_action": "use",
                "report": {"group_id": bed.stored.group_id, "n_tokens": 4, "n_sequences": 2, "clamp": 20.0,
                           "token_ess": 1.0, "sequence_ess": 1.0, "mean_delta": 0.0, "mean_abs_delta": 0.0,
                           "max_abs_delta": 0.0, "clipped_fraction": 0.0, "veto_fraction": 0.0,
                           "second_moment": 1.0, "top1pct_mass": 0.0, "kl_k1": 0.0, "kl_k3": 0.0, "chi2": 0.0,
                           "mean_prob_diff": 0.0, **report_changes}}
    return _json({"decision": decision})


VALUE_CASES = {
    # name: (method, path, who, body(bed))
    "manifest context 2^70": ("POST", "/v1/workers/register", None, lambda b: _manifest(max_context_tokens=2**70)),
    "manifest context 2^63": ("POST", "/v1/workers/register", None, lambda b: _manifest(max_context_tokens=2**63)),
    "manifest concurrency 2^64-1": ("POST", "/v1/workers/register", None,
                                    lambda b: packb(manifest("w-new").model_dump(mode="python") | {"device_count": BIG})),
    "manifest price 1e308": ("POST", "/v1/workers/register", None, lambda b: _manifest(price_hint=1e308)),
    "manifest NUL in id": ("POST", "/v1/workers/register", None, lambda b: _manifest(worker_id="w\u0000x")),
    "manifest unicode id": ("POST", "/v1/workers/register", None, lambda b: _manifest(worker_id="wörker")),
    "manifest 5k tokenizers": ("POST", "/v1/workers/register", None,
                               lambda b: _manifest(supported_tokenizer_hashes=[sha(str(i)) for i in range(5000)])),
    "manifest engine name 1k": ("POST", "/v1/workers/register", None, lambda b: _manifest(engine_name="e" * 1000)),
    "job priority 2^63": ("POST", "/v1/jobs", "trainer", lambda b: _jobs(priority=2**63)),
    "job priority -2^63-1": ("POST", "/v1/jobs", "trainer", lambda b: _jobs(priority=-(2**63) - 1)),
    "job context 2^70": ("POST", "/v1/jobs", "trainer", lambda b: _jobs(max_context_tokens=2**70)),
    "job version 2^63": ("POST", "/v1/jobs", "trainer", lambda b: _jobs(policy_version=2**63)),
    "job deadline before year 1 UTC": ("POST", "/v1/jobs", "trainer",
                                       lambda b: _jobs(deadline="0001-01-01T00:00:00+05:00")),
    "job deadline year 10000": ("POST", "/v1/jobs", "trainer", lambda b: _jobs(deadline="10000-01-01T00:00:00Z")),
    "job seed 2^64-1": ("POST", "/v1/jobs", "trainer", lambda b: packb({"jobs": [
        job(52).model_dump(mode="python") | {"sampling_config": {"seed": BIG}, "sampling_config_hash": None}]})),
    "task answer 2^70": ("POST", "/v1/jobs", "trainer", lambda b: _task(answer=2**70)),
    "task metadata bytes": ("POST", "/v1/jobs", "trainer", lambda b: packb({"jobs": [
        job(53).model_dump(mode="python") | {"task": job(53).task.model_dump(mode="python") | {"metadata": {"b": b"\xff"}}}]})),
    "task metadata array": ("POST", "/v1/jobs", "trainer", lambda b: packb({"jobs": [
        job(54).model_dump(mode="python") | {"task": job(54).task.model_dump(mode="python")
                                             | {"metadata": {"a": trajectories(1)[0].logprobs}}}]})),
    "task metadata 40 deep": ("POST", "/v1/jobs", "trainer", lambda b: _task(metadata={"a": json.loads("[" * 40 + "]" * 40)})),
    "task verifier args NaN": ("POST", "/v1/jobs", "trainer",
                               lambda b: _task(verifier_args={"x": 1}).replace(b'"x": 1', b'"x": NaN')),
    "policy version 2^63": ("POST", "/v1/policies", "trainer", lambda b: _policy(policy_version=2**63, parent_version=0)),
    "policy version 2^64-1 msgpack": ("POST", "/v1/policies", "trainer",
                                      lambda b: packb(policy(1).model_dump(mode="python") | {"policy_version": BIG})),
    "policy vocab 2^70": ("POST", "/v1/policies", "trainer", lambda b: _policy(vocab_size=2**70)),
    "policy created before year 1 UTC": ("POST", "/v1/policies", "trainer",
                                         lambda b: _policy(created_at="0001-01-01T00:00:00+05:00")),
    "heartbeat queue 2^64-1": ("POST", "/v1/workers/heartbeat", "w1",
                               lambda b: packb({"worker_id": "w1", "queue_depth": BIG})),
    "heartbeat version 2^70": ("POST", "/v1/workers/heartbeat", "w1",
                               lambda b: _json({"worker_id": "w1", "loaded_policy_version": 2**70})),
    "ack version 2^63": ("POST", "/v1/reload-acks", "w1", lambda b: _json({
        "worker_id": "w1", "policy_version": 2**63, "checkpoint_digest": sha("ckpt-0"), "engine_fingerprint": "f"})),
    "fail message 1M": ("POST", "/v1/leases/{lease_id}/fail", "w1",
                        lambda b: _json({"kind": "other", "message": "m" * 100_000})),
    "group version 2^64-1": ("POST", "/v1/groups", "w1", lambda b: _group(b, policy_version=BIG)),
    "group turn boundary 2^70": ("POST", "/v1/groups", "w1", lambda b: _trajectory_field(b, "turn_boundaries", [BIG])),
    "group 5k reward components": ("POST", "/v1/groups", "w1", lambda b: _trajectory_field(
        b, "reward_components", {f"c{i}": 0.0 for i in range(5000)})),
    "group sample index 2^63": ("POST", "/v1/groups", "w1", lambda b: _trajectory_field(b, "sample_index", 2**63 - 1)),
    "group lag 2^64-1": ("POST", "/v1/groups", "w1", lambda b: _group(b, policy_lag_steps=BIG)),
    "report n_tokens 2^70": ("POST", "/v1/groups/{group_id}/report", "trainer", lambda b: _report(b, n_tokens=2**70)),
}


@pytest.mark.parametrize("case", sorted(VALUE_CASES))
def test_out_of_range_values_are_refused(bed: Bed, case):
    method, path, who, make = VALUE_CASES[case]
    token = {None: None, "trainer": TRAINER_TOKEN, "w1": bed.w1.http.token}[who]
    body = make(bed)
    content_type = JSON if body[:1] in (b"{", b"[") else MSGPACK
    response = assert_refused_and_unchanged(bed, lambda b: send(b, method, concrete(b, path), token=token,
                                                                 body=body, content_type=content_type))
    assert response.status_code in (400, 413, 422), response.text


QUERY_CASES = [
    ("GET", "/v1/audit?since_seq=9223372036854775808"), ("GET", "/v1/audit?since_seq=" + "9" * 40),
    ("GET", "/v1/audit?limit=" + "9" * 30), ("GET", "/v1/audit?kind=" + "k" * 1000),
    ("GET", "/v1/groups?policy_version=18446744073709551616"), ("GET", "/v1/groups?max_staleness=" + "9" * 25),
    ("GET", "/v1/groups?limit=1e3"), ("GET", "/v1/groups?precision_class=" + "p" * 500),
    ("GET", "/v1/groups?trainer_id=no%20spaces"), ("GET", "/v1/groups?trainer_id=%00"),
    ("GET", "/v1/jobs?limit=" + "9" * 30), ("GET", "/v1/jobs?state=" + "s" * 100),
    ("POST", "/v1/policies?quorum=" + "9" * 30), ("POST", "/v1/policies?quorum=2147483648"),
    ("POST", "/v1/leases?wait_s=nan"), ("POST", "/v1/leases?wait_s=inf"), ("POST", "/v1/leases?wait_s=1e400"),
    ("POST", "/v1/leases?wait_s=-0.5"), ("POST", "/v1/leases?wait_s=1e10"),
    ("GET", "/v1/groups/..%2F..%2Fpool"), ("GET", "/v1/groups/" + "g" * 200), ("GET", "/v1/groups/%F0%9F%98%80"),
    ("POST", "/v1/leases/%00/renew"), ("POST", "/v1/leases/a%20b/fail"), ("POST", "/v1/leases/" + "l" * 300 + "/renew"),
    ("GET", "/v1/nothing-here"), ("DELETE", "/v1/pool"), ("PUT", "/v1/groups"),
]


@pytest.mark.parametrize("method,path", QUERY_CASES, ids=[f"{m} {p[:60]}" for m, p in QUERY_CASES])
def test_hostile_parameters_and_paths_are_refused(bed: Bed, method, path):
    token = bed.w1.http.token if path.startswith("/v1/leases") else TRAINER_TOKEN
    body = policy(1).model_dump_json().encode() if path.startswith("/v1/policies") else None
    assert_refused_and_unchanged(bed, lambda b: send(b, method, path, token=token, body=body))


HEADER_CASES = {
    "trainer id header with spaces": {"authorization": f"Bearer {TRAINER_TOKEN}", "x-trainer-id": "a b"},
    "trainer id header latin-1": {"authorization": f"Bearer {TRAINER_TOKEN}", "x-trainer-id": "tr\xe4iner"},
    "bearer latin-1": {"authorization": "Bearer tr\xe4iner-\xff"},
    "bearer 8k": {"authorization": "Bearer " + "x" * 8000},
    "bearer without token": {"authorization": "Bearer"},
    "worker token shape with latin-1": {"authorization": "Bearer rmw.w1.\xe9\xe9\xe9"},
    "worker token with dots only": {"authorization": "Bearer rmw...."},
    "basic scheme": {"authorization": "Basic dzE6eA=="},
}


@pytest.mark.parametrize("case", sorted(HEADER_CASES))
def test_hostile_headers_are_refused(bed: Bed, case):
    headers = HEADER_CASES[case]
    for path in ("/v1/groups",) if "x-trainer-id" in headers else ("/v1/groups", "/v1/pool", "/v1/leases"):
        raw = {name: value.encode("latin-1") for name, value in headers.items()}
        method = "POST" if path == "/v1/leases" else "GET"
        response = assert_refused_and_unchanged(bed, lambda b: httpx.request(method, b.server.url + path,
                                                                            headers=raw, timeout=30))
        assert response.status_code in (401, 422)


def test_the_exchange_still_leases_and_stores_after_all_of_it(bed: Bed):
    """No poison was stored: a fresh job is leased and delivered as usual."""
    fresh = job(90)
    bed.trainer.enqueue(fresh)
    grant = lease_one(bed.w2)
    assert grant.job.job_id == fresh.job_id
    assert bed.w2.submit(bed.w2.group_for(grant, trajectories(2))).lease_id == grant.lease.lease_id


# -- no information crosses between workers ----------------------------------------------------

def w1_secrets(bed: Bed) -> list[str]:
    """What w2 must never read in an answer: w1's lease, group, content hash and token."""
    return [bed.held.lease.lease_id, bed.stored.lease_id, bed.stored.group_id, bed.stored.content_hash,
            bed.w1.http.token.rsplit(".", 1)[1]]


def test_not_yours_and_does_not_exist_answer_alike(bed: Bed):
    """w2 renewing, failing or delivering for w1's lease gets exactly the answer it gets for a
    lease that was never issued: same status, same body, byte for byte."""
    theirs, nobodys = bed.held.lease.lease_id, "lease_never_issued_anywhere"
    for verb in ("renew", "fail"):
        body = _json({"kind": "other"}) if verb == "fail" else None
        answers = [send(bed, "POST", f"/v1/leases/{lease}/{verb}", token=bed.w2.http.token, body=body)
                   for lease in (theirs, nobodys)]
        assert [a.status_code for a in answers] == [404, 404]
        assert answers[0].content == answers[1].content
    group = bed.w2.group_for(bed.held, trajectories(2))
    bodies = [packb(bed.w2.seal(group.model_copy(update={"lease_id": lease}))) for lease in (theirs, nobodys)]
    answers = [send(bed, "POST", "/v1/groups", token=bed.w2.http.token, body=body, content_type=MSGPACK)
               for body in bodies]
    assert [a.status_code for a in answers] == [422, 422]
    assert answers[0].json()["error"]["reasons"] == ["unknown_lease"]
    assert answers[0].content == answers[1].content
    for answer in answers:
        assert not any(secret in answer.text for secret in w1_secrets(bed))


def test_lease_ownership_is_checked_before_idempotency(bed: Bed):
    """w2 re-sends w1's delivered group as its own (same group id, same lease id): it learns
    neither that the group exists (no duplicate receipt) nor anything of it (no conflict naming
    its hash); it is an unknown lease. The same under its own lease with w1's group id: a bare
    conflict that names nothing of w1's."""
    delivered = bed.trainer.group(bed.stored.group_id).group
    as_w2 = delivered.model_copy(update={"worker_id": "w2", "content_hash": None, "signature": None}).sealed()
    before = bed.snapshot()
    with pytest.raises(Rejected) as caught:
        bed.w2.submit(as_w2)
    assert caught.value.rejection_reasons == [RejectionReason.unknown_lease]
    assert_unchanged(before, bed.snapshot(), audit=("submission.rejected",), rejected_by="w2")
    assert not any(secret in json.dumps(caught.value.details) + caught.value.message for secret in w1_secrets(bed))

    bed.trainer.enqueue(job(60))
    own = lease_one(bed.w2)
    squatting = bed.w2.group_for(own, trajectories(2), group_id=bed.stored.group_id)
    before = bed.snapshot()
    with pytest.raises(Conflict) as conflict:
        bed.w2.submit(squatting)
    assert conflict.value.code == "idempotency_conflict"
    assert conflict.value.details == {}
    assert_unchanged(before, bed.snapshot())
    text = conflict.value.message
    assert not any(secret in text for secret in w1_secrets(bed)), text
    assert bed.w2.submit(bed.w2.group_for(own, trajectories(2))).lease_id == own.lease.lease_id


def test_a_refused_reload_ack_names_no_other_worker(bed: Bed):
    """w2 acks version 0 with the wrong digest: the answer names the published digest and w2's
    own, never w1's ack (that goes to the audit log only)."""
    with pytest.raises(Conflict) as caught:
        bed.w2.ack_reload(0, sha("weights nobody published"))
    assert caught.value.code == "digest_mismatch"
    text = caught.value.message + json.dumps(caught.value.details)
    assert "w1" not in re.findall(r"[\w-]+", text)
    violation = bed.trainer.audit(kind="reload.violation").events[-1]
    assert {a["worker_id"] for a in violation.data["other_acks"]} >= {"w1"}


# -- publishing the same policy again ----------------------------------------------------------

def test_republishing_the_same_content_is_idempotent(bed: Bed):
    """The same manifest rebuilt later (a new created_at, as a retry or a resumed trainer makes
    it) is 200 and changes nothing; other content under the version is still a 409."""
    stored = bed.trainer.policies()[0]
    again = policy(0)
    assert again.created_at != stored.created_at
    before = bed.snapshot()
    status = bed.trainer.publish_policy(again)
    assert status.published_version == 0
    assert_unchanged(before, bed.snapshot())
    assert bed.trainer.policies() == [stored]
    with pytest.raises(Conflict) as caught:
        bed.trainer.publish_policy(policy(0, checkpoint_digest=sha("other weights")))
    assert caught.value.code == "version_conflict"
    assert_unchanged(before, bed.snapshot())


# -- the same keep-alive connection serves on after any error ----------------------------------

def test_errors_keep_the_connection_alive(bed: Bed):
    """One raw HTTP/1.1 connection: each hostile request gets its typed 4xx, then a good request
    on the same socket is answered (the socket is the same one: same local port, never reopened)."""
    host, port = bed.server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.connect()
    local = conn.sock.getsockname()
    worker = {"authorization": f"Bearer {bed.w1.http.token}"}
    trainer = {"authorization": f"Bearer {TRAINER_TOKEN}"}
    hostile = [
        ("POST", "/v1/jobs", b"[" * 100_000 + b"]" * 100_000, {**trainer, "content-type": JSON}, 400),
        ("POST", "/v1/workers/heartbeat", b"\x91" * 100_000 + b"\xc0", {**worker, "content-type": MSGPACK}, 400),
        ("GET", "/v1/audit?since_seq=" + "9" * 30, None, trainer, 422),
        ("POST", "/v1/policies", _policy(policy_version=2**63, parent_version=0), {**trainer, "content-type": JSON}, 422),
        ("POST", "/v1/workers/register", _manifest(max_context_tokens=2**70), {"content-type": JSON}, 422),
        ("POST", "/v1/groups", b"hello", {**worker, "content-type": "text/plain"}, 415),
        ("GET", "/v1/pool", None, {"authorization": "Bearer wrong"}, 401),
        ("GET", "/v1/pool", None, worker, 403),
        ("GET", "/v1/nowhere", None, {}, 404),
        ("DELETE", "/v1/pool", None, trainer, 405),
        ("POST", "/v1/leases/lease_nope/renew", None, worker, 404),
        ("POST", "/v1/groups", b"x" * ((1 << 20) + 10), {**worker, "content-type": JSON}, 413),
    ]
    for method, path, body, headers, status in hostile:
        conn.request(method, path, body=body, headers=headers)
        answer = conn.getresponse()
        data = answer.read()
        assert answer.status == status, (path, answer.status, data[:300])
        assert ErrorBody.model_validate_json(data).error.code
        assert answer.getheader("connection", "").lower() != "close", (path, answer.headers)
        conn.request("GET", "/v1/pool", headers=trainer)
        good = conn.getresponse()
        assert good.status == 200, (path, good.status)
        good.read()
        assert conn.sock is not None and conn.sock.getsockname() == local, f"reconnected after {path}"
    conn.close()


# -- the one boundary: an unexpected exception is a typed answer on a live connection ------------

def test_the_boundary_answers_typed_and_keeps_the_connection(tmp_path, caplog):
    """A route that fails (a server bug) is answered `500 internal` with an ErrorBody and its
    traceback logged; one that meets a value only a client can send (OverflowError,
    RecursionError) is answered 422; either way the connection serves the next request."""
    from rollmarket.exchange.app import create_app
    from rollmarket.exchange.settings import ExchangeSettings

    app = create_app(ExchangeSettings(db=tmp_path / "x.db", trainer_token="t"))

    @app.get("/boom/{kind}")
    async def boom(kind: str):
        raise {"bug": KeyError("a bug"), "overflow": OverflowError("Python int too large to convert to SQLite INTEGER"),
               "recursion": RecursionError("maximum recursion depth exceeded")}[kind]

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            for _ in range(200):
                try:
                    if client.get("/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    threading.Event().wait(0.05)
            connects: list[str] = []

            def get(path: str) -> httpx.Response:
                return client.get(path, extensions={"trace": lambda name, info: connects.append(name)
                                                    if name == "connection.connect_tcp.complete" else None})

            with caplog.at_level("ERROR", logger="rollmarket.exchange.app"):
                for kind, status, code in (("bug", 500, "internal"), ("overflow", 422, "invalid_request"),
                                           ("recursion", 422, "invalid_request")):
                    answer = get(f"/boom/{kind}")
                    assert answer.status_code == status
                    assert ErrorBody.model_validate(answer.json()).error.code.value == code
                    assert get("/healthz").status_code == 200
            assert connects == [], "the client had to open a new connection"
            assert [r.exc_info[0] for r in caplog.records if r.exc_info] == [KeyError, OverflowError, RecursionError]
    finally:
        server.should_exit = True
        thread.join(10)


# -- /docs works without the internet ----------------------------------------------------------

class _Assets(HTMLParser):
    def __init__(self):
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for name in ("src", "href"):
            if attrs.get(name) and tag in ("script", "link", "img"):
                self.urls.append(attrs[name])


def test_docs_page_assets_are_served_by_the_exchange(bed: Bed):
    """Every script, stylesheet and icon /docs names is a local path the exchange answers 200."""
    page = httpx.get(bed.server.url + "/docs", timeout=30)
    assert page.status_code == 200 and "swagger-ui" in page.text
    parser = _Assets()
    parser.feed(page.text)
    assert len(parser.urls) >= 3, parser.urls
    assert not re.search(r"https?://|//cdn|jsdelivr|unpkg", page.text), "the page names a remote URL"
    for url in parser.urls:
        assert url.startswith("/"), url
        asset = httpx.get(bed.server.url + url, timeout=30)
        assert asset.status_code == 200 and len(asset.content) > 100, url


def test_docs_page_renders_the_operations_offline_in_chromium(bed: Bed):
    """Headless Chromium with every request outside the exchange blocked: the page loads and lists
    the exchange's operations."""
    from dashboard_browser import chromium

    blocked: list[str] = []
    with chromium() as browser:
        page = browser.new_page()

        def gate(route):
            if route.request.url.startswith(bed.server.url):
                return route.continue_()
            blocked.append(route.request.url)
            return route.abort()

        page.route("**/*", gate)
        page.goto(bed.server.url + "/docs")
        page.wait_for_selector(".opblock-summary-path", timeout=60_000)
        paths = page.locator(".opblock-summary-path").all_inner_texts()
    assert blocked == []
    assert any("/v1/groups" in p for p in paths) and any("/v1/leases" in p for p in paths), paths
