"""One contract for every store backend: the same scenarios drive the Store interface directly on
SQLite (a file in tmp_path) and on PostgreSQL (a fresh database on the session's throwaway
cluster). Expected values come from the audit log, the counts and the market rules' formulas
applied by hand, not from what the call under test returned.
"""

from __future__ import annotations

import asyncio
import math

import pytest

from helpers import TOKENIZER, job, manifest, policy, sha, trajectories
from rollmarket.contracts import (
    DecisionStatus,
    ErrorCode,
    FailureKind,
    FailureReport,
    GroupDecision,
    LeaseState,
    NoLeaseReason,
    ReloadAck,
    SampleGroup,
    Tier,
    TrainerFeedback,
    WorkerHeartbeat,
)
from rollmarket.exchange import ExchangeSettings
from rollmarket.exchange.errors import ExchangeFault
from rollmarket.exchange.store import FetchFilter, Store
from rollmarket.exchange.stores import open_store

T0 = 1_700_000_000.0
TTL = 60.0


class Driver:
    """A store opened on its own event loop; `run` awaits one call."""

    def __init__(self, db: str, **settings):
        self.settings = ExchangeSettings(db=db, trainer_token="t", lease_ttl_s=TTL, heartbeat_ttl_s=TTL * 10,
                                         preference_hold_s=0.0, **settings)
        self.loop = asyncio.new_event_loop()
        self.store: Store = open_store(db, self.settings)
        self.run(self.store.open(self.settings.public_dict(), T0))

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        if not self.loop.is_closed():
            self.run(self.store.close())
            self.loop.close()

    # -- shorthands over the Store interface -------------------------------------------------
    def audit(self, kind: str | None = None, subject: str | None = None) -> list:
        return self.run(self.store.audit(0, kind, subject, 10_000)).events

    def ready(self, worker_id: str, version: int = 0, now: float = T0, **overrides) -> None:
        self.run(self.store.register_worker(manifest(worker_id, **overrides), sha(worker_id), now))
        self.ack(worker_id, version, now, fingerprint=overrides.get("engine_fingerprint"))

    def ack(self, worker_id: str, version: int, now: float = T0, digest: str | None = None,
            fingerprint: str | None = None):
        return self.run(self.store.ack_reload(ReloadAck(
            worker_id=worker_id, policy_version=version, checkpoint_digest=digest or sha(f"ckpt-{version}"),
            engine_fingerprint=fingerprint or sha(f"fp-{worker_id}")), now))

    def group(self, grant, *, seed: int = 0, **overrides) -> SampleGroup:
        req = grant.lease.requirements
        fields = dict(
            job_id=grant.lease.job_id, lease_id=grant.lease.lease_id, worker_id=grant.lease.worker_id,
            task_id=grant.job.task.task_id, policy_version=req.policy_version,
            checkpoint_digest=req.checkpoint_digest, tokenizer_hash=req.tokenizer_hash,
            sampling_config_hash=req.sampling_config_hash, engine_name="hf", engine_version="1.0",
            engine_fingerprint=sha(f"fp-{grant.lease.worker_id}"), device_type="cpu",
            precision_class=req.precision_class,
            quantization_class=req.quantization_class,
            trajectories=trajectories(grant.job.group_size, seed=seed),
        )
        fields.update(overrides)
        return SampleGroup(**fields).sealed()

    def submit(self, group: SampleGroup, now: float = T0 + 1):
        return self.run(self.store.submit(group, group.model_dump_json().encode(), [], now))

    def lease(self, worker_id: str, now: float = T0 + 1):
        return self.run(self.store.lease(worker_id, now))


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request, tmp_path):
    """A function opening a Driver on this test's database (the same one on every call)."""
    if request.param == "sqlite":
        db = str(tmp_path / "exchange.db")
    else:
        db = request.getfixturevalue("postgres_url")
    opened: list[Driver] = []

    def open_driver(**settings) -> Driver:
        opened.append(Driver(db, **settings))
        return opened[-1]

    yield open_driver
    for driver in opened:
        driver.close()


@pytest.fixture
def store(backend) -> Driver:
    return backend()


def published(d: Driver, version: int = 0, quorum: int | None = None) -> None:
    d.run(d.store.publish_policy(policy(version), quorum, T0))


