"""Bad input gets a typed 4xx and changes nothing (DESIGN.md, 'Standards every part meets').

Every test here runs a real exchange process and talks to it over loopback. Around each bad
request it takes a snapshot of the SQLite file, opened read-only from outside the server, and
asserts that no state table changed. The audit log is the one place a refusal may leave a trace,
and only the traces named by the test: a rejected submission records one `submission.rejected`
event, a reload ack with a wrong digest one `reload.violation`; everything else records nothing.
(A gate rejection also counts once against the sender's quality, on purpose; see
`assert_unchanged`.)

Broken bodies bypass the client's sealing and validation: they are msgpack from
`rollmarket.contracts.wire.packb` on plain data, or JSON text written by hand, posted with httpx
and the worker's own token. Groups that are valid contracts but wrong for their lease go through
`WorkerClient.submit`, so that the client's typed `Rejected` error is checked as well.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import msgpack
import numpy as np
import pytest
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
from rollmarket.client.errors import Conflict, DigestMismatch, InvalidRequest, Rejected
from rollmarket.contracts import (
    ErrorBody,
    LeaseGrant,
    RejectionReason,
    SampleGroup,
    SamplingConfig,
    Trajectory,
)
from rollmarket.contracts.wire import JSON, MSGPACK, packb

CALM = ("--heartbeat-ttl-s", "3600", "--lease-ttl-s", "3600", "--reaper-interval-s", "0.1")
"""Settings under which the reaper never changes anything while a test runs."""


# -- requests -----------------------------------------------------------------------------

def post(url: str, path: str, token: str | None, content, content_type: str = JSON) -> httpx.Response:
    """POST raw bytes (or a byte generator) with the given token, bypassing every client check."""
    headers = {"content-type": content_type}
    if token is not None:
        headers["authorization"] = f"Bearer {token}"
    return httpx.post(url + path, content=content, headers=headers, timeout=30)


def error_of(response: httpx.Response, status: int, code: str):
    """The response's ErrorDetail, after checking its status and typed code."""
    assert response.status_code == status, response.text
    detail = ErrorBody.model_validate(response.json()).error
    assert detail.code.value == code, detail
    return detail


def as_json_text(group: SampleGroup) -> bytes:
    """The group as JSON text, as a person would write it."""
    return json.dumps(group.model_dump(mode="json")).encode()


def rebuilt(t: Trajectory, **changes) -> Trajectory:
    """A validated copy of a trajectory with some fields replaced (arrays cast to their dtype)."""
    return Trajectory.model_validate({**{name: getattr(t, name) for name in Trajectory.model_fields}, **changes})


# -- a long-lived exchange for the gate's rejection matrix ----------------------------------

@dataclass
class Market:
    server: ExchangeProcess
    trainer: TrainerClient
    worker: WorkerClient
    counter: Iterator[int]

    def grant(self, **job_overrides) -> LeaseGrant:
        """A fresh lease on a fresh job of two samples, held by `worker`."""
        queued = job(next(self.counter), **job_overrides)
        self.trainer.enqueue(queued)
        grant = lease_one(self.worker)
        assert grant.job.job_id == queued.job_id
        return grant

    def snapshot(self) -> Snapshot:
        return snapshot(self.server.db)


@pytest.fixture(scope="module")
def market(tmp_path_factory) -> Iterator[Market]:
    """One exchange shared by the rejection matrix: rejections change nothing, so tests
    that each hold their own lease cannot disturb one another."""
    root = tmp_path_factory.mktemp("bad-input")
    # Rejections lower w1's quality; with no preference hold a better-ranked idle worker
    # (one test registers another) cannot make w1 wait for its next lease.
    server = ExchangeProcess(db=root / "exchange.db", log=root / "exchange.log",
                             args=[*CALM, "--preference-hold-s", "0"]).start()
    trainer = server.trainer()
    trainer.publish_policy(policy(0))
    worker = ready_worker(server.url, "w1", max_concurrent_groups=1024)
    try:
        yield Market(server, trainer, worker, itertools.count())
    finally:
        worker.close()
        trainer.close()
        server.stop()


# -- groups that are valid contracts but fail the gate --------------------------------------

def _short_logprobs(worker: WorkerClient, grant: LeaseGrant) -> SampleGroup:
    t0, t1 = trajectories(2)
    return worker.group_for(grant, [rebuilt(t0, logprobs=t0.logprobs[:-1]), t1])


def _positive_logprobs(worker: WorkerClient, grant: LeaseGrant) -> SampleGroup:
    t0, t1 = trajectories(2)
    logprobs = t0.logprobs.copy()
    logprobs[3] = 0.5
    return worker.group_for(grant, [rebuilt(t0, logprobs=logprobs), t1])


def _missing_logprobs(worker: WorkerClient, grant: LeaseGrant) -> SampleGroup:
    t0, t1 = trajectories(2)
    return worker.group_for(grant, [t0, rebuilt(t1, logprobs=None)])


def _missing_response_ids(worker: WorkerClient, grant: LeaseGrant) -> SampleGroup:
    t0, t1 = trajectories(2)
    return worker.group_for(grant, [rebuilt(t0, response_token_ids=None), t1])


def _missing_prompt_ids(worker: WorkerClient, grant: LeaseGrant) -> SampleGroup:
    t0, t1 = trajectories(2)
    return worker.group_for(grant, [t0, rebuilt(t1, prompt_token_ids=None)])


def _mask_overlap(worker: WorkerClient, grant: LeaseGrant) -> SampleGroup:
    t0, t1 = trajectories(2)
    tool_T = np.zeros(t0.num_response_tokens, np.uint8)
    tool_T[5] = 1  # action_mask is all ones, so token 5 is both action and tool output
    return worker.group_for(grant, [rebuilt(t0, tool_output_mask=tool_T), t1])


def _turn_boundary_outside(worker: WorkerClient, grant: LeaseGrant) -> SampleGroup:
    t0, t1 = trajectories(2)
    return worker.group_for(grant, [t0, rebuilt(t1, turn_boundaries=[0, t1.num_response_tokens])])


def _tampered_after_sealing(worker: WorkerClient, grant: LeaseGrant) -> SampleGroup:
    t0, t1 = trajectories(2)
    sealed = worker.seal(worker.group_for(grant, [t0, t1]))
    ids = t0.response_token_ids.copy()
    ids[0] = (ids[0] + 1) % 1000
    return sealed.model_copy(update={"trajectories": [rebuilt(t0, response_token_ids=ids), t1]})


def _three_samples_for_two(worker: WorkerClient, grant: LeaseGrant) -> SampleGroup:
    return worker.group_for(grant, trajectories(3))


def _override(**fields) -> Callable[[WorkerClient, LeaseGrant], SampleGroup]:
    def build(worker: WorkerClient, grant: LeaseGrant) -> SampleGroup:
        return worker.group_for(grant, trajectories(2), **fields)
    return build


def _token_at_vocab_size(worker: WorkerClient, grant: LeaseGrant) -> SampleGroup:
    t0, t1 = trajectories(2)
    ids = t1.response_token_ids.copy()
    ids[-1] = grant.policy.vocab_size  # ids must lie below vocab_size
    return worker.group_for(grant, [t0, rebuilt(t1, response_token_ids=ids)])


GATE_CASES = {
    # name: (build the group, job overrides, the only rejection reason expected)
    "logprobs_shorter_than_response": (_short_logprobs, {}, "length_mismatch"),
    "positive_logprob": (_positive_logprobs, {}, "logprob_out_of_range"),
    "missing_logprobs": (_missing_logprobs, {}, "missing_logprobs"),
    "missing_response_token_ids": (_missing_response_ids, {}, "missing_token_ids"),
    "missing_prompt_token_ids": (_missing_prompt_ids, {}, "missing_token_ids"),
    "action_and_tool_mask_overlap": (_mask_overlap, {}, "invalid_mask"),
    "turn_boundary_outside_response": (_turn_boundary_outside, {}, "invalid_mask"),
    "content_hash_tampered_after_sealing": (_tampered_after_sealing, {}, "hash_mismatch"),
    "wrong_group_size": (_three_samples_for_two, {}, "group_size_mismatch"),
    "policy_version": (_override(policy_version=1), {}, "version_mismatch"),
    "checkpoint_digest": (_override(checkpoint_digest=sha("ckpt-other")), {}, "checkpoint_mismatch"),
    "tokenizer_hash": (_override(tokenizer_hash=sha("tokenizer-other")), {}, "tokenizer_mismatch"),
    "precision_class": (_override(precision_class="fp8"), {}, "precision_mismatch"),
    "quantization_class": (_override(quantization_class="fp8-e4m3"), {}, "quantization_mismatch"),
    "sampling_config_hash": (_override(sampling_config_hash=SamplingConfig(temperature=0.5).digest()), {},
                             "sampling_config_mismatch"),
    "engine_fingerprint": (_override(engine_fingerprint=sha("another build")), {}, "fingerprint_mismatch"),
    "signed_without_key": (_override(signature="c2lnbmF0dXJl"), {}, "bad_signature"),
    "token_id_at_vocab_size": (_token_at_vocab_size, {}, "token_out_of_vocab"),
    # 8 prompt + 16 response tokens do not fit a context of 20.
    "context_overflow": (_override(), {"max_context_tokens": 20}, "context_overflow"),
    "unknown_lease_id": (_override(lease_id="lease_never_issued"), {}, "unknown_lease"),
    # Provenance the lease does not constrain must still be what w1 registered (hf 1.0 on cpu).
    "engine_name_not_registered": (_override(engine_name="vllm"), {}, "engine_mismatch"),
    "engine_version_not_registered": (_override(engine_version="9.9"), {}, "engine_version_mismatch"),
    "device_type_not_registered": (_override(device_type="h100"), {}, "device_mismatch"),
}