def live_jobs(d: Driver) -> None:
    published(d)
    d.ready("w1")


# -- workers and policies ---------------------------------------------------------------------
def test_register_once_and_the_audit_says_so(store):
    store.run(store.store.register_worker(manifest("w1"), sha("token"), T0))
    with pytest.raises(ExchangeFault) as again:
        store.run(store.store.register_worker(manifest("w1"), sha("other"), T0))
    assert again.value.code is ErrorCode.worker_exists
    assert store.run(store.store.worker_token_hashes()) == {"w1": sha("token")}
    assert [e.subject for e in store.audit("worker.registered")] == ["w1"]
    assert store.run(store.store.counts())["workers"] == {"alive": 1}


def test_publish_is_idempotent_and_refuses_other_content_or_older_versions(store):
    published(store, 0)
    published(store, 0)  # the same content again is a no-op
    with pytest.raises(ExchangeFault) as other:
        store.run(store.store.publish_policy(policy(0, checkpoint_digest=sha("else")), None, T0))
    assert other.value.code is ErrorCode.version_conflict
    published(store, 3)
    with pytest.raises(ExchangeFault) as older:
        store.run(store.store.publish_policy(policy(2), None, T0))
    assert older.value.code is ErrorCode.version_conflict
    assert [e.data["version"] for e in store.audit("policy.published")] == [0, 3]
    assert [p.policy_version for p in store.run(store.store.policies())] == [0, 3]


def test_quorum_override_activates_only_on_the_kth_ack(store):
    published(store, 0, quorum=2)
    for worker_id in ("w1", "w2"):
        store.run(store.store.register_worker(manifest(worker_id), sha(worker_id), T0))
    first = store.ack("w1", 0)
    assert (first.active_version, first.acks, first.quorum) == (None, 1, 2)
    assert store.lease("w1").reason is NoLeaseReason.awaiting_quorum
    second = store.ack("w2", 0)
    assert second.aligned and second.active_version == 0
    activated = store.audit("policy.activated")
    assert [(e.data["version"], e.data["acks"], e.data["quorum"]) for e in activated] == [(0, 2, 2)]


def test_default_quorum_is_a_share_of_live_workers(backend):
    d = backend(reload_quorum_fraction=0.6, reload_quorum_min=1)
    published(d, 0)
    for worker_id in ("w1", "w2", "w3"):
        d.run(d.store.register_worker(manifest(worker_id), sha(worker_id), T0))
    needed = max(1, math.ceil(0.6 * 3))  # the rule, by hand: 2 of 3
    assert d.ack("w1", 0).active_version is None
    assert d.ack("w2", 0).active_version == 0
    assert d.audit("policy.activated")[0].data["acks"] == needed


def test_a_refused_reload_ack_keeps_only_its_violation(store):
    published(store, 0)
    store.run(store.store.register_worker(manifest("w1"), sha("w1"), T0))
    with pytest.raises(ExchangeFault) as refused:
        store.ack("w1", 0, digest=sha("not the checkpoint"))
    assert refused.value.code is ErrorCode.digest_mismatch
    assert [e.data["acked_digest"] for e in store.audit("reload.violation")] == [sha("not the checkpoint")]
    assert store.audit("reload.acked") == []
    assert [w.loaded_version for w in store.run(store.store.workers())] == [None]


# -- jobs, leases, groups ---------------------------------------------------------------------
def test_enqueue_is_idempotent_by_key_and_refuses_other_content(store):
    jobs = [job(i) for i in range(3)]
    first = store.run(store.store.enqueue(jobs, T0))
    again = store.run(store.store.enqueue(jobs, T0 + 1))
    assert [r.created for r in first] == [True] * 3 and [r.created for r in again] == [False] * 3
    clash = job(0, group_size=4, idempotency_key=jobs[0].idempotency_key)
    with pytest.raises(ExchangeFault) as conflict:
        store.run(store.store.enqueue([clash], T0))
    assert conflict.value.code is ErrorCode.idempotency_conflict
    assert len(store.audit("job.enqueued")) == 3
    assert store.run(store.store.counts())["jobs"] == {"queued": 3}