@pytest.mark.parametrize("case", sorted(GATE_CASES))
def test_gate_rejection_is_typed_and_changes_nothing(market: Market, case: str):
    """A group that fits the contract but not its lease or the gate: 422 `rejected` with exactly
    the reason that fired, one `submission.rejected` audit event, and no other change."""
    build, job_overrides, reason = GATE_CASES[case]
    grant = market.grant(**job_overrides)
    group = build(market.worker, grant)
    before = market.snapshot()
    with pytest.raises(Rejected) as caught:
        market.worker.submit(group)
    error = caught.value
    assert (error.status, error.code) == (422, "rejected")
    assert error.rejection_reasons == [RejectionReason(reason)]
    assert {f["reason"] for f in error.details["findings"]} == {reason}
    new = assert_unchanged(before, market.snapshot(), audit=("submission.rejected",), rejected_by="w1")
    assert json.loads(new[0][4])["reasons"] == [reason]
    # The lease still stands: the same worker can deliver a correct group under it.
    if case != "unknown_lease_id":
        fixed = market.worker.group_for(grant, trajectories(2, tokens=8, prompt=4))
        assert market.worker.submit(fixed).lease_id == grant.lease.lease_id


def test_token_id_just_below_vocab_size_is_accepted(market: Market):
    """The boundary of the vocabulary check: vocab_size - 1 is a valid token id."""
    grant = market.grant()
    t0, t1 = trajectories(2)
    ids = t1.response_token_ids.copy()
    ids[-1] = grant.policy.vocab_size - 1
    receipt = market.worker.submit(market.worker.group_for(grant, [t0, rebuilt(t1, response_token_ids=ids)]))
    stored = market.trainer.group(receipt.group_id).group
    assert int(stored.trajectories[1].response_token_ids[-1]) == grant.policy.vocab_size - 1


def test_every_reason_that_fired_is_listed(market: Market):
    """Several faults in one group: the error lists every reason, in the body and the audit."""
    grant = market.grant()
    t0, t1, t2 = trajectories(3)
    logprobs = t0.logprobs.copy()
    logprobs[2] = np.nan
    tool_T = np.zeros(t1.num_response_tokens, np.uint8)
    tool_T[0] = 1
    group = market.worker.group_for(
        grant, [rebuilt(t0, logprobs=logprobs), rebuilt(t1, tool_output_mask=tool_T), t2],
        precision_class="fp8", checkpoint_digest=sha("ckpt-other"),
    )
    sealed = market.worker.seal(group)
    tampered = sealed.model_copy(update={"task_id": "task-other"})
    expected = {"non_finite_logprobs", "invalid_mask", "hash_mismatch", "precision_mismatch",
                "checkpoint_mismatch", "group_size_mismatch"}
    before = market.snapshot()
    response = post(market.server.url, "/v1/groups", market.worker.http.token, packb(tampered), MSGPACK)
    detail = error_of(response, 422, "rejected")
    assert set(detail.reasons) == expected
    assert len(detail.reasons) == len(expected), "each reason is listed once"
    by_reason = {(f["reason"], f["sample_index"]) for f in detail.details["findings"]}
    assert ("non_finite_logprobs", 0) in by_reason and ("invalid_mask", 1) in by_reason
    new = assert_unchanged(before, market.snapshot(), audit=("submission.rejected",), rejected_by="w1")
    assert set(json.loads(new[0][4])["reasons"]) == expected


# -- bodies that are not contracts at all ---------------------------------------------------

def _valid_group(market: Market) -> SampleGroup:
    return market.worker.seal(market.worker.group_for(market.grant(), trajectories(2)))


def _array_ext_that_lies(market: Market) -> bytes:
    """msgpack whose logprobs array header claims 16 float32s but carries 15."""
    data = _valid_group(market).model_dump(mode="python")
    whole = msgpack.unpackb(packb(data["trajectories"][0]["logprobs"]),
                            ext_hook=lambda code, payload: msgpack.ExtType(code, payload))
    data["trajectories"][0]["logprobs"] = msgpack.ExtType(whole.code, whole.data[:-4])
    return packb(data)


def _json_with(market: Market, change: Callable[[dict], None]) -> bytes:
    """A valid sealed group as a JSON document, edited by `change` before it is written."""
    data = _valid_group(market).model_dump(mode="json")
    change(data)
    return json.dumps(data).encode()


def _set(path: tuple, value) -> Callable[[dict], None]:
    def change(data: dict) -> None:
        target = data
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return change


RAW_CASES = {
    # name: (body, content type, status, error code)
    "malformed_json": (lambda m: b'{"group_id": "grp_1", "trajectories": [', JSON, 400, "malformed_body"),
    "json_not_utf8": (lambda m: b'{"a": "\xff\xfe"}', JSON, 400, "malformed_body"),
    "malformed_msgpack": (lambda m: packb(_valid_group(m))[:-7], MSGPACK, 400, "malformed_body"),
    "msgpack_reserved_byte": (lambda m: b"\xc1", MSGPACK, 400, "malformed_body"),
    "msgpack_unknown_ext": (lambda m: msgpack.packb({"a": msgpack.ExtType(9, b"x")}), MSGPACK, 400,
                            "malformed_body"),
    "msgpack_array_shorter_than_its_shape": (_array_ext_that_lies, MSGPACK, 400, "malformed_body"),
    "text_plain": (lambda m: as_json_text(_valid_group(m)), "text/plain", 415, "unsupported_media_type"),
    "form_encoded": (lambda m: b"group_id=grp_1", "application/x-www-form-urlencoded", 415,
                     "unsupported_media_type"),
    "json_not_a_group": (lambda m: b'{"hello": "world"}', JSON, 422, "invalid_request"),
    "json_list": (lambda m: b"[1, 2, 3]", JSON, 422, "invalid_request"),
    "msgpack_not_a_group": (lambda m: packb({"trajectories": "none"}), MSGPACK, 422, "invalid_request"),
    "empty_trajectories": (lambda m: _json_with(m, _set(("trajectories",), [])), JSON, 422, "invalid_request"),
    "unknown_field": (lambda m: _json_with(m, _set(("bonus",), 1)), JSON, 422, "invalid_request"),
    "token_ids_not_integers": (lambda m: _json_with(m, _set(("trajectories", 0, "prompt_token_ids", 0), 0.5)),
                               JSON, 422, "invalid_request"),
    "negative_token_id": (lambda m: _json_with(m, _set(("trajectories", 1, "response_token_ids", 2), -1)),
                          JSON, 422, "invalid_request"),
    "mask_value_two": (lambda m: _json_with(m, _set(("trajectories", 0, "action_mask", 0), 2)),
                       JSON, 422, "invalid_request"),
    "ragged_routed_experts": (lambda m: _json_with(m, _set(("trajectories", 0, "routed_experts"), [[[1]], [[1, 2]]])),
                              JSON, 422, "invalid_request"),
    "bad_checkpoint_digest": (lambda m: _json_with(m, _set(("checkpoint_digest",), "ABC")), JSON, 422,
                              "invalid_request"),
}


@pytest.mark.parametrize("case", sorted(RAW_CASES))
def test_unparseable_or_off_contract_body_changes_nothing(market: Market, case: str):
    """Bodies that never become a SampleGroup: a typed 400/415/422 and not even an audit event."""
    make, content_type, status, code = RAW_CASES[case]
    body = make(market)
    before = market.snapshot()
    response = post(market.server.url, "/v1/groups", market.worker.http.token, body, content_type)
    detail = error_of(response, status, code)
    assert detail.message
    if code == "invalid_request":
        assert detail.details["errors"], "a contract error says where the body is wrong"
    assert_unchanged(before, market.snapshot())