def test_lease_submit_and_a_resubmission_gets_the_first_receipt(store):
    live_jobs(store)
    jobs = [job(0), job(1, priority=5)]
    store.run(store.store.enqueue(jobs, T0))
    grant = store.lease("w1")
    assert grant.lease.job_id == jobs[1].job_id  # the higher priority first
    group = store.group(grant)
    outcome = store.submit(group)
    assert outcome.rejected == [] and outcome.receipt.tier is Tier.fresh
    again = store.submit(group, now=T0 + 5)
    assert again.receipt.duplicate and again.receipt.received_at == outcome.receipt.received_at
    accepted = store.audit("group.accepted")
    assert [e.subject for e in accepted] == [group.group_id]
    assert accepted[0].data["tokens"] == sum(len(t.response_token_ids) for t in group.trajectories)
    counts = store.run(store.store.counts())
    assert counts["jobs"] == {"done": 1, "queued": 1}
    assert counts["leases"] == {"submitted": 1}
    assert counts["groups"] == {"fresh": 1}
    stored = store.run(store.store.group(group.group_id))
    assert stored.payload == group.model_dump_json().encode()


def test_a_group_id_taken_under_another_lease_is_refused(store):
    live_jobs(store)
    store.ready("w2")
    store.run(store.store.enqueue([job(0), job(1)], T0))
    first, second = store.lease("w1"), store.lease("w2")
    taken = store.group(first)
    store.submit(taken)
    with pytest.raises(ExchangeFault) as clash:
        store.submit(store.group(second, group_id=taken.group_id))
    assert clash.value.code is ErrorCode.idempotency_conflict
    assert len(store.audit("group.accepted")) == 1


def test_a_submission_under_someone_elses_lease_is_rejected_and_costs_quality(store):
    live_jobs(store)
    store.ready("w2")
    store.run(store.store.enqueue([job(0)], T0))
    grant = store.lease("w1")
    forged = store.group(grant, worker_id="w2", engine_fingerprint=sha("fp-w2"))
    outcome = store.submit(forged)
    assert outcome.receipt is None and outcome.rejected
    rejected = store.audit("submission.rejected")
    assert [e.actor for e in rejected] == ["w2"]
    quality = {w.worker_id: (w.quality, w.rejected_count) for w in store.run(store.store.workers())}
    alpha = store.settings.feedback_alpha
    assert quality["w2"] == (pytest.approx((1 - alpha) * 0.5), 1)
    assert quality["w1"] == (0.5, 0)


def test_renew_fail_and_max_attempts(backend):
    d = backend(max_attempts=2)
    live_jobs(d)
    d.run(d.store.enqueue([job(0)], T0))
    grant = d.lease("w1", now=T0 + 1)
    renewed = d.run(d.store.renew_lease("w1", grant.lease.lease_id, T0 + 30))
    assert renewed.expires_at.timestamp() == pytest.approx(T0 + 30 + TTL)
    with pytest.raises(ExchangeFault) as stranger:
        d.run(d.store.renew_lease("w2", grant.lease.lease_id, T0 + 31))
    assert stranger.value.code is ErrorCode.not_found
    report = FailureReport(kind=FailureKind.engine_error, message="oom")
    assert d.run(d.store.fail_lease("w1", grant.lease.lease_id, report, T0 + 32)) == "queued"
    with pytest.raises(ExchangeFault) as ended:
        d.run(d.store.renew_lease("w1", grant.lease.lease_id, T0 + 33))
    assert ended.value.code is ErrorCode.lease_not_active
    second = d.lease("w1", now=T0 + 34)
    assert d.run(d.store.fail_lease("w1", second.lease.lease_id, report, T0 + 35)) == "failed"
    assert [e.kind for e in d.audit("job.", grant.lease.job_id)] == [
        "job.enqueued", "job.requeued", "job.failed"]
    assert d.run(d.store.counts())["leases"] == {"failed": 2}