@pytest.mark.parametrize("word", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_logprob_in_json_text(market: Market, word: str):
    """The JSON words NaN/Infinity parse, reach the gate, and get their own typed reason
    (not a parse error), with nothing stored."""
    grant = market.grant()
    t0, t1 = trajectories(2)
    logprobs = t1.logprobs.copy()
    logprobs[4] = {"NaN": np.nan, "Infinity": np.inf, "-Infinity": -np.inf}[word]
    group = market.worker.seal(market.worker.group_for(grant, [t0, rebuilt(t1, logprobs=logprobs)]))
    data = group.model_dump(mode="json")  # pydantic writes non-finite floats as null ...
    data["trajectories"][1]["logprobs"][4] = float(logprobs[4])  # ... so put the float back by hand
    body = json.dumps(data).encode()
    assert f", {word}, ".encode() in body  # the test really sends the bare word
    before = market.snapshot()
    detail = error_of(post(market.server.url, "/v1/groups", market.worker.http.token, body, JSON),
                      422, "rejected")
    assert detail.reasons == ["non_finite_logprobs"]
    assert detail.details["findings"][0]["sample_index"] == 1
    assert_unchanged(before, market.snapshot(), audit=("submission.rejected",), rejected_by="w1")


def test_nan_logprob_in_msgpack(market: Market):
    """A NaN float32 in the binary logprobs array: rejected as non_finite_logprobs."""
    grant = market.grant()
    t0, t1 = trajectories(2)
    logprobs = t0.logprobs.copy()
    logprobs[0] = np.nan
    group = market.worker.seal(market.worker.group_for(grant, [rebuilt(t0, logprobs=logprobs), t1]))
    before = market.snapshot()
    detail = error_of(post(market.server.url, "/v1/groups", market.worker.http.token, packb(group), MSGPACK),
                      422, "rejected")
    assert detail.reasons == ["non_finite_logprobs"]
    assert_unchanged(before, market.snapshot(), audit=("submission.rejected",), rejected_by="w1")


def test_group_without_content_hash(market: Market):
    """An unsealed group (no content_hash) sent around the client: rejected as hash_mismatch."""
    group = market.worker.group_for(market.grant(), trajectories(2))
    assert group.content_hash is None
    before = market.snapshot()
    detail = error_of(post(market.server.url, "/v1/groups", market.worker.http.token, packb(group), MSGPACK),
                      422, "rejected")
    assert detail.reasons == ["hash_mismatch"]
    assert_unchanged(before, market.snapshot(), audit=("submission.rejected",), rejected_by="w1")


def test_submitting_to_another_workers_lease(market: Market):
    """A group naming the lease holder is 403 (it names a worker that is not the sender: no
    lookup happens). A group naming the sender is answered exactly as for a lease never issued:
    422 unknown_lease, its one audit event, and the lease untouched for its holder."""
    grant = market.grant()
    other = ready_worker(market.server.url, "w-other")
    try:
        theirs = market.worker.seal(market.worker.group_for(grant, trajectories(2)))
        before = market.snapshot()
        response = post(market.server.url, "/v1/groups", other.http.token, packb(theirs), MSGPACK)
        error_of(response, 403, "forbidden")
        assert_unchanged(before, market.snapshot())
        mine = theirs.model_copy(update={"worker_id": "w-other", "content_hash": None}).sealed()
        before = market.snapshot()
        response = post(market.server.url, "/v1/groups", other.http.token, packb(mine), MSGPACK)
        assert error_of(response, 422, "rejected").reasons == ["unknown_lease"]
        assert_unchanged(before, market.snapshot(), audit=("submission.rejected",), rejected_by="w-other")
    finally:
        other.close()
    assert market.worker.submit(theirs).lease_id == grant.lease.lease_id


def test_failed_lease_is_not_active(market: Market):
    """A group for a lease the worker already gave back: rejected as lease_not_active."""
    grant = market.grant()
    group = market.worker.group_for(grant, trajectories(2))
    assert market.worker.fail(grant.lease.lease_id, "engine_error", "boom", retryable=False) == "failed"
    before = market.snapshot()
    with pytest.raises(Rejected) as caught:
        market.worker.submit(group)
    assert caught.value.rejection_reasons == [RejectionReason.lease_not_active]
    assert_unchanged(before, market.snapshot(), audit=("submission.rejected",), rejected_by="w1")


def test_second_group_for_a_lease_with_other_content(market: Market):
    """A lease delivers one group; another group under it is a 409 and the first stays stored."""
    grant = market.grant()
    first = market.worker.submit(market.worker.group_for(grant, trajectories(2, seed=1)))
    before = market.snapshot()
    with pytest.raises(Conflict) as caught:
        market.worker.submit(market.worker.group_for(grant, trajectories(2, seed=2)))
    assert (caught.value.status, caught.value.code) == (409, "idempotency_conflict")
    assert_unchanged(before, market.snapshot())
    assert market.trainer.group(first.group_id).group.content_hash == first.content_hash


def test_failing_an_unknown_lease(market: Market):
    """Failing a lease that was never issued: 404 not_found and no change."""
    before = market.snapshot()
    response = post(market.server.url, "/v1/leases/lease_never_issued/fail", market.worker.http.token,
                    json.dumps({"kind": "engine_error"}).encode())
    error_of(response, 404, "not_found")
    assert_unchanged(before, market.snapshot())


QUERY_CASES = [
    ("GET", "/v1/jobs?limit=0", TRAINER_TOKEN, "limit"),
    ("GET", "/v1/jobs?limit=10001", TRAINER_TOKEN, "limit"),
    ("GET", "/v1/groups?limit=0", TRAINER_TOKEN, "limit"),
    ("GET", "/v1/groups?tier=bogus", TRAINER_TOKEN, "tier"),
    ("GET", "/v1/groups?max_staleness=-1", TRAINER_TOKEN, "max_staleness"),
    ("GET", "/v1/groups?include_served=perhaps", TRAINER_TOKEN, "include_served"),
    ("GET", "/v1/audit?limit=0", TRAINER_TOKEN, "limit"),
    ("GET", "/v1/audit?since_seq=-1", TRAINER_TOKEN, "since_seq"),
    ("POST", "/v1/leases?wait_s=-1", None, "wait_s"),
    ("POST", "/v1/leases?wait_s=soon", None, "wait_s"),
]


@pytest.mark.parametrize("method,path,token,param", QUERY_CASES, ids=[c[1] for c in QUERY_CASES])
def test_query_parameter_errors(market: Market, method: str, path: str, token: str | None, param: str):
    """Out-of-range or ill-typed query parameters: 422 invalid_request naming the parameter."""
    before = market.snapshot()
    response = httpx.request(method, market.server.url + path, timeout=30,
                             headers={"authorization": f"Bearer {token or market.worker.http.token}"})
    detail = error_of(response, 422, "invalid_request")
    assert ["query", param] in [e["loc"] for e in detail.details["errors"]]
    assert_unchanged(before, market.snapshot())


def test_trainer_client_raises_typed_error_for_bad_limit(market: Market):
    """The client surfaces the same refusal as InvalidRequest."""
    with pytest.raises(InvalidRequest) as caught:
        market.trainer.jobs(limit=0)
    assert (caught.value.status, caught.value.code) == (422, "invalid_request")


def test_publish_with_bad_quorum_parameter_stores_nothing(market: Market):
    """A valid manifest with quorum=0: 422, and the policy is not published."""
    before = market.snapshot()
    response = post(market.server.url, "/v1/policies?quorum=0", TRAINER_TOKEN,
                    policy(7).model_dump_json().encode())
    error_of(response, 422, "invalid_request")
    assert_unchanged(before, market.snapshot())
    assert [p.policy_version for p in market.trainer.policies()] == [0]


TRAINER_BODY_CASES = [
    ("/v1/policies", b'{"policy_version": 1,', JSON, 400, "malformed_body"),
    ("/v1/policies", b'{"policy_version": -1}', JSON, 422, "invalid_request"),
    ("/v1/policies", lambda: policy(1).model_dump_json().encode(), "text/csv", 415, "unsupported_media_type"),
    ("/v1/policies", lambda: policy(1, parent_version=1).model_dump_json().encode(), JSON, 422,
     "invalid_request"),
    ("/v1/jobs", b'{"jobs": []}', JSON, 422, "invalid_request"),
    ("/v1/jobs", b"\x92\x01", MSGPACK, 400, "malformed_body"),
    ("/v1/jobs", lambda: json.dumps({"jobs": [job(99).model_dump(mode="json") | {"group_size": 0}]}).encode(),
     JSON, 422, "invalid_request"),
    ("/v1/jobs", lambda: json.dumps({"jobs": [job(99).model_dump(mode="json") | {
        "sampling_config_hash": sha("not the config")}]}).encode(), JSON, 422, "invalid_request"),
    ("/v1/groups/grp_x/report", b'{"decision": {"status": "maybe"}}', JSON, 422, "invalid_request"),
    ("/v1/groups/grp_x/report", b"{}", JSON, 422, "invalid_request"),
]


@pytest.mark.parametrize("path,body,content_type,status,code", TRAINER_BODY_CASES,
                         ids=[f"{c[0]}-{c[4]}-{i}" for i, c in enumerate(TRAINER_BODY_CASES)])
def test_bad_trainer_bodies_change_nothing(market: Market, path, body, content_type, status, code):
    """Malformed, off-contract or wrongly typed trainer bodies: typed 4xx, nothing stored."""
    content = body() if callable(body) else body
    before = market.snapshot()
    error_of(post(market.server.url, path, TRAINER_TOKEN, content, content_type), status, code)
    assert_unchanged(before, market.snapshot())


WORKER_BODY_CASES = [
    ("/v1/workers/register", b'{"worker_id": "w9"', JSON, 400, "malformed_body"),
    ("/v1/workers/register", lambda: json.dumps(manifest("w9").model_dump(mode="json") | {
        "worker_id": "bad id!"}).encode(), JSON, 422, "invalid_request"),
    ("/v1/workers/register", lambda: json.dumps(manifest("w9").model_dump(mode="json") | {
        "public_key": "not-a-key"}).encode(), JSON, 422, "invalid_request"),
    ("/v1/workers/heartbeat", b'{"worker_id": "w1", "queue_depth": -3}', JSON, 422, "invalid_request"),
    ("/v1/reload-acks", b'{"worker_id": "w1", "policy_version": 0}', JSON, 422, "invalid_request"),
    ("/v1/reload-acks", lambda: json.dumps({"worker_id": "w1", "policy_version": 0,
                                            "checkpoint_digest": "ABC", "engine_fingerprint": "f"}).encode(),
     JSON, 422, "invalid_request"),
    ("/v1/leases/lease_x/fail", b'{"kind": "gremlins"}', JSON, 422, "invalid_request"),
]


@pytest.mark.parametrize("path,body,content_type,status,code", WORKER_BODY_CASES,
                         ids=[f"{c[0]}-{c[4]}-{i}" for i, c in enumerate(WORKER_BODY_CASES)])
def test_bad_worker_bodies_change_nothing(market: Market, path, body, content_type, status, code):
    """Malformed or off-contract worker bodies (registration, heartbeat, ack, fail): typed 4xx,
    nothing stored, the worker not even marked as seen."""
    content = body() if callable(body) else body
    before = market.snapshot()
    error_of(post(market.server.url, path, market.worker.http.token, content, content_type), status, code)
    assert_unchanged(before, market.snapshot())


# -- cases that need their own exchange ----------------------------------------------------

def test_expired_lease_is_rejected(start_exchange):
    """A group delivered after its lease expired: 422 rejected (expired_lease or lease_not_active),
    nothing stored, the job stays re-queued for someone else."""
    server = start_exchange("--lease-ttl-s", "0.5", "--reaper-interval-s", "0.1", "--heartbeat-ttl-s", "3600")
    trainer = server.trainer()
    trainer.publish_policy(policy(0))
    worker = ready_worker(server.url)
    trainer.enqueue(job(0))
    grant = lease_one(worker)
    group = worker.seal(worker.group_for(grant, trajectories(2)))
    deadline = time.monotonic() + 60
    while not trainer.audit(kind="lease.expired", subject=grant.lease.lease_id).events:
        assert time.monotonic() < deadline, "the reaper never expired the lease"
        time.sleep(0.1)
    before = snapshot(server.db)
    with pytest.raises(Rejected) as caught:
        worker.submit(group)
    reasons = set(caught.value.rejection_reasons)
    assert reasons & {RejectionReason.expired_lease, RejectionReason.lease_not_active}
    assert reasons <= {RejectionReason.expired_lease, RejectionReason.lease_not_active}
    assert_unchanged(before, snapshot(server.db), audit=("submission.rejected",), rejected_by="w1")
    assert [j.state for j in trainer.jobs()] == ["queued"]
    assert trainer.fetch().groups == []


@pytest.fixture
def small_body_market(start_exchange):
    """An exchange that accepts bodies of at most 2048 bytes, with a worker holding a lease."""
    server = start_exchange("--max-body-bytes", "2048", *CALM)
    trainer = server.trainer()
    trainer.publish_policy(policy(0))
    worker = ready_worker(server.url)
    trainer.enqueue(job(0))
    return server, worker, lease_one(worker)


def _chunks(body: bytes, size: int = 1024) -> Iterator[bytes]:
    for start in range(0, len(body), size):
        yield body[start:start + size]


@pytest.mark.parametrize("streamed", [False, True], ids=["content-length", "chunked"])
def test_oversized_group_is_refused(small_body_market, streamed: bool):
    """A body over --max-body-bytes: 413 payload_too_large whether its size is declared up front
    (Content-Length) or only found while streaming (chunked, no Content-Length)."""
    server, worker, grant = small_body_market
    group = worker.seal(worker.group_for(grant, trajectories(2, tokens=256)))
    body = packb(group)
    assert len(body) > 2048
    before = snapshot(server.db)
    request = httpx.Request("POST", server.url + "/v1/groups", content=_chunks(body) if streamed else body,
                            headers={"authorization": f"Bearer {worker.http.token}", "content-type": MSGPACK})
    assert ("content-length" in request.headers) is not streamed
    with httpx.Client(timeout=30) as http:
        response = http.send(request)
    detail = error_of(response, 413, "payload_too_large")
    assert detail.details["limit"] == 2048
    assert_unchanged(before, snapshot(server.db))
    # A group that fits still goes through under the same lease.
    small = worker.group_for(grant, trajectories(2, tokens=4, prompt=2))
    assert len(packb(worker.seal(small))) <= 2048
    assert worker.submit(small).lease_id == grant.lease.lease_id


@pytest.mark.parametrize("streamed", [False, True], ids=["content-length", "chunked"])
def test_oversized_registration_is_refused(small_body_market, streamed: bool):
    """Also before authentication matters: an oversized registration registers nobody."""
    server, _, _ = small_body_market
    body = json.dumps(manifest("w-big", region="x" * 60, supported_tokenizer_hashes=[sha(str(i)) for i in range(40)])
                      .model_dump(mode="json")).encode()
    assert len(body) > 2048
    before = snapshot(server.db)
    response = post(server.url, "/v1/workers/register", None, _chunks(body) if streamed else body)
    error_of(response, 413, "payload_too_large")
    assert_unchanged(before, snapshot(server.db))


def test_policy_that_is_not_newer_is_a_version_conflict(exchange):
    """Publishing an older version than the last, or a published version with other content:
    409 version_conflict, and the published history is untouched."""
    trainer = exchange.trainer()
    trainer.publish_policy(policy(0))
    trainer.publish_policy(policy(2, parent_version=0))
    published = trainer.policies()
    for stale in (policy(1, parent_version=0), policy(0, checkpoint_digest=sha("other weights")),
                  policy(2, parent_version=0, vocab_size=5)):
        before = snapshot(exchange.db)
        with pytest.raises(Conflict) as caught:
            trainer.publish_policy(stale)
        assert (caught.value.status, caught.value.code) == (409, "version_conflict")
        assert_unchanged(before, snapshot(exchange.db))
    assert trainer.policies() == published
    assert trainer.pool().published_version == 2


def test_job_under_a_used_idempotency_key_with_other_content(exchange):
    """409 idempotency_conflict; the first job is unchanged, and a batch holding the conflict
    stores none of its jobs (all or nothing)."""
    trainer = exchange.trainer()
    first = job(0, idempotency_key="task-0-attempt-1")
    assert trainer.enqueue(first)[0].created
    stored = trainer.jobs()
    clash = job(1, idempotency_key="task-0-attempt-1")
    innocent = job(2)
    for batch in ([clash], [innocent, clash]):
        before = snapshot(exchange.db)
        with pytest.raises(Conflict) as caught:
            trainer.enqueue(batch)
        assert (caught.value.status, caught.value.code) == (409, "idempotency_conflict")
        assert caught.value.details["job_id"] == first.job_id
        assert_unchanged(before, snapshot(exchange.db))
    assert trainer.jobs() == stored
    assert stored[0].job == first
    # The same job again is a retry, not a conflict.
    assert trainer.enqueue(first)[0].created is False


def test_reload_ack_with_wrong_digest_records_only_the_violation(exchange):
    """409 digest_mismatch; the one write is a `reload.violation` audit event. The worker's
    loaded version, its acks and its liveness record stay as they were."""
    trainer = exchange.trainer()
    trainer.publish_policy(policy(0))
    worker = ready_worker(exchange.url)
    trainer.publish_policy(policy(1))
    before = snapshot(exchange.db)
    with pytest.raises(DigestMismatch) as caught:
        worker.ack_reload(1, sha("weights nobody published"))
    assert (caught.value.status, caught.value.code) == (409, "digest_mismatch")
    assert caught.value.details["published_digest"] == sha("ckpt-1")
    new = assert_unchanged(before, snapshot(exchange.db), audit=("reload.violation",))
    data = json.loads(new[0][4])
    assert (new[0][2], new[0][3]) == ("w1", "policy:1")
    assert data["acked_digest"] == sha("weights nobody published")
    assert data["published_digest"] == sha("ckpt-1")
    assert trainer.pool().active_version == 0