def test_reap_expires_leases_requeues_and_marks_silent_workers_dead(store):
    live_jobs(store)
    store.run(store.store.enqueue([job(0)], T0))
    grant = store.lease("w1", now=T0 + 1)
    assert store.run(store.store.reap(T0 + 2)).changed is False
    result = store.run(store.store.reap(T0 + 1 + TTL))
    assert result.expired_leases == [grant.lease.lease_id]
    assert result.requeued_jobs == [grant.lease.job_id]
    assert [e.subject for e in store.audit("lease.expired")] == [grant.lease.lease_id]
    late = store.submit(store.group(grant), now=T0 + 2 + TTL)
    assert late.receipt is None  # an expired lease delivers nothing
    silent = store.run(store.store.reap(T0 + 1 + 11 * TTL))
    assert silent.dead_workers == ["w1"]
    assert store.run(store.store.counts())["workers"] == {"dead": 1}
    reply = store.run(store.store.heartbeat(WorkerHeartbeat(worker_id="w1", loaded_policy_version=0,
                                                            active_lease_ids=[grant.lease.lease_id]),
                                            T0 + 12 * TTL))
    assert reply.cancelled_lease_ids == [grant.lease.lease_id]
    assert [e.subject for e in store.audit("worker.revived")] == ["w1"]


def test_a_job_is_never_leased_twice_at_once(backend):
    """Many concurrent lease calls (and, on PostgreSQL, two store processes' worth of
    connections): every job has at most one issued lease, and the audit agrees."""
    d = backend()
    published(d)
    workers = [f"w{i}" for i in range(8)]
    for worker_id in workers:
        d.ready(worker_id, max_concurrent_groups=4)
    d.run(d.store.enqueue([job(i) for i in range(12)], T0))

    async def rush():
        return await asyncio.gather(*(d.store.lease(w, T0 + 1) for w in workers * 3))

    grants = [g for g in d.run(rush()) if g.lease is not None]
    job_ids = [g.lease.job_id for g in grants]
    assert len(job_ids) == len(set(job_ids)) == 12
    issued = d.audit("lease.issued")
    assert sorted(e.data["job_id"] for e in issued) == sorted(job_ids)
    assert d.run(d.store.counts())["jobs"] == {"leased": 12}


def test_concurrent_resubmissions_store_one_group(store):
    live_jobs(store)
    store.run(store.store.enqueue([job(0)], T0))
    group = store.group(store.lease("w1"))

    async def rush():
        return await asyncio.gather(*(store.store.submit(group, b"payload", [], T0 + 2) for _ in range(6)))

    outcomes = store.run(rush())
    assert sum(not o.receipt.duplicate for o in outcomes) == 1
    assert len({o.receipt.received_at for o in outcomes}) == 1
    assert len(store.audit("group.accepted")) == 1


# -- trainers ---------------------------------------------------------------------------------
def stored_groups(d: Driver, n: int) -> list[str]:
    live_jobs(d)
    d.run(d.store.enqueue([job(i) for i in range(n)], T0))
    ids = []
    for i in range(n):
        group = d.group(d.lease("w1"), seed=i)
        d.submit(group)
        ids.append(group.group_id)
    return ids


def decision(group_id: str, status: DecisionStatus) -> GroupDecision:
    return GroupDecision(group_id=group_id, status=status, recommended_action="test")


def test_fetch_serves_each_group_once_per_tier_and_replay_is_its_own_tier(store):
    ids = stored_groups(store, 3)
    first = store.run(store.store.fetch(FetchFilter(limit=2), T0 + 10))
    assert [g.group_id for g in first.groups] == ids[:2] and first.remaining == 1
    second = store.run(store.store.fetch(FetchFilter(limit=5), T0 + 11))
    assert [g.group_id for g in second.groups] == ids[2:]
    assert store.run(store.store.fetch(FetchFilter(), T0 + 12)).groups == []
    receipt = store.run(store.store.report("default", ids[0], decision(ids[0], DecisionStatus.replay), None,
                                           T0 + 13))
    assert (receipt.tier, receipt.status) == (Tier.replay, "available")
    replay = store.run(store.store.fetch(FetchFilter(tier=Tier.replay), T0 + 14))
    assert [g.group_id for g in replay.groups] == [ids[0]]
    later = store.run(store.store.fetch(FetchFilter(), T0 + 12 + store.settings.redeliver_after_s))
    assert [g.group_id for g in later.groups] == ids[1:]  # undecided groups come back
    served = [gid for e in store.audit("groups.served") for gid in e.data["group_ids"]]
    assert served == ids[:2] + ids[2:] + [ids[0]] + ids[1:]


def test_reports_move_groups_and_feedback_moves_quality(store):
    ids = stored_groups(store, 3)
    alpha = store.settings.feedback_alpha
    feedback = TrainerFeedback(group_id=ids[0], status=DecisionStatus.train, score=1.0, used_for_training=True)
    receipt = store.run(store.store.report("t1", ids[0], decision(ids[0], DecisionStatus.train), feedback, T0 + 5))
    assert receipt.status == "consumed"
    assert receipt.worker_quality == pytest.approx((1 - alpha) * 0.5 + alpha * 1.0)
    store.run(store.store.report("t1", ids[1], decision(ids[1], DecisionStatus.quarantine), None, T0 + 6))
    store.run(store.store.report("t1", ids[2], decision(ids[2], DecisionStatus.reject), None, T0 + 7))
    decided = {e.subject: (e.data["tier"], e.data["group_status"]) for e in store.audit("group.decided")}
    assert decided == {ids[0]: ("fresh", "consumed"), ids[1]: ("quarantine", "available"),
                       ids[2]: ("fresh", "dropped")}
    assert store.run(store.store.counts())["groups"] == {"quarantine": 1}
    recorded = store.audit("feedback.recorded")
    assert [e.data["quality"] for e in recorded] == [pytest.approx(receipt.worker_quality)]
    [worker] = store.run(store.store.workers())
    assert (worker.quality, worker.feedback_count) == (pytest.approx(0.6), 1)


def test_report_many_is_all_or_nothing(store):
    ids = stored_groups(store, 2)
    before = len(store.audit())
    batch = [("t1", ids[0], decision(ids[0], DecisionStatus.train), None),
             ("t1", "grp_unknown", decision("grp_unknown", DecisionStatus.train), None)]
    with pytest.raises(ExchangeFault) as unknown:
        store.run(store.store.report_many(batch, T0 + 5))
    assert unknown.value.code is ErrorCode.not_found
    assert len(store.audit()) == before
    good = [("t1", gid, decision(gid, DecisionStatus.train), None) for gid in ids]
    assert [r.status for r in store.run(store.store.report_many(good, T0 + 6))] == ["consumed"] * 2
    assert store.run(store.store.counts())["groups"] == {}


def test_market_and_pool_agree_with_the_audit(store):
    ids = stored_groups(store, 2)
    store.run(store.store.report("t1", ids[0], decision(ids[0], DecisionStatus.train), None, T0 + 5))
    market = store.run(store.store.market(T0 + 6))
    accepted = store.audit("group.accepted")
    assert market.accepted_groups == len(accepted) == 2
    assert market.accepted_tokens == sum(e.data["tokens"] for e in accepted)
    assert market.decisions == {"train": 1}
    assert [(w.worker_id, w.accepted) for w in market.workers] == [("w1", 2)]
    assert sum(b.accepted_groups for b in market.timeline) == 2
    assert sum(n for b in market.timeline for n in b.by_tier.values()) == 1
    pool = store.run(store.store.pool_status(T0 + 6))
    assert (pool.active_version, pool.published_version, pool.alive_workers) == (0, 0, 1)
    assert store.run(store.store.counts())["pool"] == {"active": 0, "published": 0}


def test_audit_pages_by_sequence_kind_prefix_and_subject(store):
    live_jobs(store)
    events = store.audit()
    assert [e.seq for e in events] == sorted(e.seq for e in events)
    page = store.run(store.store.audit(events[0].seq, None, None, 2))
    assert [e.seq for e in page.events] == [e.seq for e in events[1:3]] and page.next_seq == events[2].seq
    assert {e.kind for e in store.audit("reload.*")} == {"reload.acked"}
    assert [e.kind for e in store.audit(subject="w1")] == ["worker.registered"]


def test_a_lagging_worker_leases_at_its_version_within_its_declared_lag(store):
    published(store, 0)
    store.ready("w1", max_reload_lag=1)
    store.ready("w2")
    published(store, 1)
    store.ack("w2", 1)  # quorum: max(1, ceil(0.5 * 2)) = 1 → version 1 is active
    store.run(store.store.enqueue([job(0, version=0)], T0))
    grant = store.lease("w1")
    assert grant.lease.policy_version == 0
    outcome = store.submit(store.group(grant))
    assert outcome.receipt.policy_lag_steps == 1  # active 1 − its version 0
    assert LeaseState.submitted.value in store.run(store.store.counts())["leases"]


def test_a_reopened_store_keeps_every_acknowledged_write(backend):
    first = backend()
    ids = stored_groups(first, 2)
    first.close()
    reopened = backend()
    assert [g.group_id for g in reopened.run(reopened.store.fetch(FetchFilter(), T0 + 5)).groups] == ids
    assert [e.kind for e in reopened.audit("exchange.started")] == ["exchange.started"] * 2
    assert TOKENIZER in reopened.run(reopened.store.latest_policy()).tokenizer_hash


def test_feedback_and_rejections_are_kept_per_engine_fingerprint(store):
    """Two workers share one build (fingerprint F), a third runs another (G). Each fingerprint's
    quality is the EWMA of its own groups' scores in order, worked out here by hand."""
    shared, other = sha("build-F"), sha("build-G")
    published(store)
    for worker_id, fingerprint in (("w1", shared), ("w2", shared), ("w3", other)):
        store.ready(worker_id, engine_fingerprint=fingerprint)
    store.run(store.store.enqueue([job(i) for i in range(4)], T0))
    scores = {"w1": 1.0, "w2": 0.0, "w3": 1.0}
    for worker_id, fingerprint in (("w1", shared), ("w2", shared), ("w3", other)):
        group = store.group(store.lease(worker_id), engine_fingerprint=fingerprint)
        assert store.submit(group).receipt is not None
        feedback = TrainerFeedback(group_id=group.group_id, status=DecisionStatus.train,
                                   score=scores[worker_id], used_for_training=True)
        store.run(store.store.report("t1", group.group_id, None, feedback, T0 + 3))
    forged = store.group(store.lease("w1"), worker_id="w3", engine_fingerprint=other)
    assert store.submit(forged).receipt is None  # w3 under w1's lease: rejected, charged to G

    a = store.settings.feedback_alpha
    f_quality = (1 - a) * ((1 - a) * 0.5 + a * 1.0) + a * 0.0
    g_quality = (1 - a) * ((1 - a) * 0.5 + a * 1.0)
    recorded = [(e.data["fingerprint"], e.data["fingerprint_quality"]) for e in store.audit("feedback.recorded")]
    assert recorded == [(shared, pytest.approx((1 - a) * 0.5 + a)), (shared, pytest.approx(f_quality)),
                        (other, pytest.approx((1 - a) * 0.5 + a))]
    assert [e.data["fingerprint"] for e in store.audit("submission.rejected")] == [other]
    market = store.run(store.store.market(T0 + 4))
    kept = {f.engine_fingerprint: (f.quality, f.feedback_count, f.rejected_count, f.accepted, f.workers)
            for f in market.fingerprints}
    assert kept == {shared: (pytest.approx(f_quality), 2, 0, 2, ["w1", "w2"]),
                    other: (pytest.approx(g_quality), 1, 1, 1, ["w3"])}
    by_worker = {w.worker_id: w.quality for w in market.workers}
    assert by_worker == {"w1": pytest.approx(0.6), "w2": pytest.approx(0.4), "w3": pytest.approx(0.8 * 0.6)}


def test_a_jobs_fingerprint_rules_decide_who_may_lease_it(store):
    # The rules are read from the job's body in SQL on both backends (behind a text pre-filter):
    # each job below can go to exactly one of the two workers, whatever the queue order says.
    published(store)
    store.ready("w1")
    store.ready("w2")
    fp1, fp2 = sha("fp-w1"), sha("fp-w2")
    jobs = [job(0, priority=9, required_fingerprints=[fp2]), job(1, priority=8, excluded_fingerprints=[fp2]),
            job(2, priority=7, required_fingerprints=[fp1, sha("other")], excluded_fingerprints=[fp2])]
    store.run(store.store.enqueue(jobs, T0))
    first = store.lease("w1")
    assert first.lease.job_id == jobs[1].job_id  # job 0 needs w2's fingerprint
    second = store.lease("w2")
    assert second.lease.job_id == jobs[0].job_id
    store.ready("w3")
    assert store.lease("w3").reason is NoLeaseReason.no_matching_jobs  # job 2 requires w1's or another
    assert [e.data["job_id"] for e in store.audit("lease.issued")] == [jobs[1].job_id, jobs[0].job_id]
