"""End-to-end flows through a real exchange process and the real clients.

Every test starts `rollmarket exchange serve` on a free loopback port with its own SQLite file
(see conftest.py) and talks to it only over HTTP, through WorkerClient and TrainerClient, or
with plain httpx for the operational endpoints. Nothing is mocked.
"""

from __future__ import annotations

import sqlite3
import threading
import time

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import (
    TRAINER_TOKEN,
    job,
    last_seen,
    lease_one,
    manifest,
    policy,
    ready_worker,
    sha,
    assert_unchanged,
    snapshot,
    trajectories,
    wait_until,
)
from rollmarket import TrainerClient, WorkerClient
from rollmarket.client import Conflict, IntegrityError, NotFound
from rollmarket.contracts import (
    DecisionStatus,
    NoLeaseReason,
    SampleGroup,
    Tier,
    TrainerFeedback,
    content_hash,
)
from rollmarket.contracts.wire import packb, unpackb
from rollmarket.gate import budget_report, decide


# -- small local helpers ------------------------------------------------------------------

def audit_events(trainer: TrainerClient, kind: str | None = None, subject: str | None = None):
    return trainer.audit(kind=kind, subject=subject, limit=10_000).events


def metric_samples(url: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of a /metrics scrape, keyed by (sample name, labels)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def metric(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def deliver(trainer: TrainerClient, worker: WorkerClient, rollout_job, *, seed: int = 0):
    """Enqueue one job, lease it with `worker`, submit a group for it; return (group, receipt)."""
    trainer.enqueue(rollout_job)
    grant = lease_one(worker)
    assert grant.job.job_id == rollout_job.job_id
    group = worker.seal(worker.group_for(grant, trajectories(rollout_job.group_size, seed=seed)))
    return group, worker.submit(group)


def advance(trainer: TrainerClient, version: int, *workers: WorkerClient) -> None:
    """Publish `version`, have every given worker ack it, and wait until it is active."""
    trainer.publish_policy(policy(version))
    for worker in workers:
        worker.ack_reload(version, sha(f"ckpt-{version}"))
    trainer.wait_for_quorum(version, timeout=15)


def stored_rows(db, sql: str, *args) -> list[tuple]:
    """Read the exchange's SQLite file directly (read-only) to see what is really stored."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


# -- the happy path -----------------------------------------------------------------------

def test_happy_path_register_publish_lease_submit_fetch_decide(exchange):
    """Register → publish v0 → ack → quorum → long-poll lease → submit → fetch → decide → report."""
    trainer = exchange.trainer(trainer_id="trainer-main")
    worker = WorkerClient(exchange.url)

    registration = worker.register(manifest("w1"))
    assert registration.worker_id == "w1" and registration.token
    assert registration.policy is None  # nothing published yet

    assert worker.lease().reason is NoLeaseReason.no_policy

    published = trainer.publish_policy(policy(0))
    assert published.published_version == 0
    assert published.active_version is None  # no worker has acked yet

    beat = worker.heartbeat()
    assert beat.reload_required and beat.policy.policy_version == 0
    assert worker.lease().reason is NoLeaseReason.reload_required

    ack = worker.ack_reload(0, sha("ckpt-0"))
    assert ack.aligned and ack.active_version == 0 and (ack.acks, ack.quorum) == (1, 1)
    assert trainer.wait_for_quorum(0, timeout=10).active_version == 0
    assert worker.heartbeat().reload_required is False

    # A lease request that long-polls returns as soon as a job is enqueued from another thread.
    answer: dict = {}

    def ask() -> None:
        answer["grant"] = worker.lease(wait_s=30)
        answer["at"] = time.monotonic()

    seen = last_seen(exchange.db, "w1")
    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    # Wait until the exchange has handled the request (it stamps the worker as seen): from then
    # on the queue is empty, so the request is long-polling, not yet sent.
    wait_until("the lease request to reach the exchange", lambda: last_seen(exchange.db, "w1") > seen)
    assert asker.is_alive(), f"the lease request did not wait for work: {answer}"
    rollout_job = job(1)
    enqueued_at = time.monotonic()
    receipts = trainer.enqueue(rollout_job)
    assert [(r.job_id, r.created) for r in receipts] == [(rollout_job.job_id, True)]
    asker.join(40)
    assert not asker.is_alive()
    grant = answer["grant"]
    assert grant.lease is not None, grant
    assert grant.job.job_id == rollout_job.job_id
    assert answer["at"] - enqueued_at < 10, "the long poll did not wake up on the enqueue"
    assert grant.lease.requirements.checkpoint_digest == sha("ckpt-0")
    assert grant.lease.worker_id == "w1" and grant.policy.policy_version == 0

    group = worker.seal(worker.group_for(grant, trajectories(2, seed=1)))
    receipt = worker.submit(group)
    assert receipt.group_id == group.group_id and receipt.lease_id == grant.lease.lease_id
    assert receipt.tier is Tier.fresh and receipt.policy_lag_steps == 0
    assert receipt.duplicate is False and receipt.content_hash == content_hash(group)

    fetched = trainer.fetch(limit=8)
    assert fetched.active_version == 0 and fetched.remaining == 0
    assert [f.group.group_id for f in fetched.groups] == [group.group_id]
    got = fetched.groups[0]
    assert got.tier is Tier.fresh and got.served_count == 1 and got.current_lag == 0
    for sent, came in zip(group.trajectories, got.group.trajectories):
        assert np.array_equal(sent.response_token_ids, came.response_token_ids)
        assert np.array_equal(sent.logprobs, came.logprobs)

    # The trainer's own logprobs agree closely: the gate says train.
    trainer_logprobs = [t.logprobs.astype(np.float64) - 0.01 for t in got.group.trajectories]
    report = budget_report(got.group, trainer_logprobs, policy_lag_steps=got.current_lag)
    decision = decide(report, decided_by="trainer-main")
    assert decision.status is DecisionStatus.train
    report_receipt = trainer.report(group.group_id, decision)
    assert report_receipt.status == "consumed" and report_receipt.worker_id == "w1"
    assert report_receipt.worker_quality == pytest.approx(0.8 * 0.5 + 0.2 * 1.0)

    assert trainer.fetch(include_served=True).groups == []  # consumed groups are never served
    jobs = trainer.jobs()
    assert [(j.job.job_id, j.state, j.group_id, j.attempts) for j in jobs] == [
        (rollout_job.job_id, "done", group.group_id, 1)]

    pool = trainer.pool()
    assert pool.active_version == 0 and pool.published_version == 0
    assert pool.alive_workers == 1 and pool.dead_workers == 0
    assert pool.jobs == {"done": 1} and pool.leases == {"submitted": 1} and pool.groups == {}
    (summary,) = pool.workers
    assert summary.worker_id == "w1" and summary.aligned and summary.feedback_count == 1
    assert summary.quality == pytest.approx(0.6) and summary.active_leases == 0

    # Every step left its audit event, in order, about the right subject.
    events = audit_events(trainer)
    kinds = [e.kind for e in events]
    expected = ["exchange.started", "worker.registered", "policy.published", "reload.acked",
                "policy.activated", "job.enqueued", "lease.issued", "group.accepted",
                "groups.served", "group.decided", "feedback.recorded"]
    positions = [kinds.index(kind) for kind in expected]
    assert positions == sorted(positions), kinds
    by_kind = {e.kind: e for e in events}
    assert by_kind["worker.registered"].subject == "w1"
    assert by_kind["policy.activated"].data["version"] == 0
    assert by_kind["job.enqueued"].subject == rollout_job.job_id
    assert by_kind["lease.issued"].subject == grant.lease.lease_id
    assert by_kind["group.accepted"].subject == group.group_id
    assert by_kind["group.accepted"].data["content_hash"] == group.content_hash
    assert by_kind["groups.served"].data["group_ids"] == [group.group_id]
    assert by_kind["groups.served"].actor == "trainer-main"
    assert by_kind["group.decided"].data["status"] == "train"
    assert by_kind["feedback.recorded"].subject == "w1"
    assert by_kind["feedback.recorded"].data["score"] == 1.0


# -- idempotency --------------------------------------------------------------------------

def test_submission_is_idempotent_and_a_second_group_under_a_lease_conflicts(exchange):
    trainer = exchange.trainer()
    trainer.publish_policy(policy(0))
    worker = ready_worker(exchange.url)
    trainer.enqueue(job(0))
    grant = lease_one(worker)
    group = worker.seal(worker.group_for(grant, trajectories(2, seed=3)))

    first = worker.submit(group)
    again = worker.submit(group)
    assert first.duplicate is False and again.duplicate is True
    assert (again.group_id, again.lease_id, again.content_hash, again.tier, again.received_at) == (
        first.group_id, first.lease_id, first.content_hash, first.tier, first.received_at)
    assert stored_rows(exchange.db, "SELECT COUNT(*) FROM groups WHERE lease_id=?",
                       grant.lease.lease_id) == [(1,)]

    other = worker.seal(worker.group_for(grant, trajectories(2, seed=4)))
    assert other.group_id != group.group_id
    with pytest.raises(Conflict) as caught:
        worker.submit(other)
    assert caught.value.status == 409 and caught.value.code == "idempotency_conflict"
    rows = stored_rows(exchange.db, "SELECT group_id, content_hash FROM groups")
    assert rows == [(group.group_id, group.content_hash)]

    samples = metric_samples(exchange.url)
    assert metric(samples, "rollmarket_submissions_total", outcome="accepted") == 1
    assert metric(samples, "rollmarket_submissions_total", outcome="duplicate") == 1
    assert len(audit_events(trainer, kind="group.accepted")) == 1


def test_enqueue_is_idempotent_and_batches_are_all_or_nothing(exchange):
    trainer = exchange.trainer()
    rollout_job = job(7)
    (first,) = trainer.enqueue(rollout_job)
    (second,) = trainer.enqueue(rollout_job)
    assert (first.job_id, first.created) == (rollout_job.job_id, True)
    assert (second.job_id, second.created) == (rollout_job.job_id, False)
    assert [j.job.job_id for j in trainer.jobs()] == [rollout_job.job_id]
    assert len(audit_events(trainer, kind="job.enqueued")) == 1

    # Another job under a used idempotency key is refused, and so is its whole batch.
    newcomer = job(8)
    impostor = job(9, idempotency_key=rollout_job.idempotency_key)
    with pytest.raises(Conflict) as caught:
        trainer.enqueue([newcomer, impostor])
    assert caught.value.code == "idempotency_conflict"
    assert [j.job.job_id for j in trainer.jobs()] == [rollout_job.job_id]


# -- fetch filters ------------------------------------------------------------------------

def test_fetch_filters_limit_order_staleness_precision_and_served(exchange):
    trainer = exchange.trainer()
    trainer.publish_policy(policy(0))
    worker = ready_worker(exchange.url, "w1", precision_classes=["bf16", "fp8"])

    arrivals: list[tuple[str, int, str]] = []  # (group_id, version, precision) in arrival order
    for index in range(3):
        group, _ = deliver(trainer, worker, job(index), seed=index)
        arrivals.append((group.group_id, 0, "bf16"))
    group, _ = deliver(trainer, worker, job(3, required_precision="fp8"), seed=3)
    arrivals.append((group.group_id, 0, "fp8"))
    advance(trainer, 1, worker)
    for index in (4, 5):
        group, _ = deliver(trainer, worker, job(index, version=1), seed=index)
        arrivals.append((group.group_id, 1, "bf16"))
    advance(trainer, 2, worker)
    group, _ = deliver(trainer, worker, job(6, version=2), seed=6)
    arrivals.append((group.group_id, 2, "bf16"))
    every = [g for g, _, _ in arrivals]

    probe = exchange.trainer(trainer_id="probe")

    def ids(**filters) -> list[str]:
        return [f.group.group_id for f in probe.fetch(include_served=True, limit=64, **filters).groups]

    assert ids() == every
    assert ids(policy_version=1) == [g for g, v, _ in arrivals if v == 1]
    assert ids(max_staleness=0) == [g for g, v, _ in arrivals if v == 2]
    assert ids(max_staleness=1) == [g for g, v, _ in arrivals if v >= 1]
    assert ids(precision_class="fp8") == [g for g, _, p in arrivals if p == "fp8"]
    assert ids(precision_class="fp8", policy_version=1) == []
    assert ids(newest_first=True) == every[::-1]
    assert ids(tier="replay") == [] and ids(tier="quarantine") == []

    lags = {f.group.group_id: (f.current_lag, f.group.policy_version)
            for f in probe.fetch(include_served=True, limit=64).groups}
    assert all(lag == 2 - version for lag, version in lags.values())

    # limit, remaining and the per-trainer served marks.
    reader = exchange.trainer(trainer_id="reader")
    page = reader.fetch(limit=3)
    assert [f.group.group_id for f in page.groups] == every[:3]
    assert page.remaining == len(every) - 3 and page.active_version == 2
    page = reader.fetch(limit=3, newest_first=True)
    assert [f.group.group_id for f in page.groups] == every[::-1][:3]
    assert page.remaining == 1
    page = reader.fetch(limit=3)
    assert [f.group.group_id for f in page.groups] == [every[3]] and page.remaining == 0
    assert reader.fetch(limit=64).groups == []
    again = reader.fetch(limit=64, include_served=True)
    assert [f.group.group_id for f in again.groups] == every
    assert {f.served_count for f in again.groups} == {2}


# -- tiers ----------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "gate_args, replay_at, quarantine_at",
    [([], 5, 9), (["--gate-replay-lag", "0", "--gate-max-policy-lag", "1"], 1, 2)],
    ids=["default-gate", "tight-gate"],
)
def test_arrival_triage_by_lag_and_tiers_served_only_when_asked(start_exchange, gate_args,
                                                                replay_at, quarantine_at):
    """A group leased at v0 that arrives when the pool is far ahead lands in replay or quarantine."""
    server = start_exchange("--reaper-interval-s", "0.2", *gate_args)
    trainer = server.trainer()
    trainer.publish_policy(policy(0))
    holder = ready_worker(server.url, "holder", max_concurrent_groups=2)
    aligner = ready_worker(server.url, "aligner")
    late_job, stale_job = job(1), job(2)
    trainer.enqueue([late_job, stale_job])
    late_grant, stale_grant = lease_one(holder), lease_one(holder)

    def reach(version: int) -> None:
        while trainer.pool().published_version < version:
            nxt = trainer.pool().published_version + 1
            trainer.publish_policy(policy(nxt), quorum=1)
            aligner.ack_reload(nxt, sha(f"ckpt-{nxt}"))
            trainer.wait_for_quorum(nxt, timeout=15)

    reach(replay_at)
    late = holder.seal(holder.group_for(late_grant, trajectories(2, seed=1)))
    late_receipt = holder.submit(late)
    assert late_receipt.tier is Tier.replay and late_receipt.policy_lag_steps == replay_at
    assert [r.value for r in late_receipt.reasons] == ["policy_lag_replay"]

    reach(quarantine_at)
    stale = holder.seal(holder.group_for(stale_grant, trajectories(2, seed=2)))
    stale_receipt = holder.submit(stale)
    assert stale_receipt.tier is Tier.quarantine and stale_receipt.policy_lag_steps == quarantine_at
    assert [r.value for r in stale_receipt.reasons] == ["policy_lag_quarantine"]

    fresh_job = job(3, version=quarantine_at)
    fresh, fresh_receipt = deliver(trainer, aligner, fresh_job, seed=3)
    assert fresh_receipt.tier is Tier.fresh

    assert trainer.pool().groups == {"fresh": 1, "replay": 1, "quarantine": 1}
    assert [f.group.group_id for f in trainer.fetch(limit=64).groups] == [fresh.group_id]
    assert [f.group.group_id for f in trainer.fetch(limit=64, include_served=True).groups] == [fresh.group_id]
    replay = trainer.fetch(tier="replay", limit=64).groups
    assert [f.group.group_id for f in replay] == [late.group_id]
    assert replay[0].tier is Tier.replay and replay[0].lag_at_arrival == replay_at
    assert replay[0].current_lag == quarantine_at
    quarantine = trainer.fetch(tier=Tier.quarantine, limit=64).groups
    assert [f.group.group_id for f in quarantine] == [stale.group_id]
    assert quarantine[0].lag_at_arrival == quarantine_at

    accepted = {e.subject: e.data for e in audit_events(trainer, kind="group.accepted")}
    assert accepted[late.group_id]["tier"] == "replay" and accepted[late.group_id]["lag"] == replay_at
    assert accepted[stale.group_id]["tier"] == "quarantine"
    samples = metric_samples(server.url)
    for tier in ("fresh", "replay", "quarantine"):
        assert metric(samples, "rollmarket_groups_stored_total", tier=tier) == 1
        assert metric(samples, "rollmarket_groups_available", tier=tier) == 1


def test_served_counts_are_per_trainer_and_undecided_groups_are_redelivered(start_exchange):
    server = start_exchange("--reaper-interval-s", "0.2", "--redeliver-after-s", "1.5")
    setup = server.trainer()
    setup.publish_policy(policy(0))
    worker = ready_worker(server.url)
    decided, _ = deliver(setup, worker, job(0), seed=0)
    undecided, _ = deliver(setup, worker, job(1), seed=1)
    both = [decided.group_id, undecided.group_id]

    alice = server.trainer(trainer_id="alice")
    bob = server.trainer(trainer_id="bob")
    first_served = time.monotonic()
    assert [f.group.group_id for f in alice.fetch().groups] == both
    bob_batch = bob.fetch().groups
    assert [f.group.group_id for f in bob_batch] == both
    assert {f.served_count for f in bob_batch} == {1}
    assert alice.fetch().groups == [] and bob.fetch().groups == []

    report = budget_report(decided, [t.logprobs for t in decided.trajectories])
    alice.report(decided.group_id, decide(report), feedback=False)

    # Alice never decided on the other group: it comes back to her after redeliver_after_s.
    deadline = time.monotonic() + 20
    redelivered = []
    while not redelivered and time.monotonic() < deadline:
        redelivered = alice.fetch().groups
        if not redelivered:
            time.sleep(0.2)
    assert time.monotonic() - first_served >= 1.0
    assert [f.group.group_id for f in redelivered] == [undecided.group_id]
    assert redelivered[0].served_count == 2
    served = dict(stored_rows(server.db, "SELECT trainer_id, count FROM served WHERE group_id=?",
                              undecided.group_id))
    assert served == {"alice": 2, "bob": 1}


def test_a_batch_of_reports_is_one_write_all_or_none(exchange):
    """POST /v1/groups/reports records several decisions and feedbacks as single reports would;
    a batch naming an unknown group is refused whole (404) and changes nothing."""
    trainer = exchange.trainer(trainer_id="batcher")
    trainer.publish_policy(policy(0))
    worker = ready_worker(exchange.url)
    groups = [deliver(trainer, worker, job(i), seed=i)[0] for i in range(3)]
    fetched = [f.group for f in trainer.fetch(limit=8).groups]
    agreeing = [decide(budget_report(g, [t.logprobs.astype(np.float64) for t in g.trajectories])) for g in fetched]
    assert {d.status for d in agreeing} == {DecisionStatus.train}

    before = snapshot(exchange.db)
    with pytest.raises(NotFound):
        trainer.report_many([(fetched[0].group_id, agreeing[0], True), ("grp_unknown", None, TrainerFeedback(
            group_id="grp_unknown", trainer_id="batcher", status=DecisionStatus.train, score=1.0,
            used_for_training=True))])
    assert_unchanged(before, snapshot(exchange.db))

    receipts = trainer.report_many([(g.group_id, d, True) for g, d in zip(fetched, agreeing)])
    assert [(r.group_id, r.tier, r.status) for r in receipts] == [(g.group_id, "fresh", "consumed") for g in groups]
    quality = 0.5
    for _ in groups:
        quality = 0.8 * quality + 0.2 * 1.0
    assert receipts[-1].worker_quality == pytest.approx(quality)
    decided = audit_events(trainer, kind="group.decided")
    assert [e.subject for e in decided] == [g.group_id for g in groups]
    assert len({e.at for e in decided}) == 1, "one write (one clock reading) for the whole batch"
    assert trainer.pool().groups == {}


def test_decisions_move_groups_between_tiers(exchange):
    trainer = exchange.trainer(trainer_id="decider")
    trainer.publish_policy(policy(0))
    worker = ready_worker(exchange.url)
    groups = [deliver(trainer, worker, job(i), seed=i)[0] for i in range(3)]
    fetched = {f.group.group_id: f.group for f in trainer.fetch(limit=8).groups}
    assert list(fetched) == [g.group_id for g in groups]
    to_replay, to_quarantine, to_train = (fetched[g.group_id] for g in groups)

    def agreeing(group: SampleGroup) -> list[np.ndarray]:
        return [t.logprobs.astype(np.float64) for t in group.trajectories]

    replay = decide(budget_report(to_replay, agreeing(to_replay), policy_lag_steps=6))
    vetoed = agreeing(to_quarantine)
    vetoed[0] = vetoed[0].copy()
    vetoed[0][0] += 40.0  # one token the trainer finds absurdly more likely: a veto
    quarantine = decide(budget_report(to_quarantine, vetoed))
    train = decide(budget_report(to_train, agreeing(to_train)))
    assert (replay.status, quarantine.status, train.status) == (
        DecisionStatus.replay, DecisionStatus.quarantine, DecisionStatus.train)

    receipts = [trainer.report(g.group_id, d) for g, d in
                ((to_replay, replay), (to_quarantine, quarantine), (to_train, train))]
    assert [(r.tier, r.status) for r in receipts] == [
        ("replay", "available"), ("quarantine", "available"), ("fresh", "consumed")]
    quality = 0.5
    for score in (0.4, 0.0, 1.0):
        quality = 0.8 * quality + 0.2 * score
    assert receipts[-1].worker_quality == pytest.approx(quality)

    assert trainer.pool().groups == {"replay": 1, "quarantine": 1}
    other = exchange.trainer(trainer_id="other")
    assert other.fetch(limit=8).groups == []
    assert [f.group.group_id for f in other.fetch(tier="replay").groups] == [to_replay.group_id]
    assert [f.group.group_id for f in other.fetch(tier="quarantine").groups] == [to_quarantine.group_id]
    # The deciding trainer, too, is served the group again from the tier its decision chose.
    assert [f.group.group_id for f in trainer.fetch(tier="replay").groups] == [to_replay.group_id]
    assert trainer.fetch(tier="replay").groups == []
    for tier in ("fresh", "replay", "quarantine"):
        assert to_train.group_id not in {
            f.group.group_id for f in other.fetch(tier=tier, include_served=True, limit=64).groups}
    assert trainer.group(to_train.group_id).status.value == "consumed"

    decided = {e.subject: e.data["status"] for e in audit_events(trainer, kind="group.decided")}
    assert decided == {to_replay.group_id: "replay", to_quarantine.group_id: "quarantine",
                       to_train.group_id: "train"}
    (worker_summary,) = trainer.workers()
    assert worker_summary.feedback_count == 3 and worker_summary.quality == pytest.approx(quality)
    samples = metric_samples(exchange.url)
    for status in ("replay", "quarantine", "train"):
        assert metric(samples, "rollmarket_decisions_total", status=status) == 1


# -- failures -------------------------------------------------------------------------------

def test_failure_reports_requeue_or_fail_the_job(start_exchange):
    server = start_exchange("--reaper-interval-s", "0.2", "--max-attempts", "2")
    trainer = server.trainer()
    trainer.publish_policy(policy(0))
    worker = ready_worker(server.url)
    retried, doomed = job(0), job(1, priority=-1)
    trainer.enqueue([retried, doomed])

    first = lease_one(worker)
    assert first.job.job_id == retried.job_id
    assert worker.fail(first.lease.lease_id, "engine_error", "CUDA hiccup") == "queued"
    with pytest.raises(Conflict) as caught:
        worker.fail(first.lease.lease_id, "engine_error")
    assert caught.value.code == "lease_not_active"
    states = {j.job.job_id: (j.state, j.attempts) for j in trainer.jobs()}
    assert states[retried.job_id] == ("queued", 1)

    second = lease_one(worker)
    assert second.job.job_id == retried.job_id and second.lease.lease_id != first.lease.lease_id
    # Retryable, but the job has used up --max-attempts leases.
    assert worker.fail(second.lease.lease_id, "timeout", retryable=True) == "failed"

    third = lease_one(worker)
    assert third.job.job_id == doomed.job_id
    assert worker.fail(third.lease.lease_id, "tool_error", "bad task", retryable=False) == "failed"

    states = {j.job.job_id: (j.state, j.attempts) for j in trainer.jobs()}
    assert states == {retried.job_id: ("failed", 2), doomed.job_id: ("failed", 1)}
    assert worker.lease().reason is NoLeaseReason.queue_empty
    assert trainer.pool().leases == {"failed": 3}
    assert [e.subject for e in audit_events(trainer, kind="job.requeued")] == [retried.job_id]
    assert sorted(e.subject for e in audit_events(trainer, kind="job.failed")) == sorted(
        [retried.job_id, doomed.job_id])
    failed_leases = audit_events(trainer, kind="lease.failed")
    assert [e.subject for e in failed_leases] == [
        first.lease.lease_id, second.lease.lease_id, third.lease.lease_id]
    assert failed_leases[0].data["kind"] == "engine_error"
    assert failed_leases[0].data["message"] == "CUDA hiccup"
    assert metric(metric_samples(server.url), "rollmarket_lease_endings_total", state="failed") == 3


# -- integrity ------------------------------------------------------------------------------

def test_fetched_groups_verify_their_content_hash_on_both_wires(exchange):
    trainer = exchange.trainer()
    trainer.publish_policy(policy(0))
    worker = ready_worker(exchange.url)
    sent = {}
    for index in range(2):
        group, receipt = deliver(trainer, worker, job(index, group_size=3), seed=10 + index)
        assert receipt.content_hash == group.content_hash
        sent[group.group_id] = group

    for wire in ("msgpack", "json"):
        reader = TrainerClient(exchange.url, TRAINER_TOKEN, trainer_id=f"reader-{wire}", wire=wire)
        result = reader.fetch(limit=8)
        assert [f.group.group_id for f in result.groups] == list(sent)
        for fetched in result.groups:
            assert content_hash(fetched.group) == sent[fetched.group.group_id].content_hash
            assert fetched.group.content_hash == sent[fetched.group.group_id].content_hash
        reader.close()

    # Tamper with one stored payload behind the exchange's back: the client notices.
    victim = next(iter(sent))
    conn = sqlite3.connect(str(exchange.db), timeout=30)
    try:
        (payload,) = conn.execute("SELECT payload FROM groups WHERE group_id=?", (victim,)).fetchone()
        document = unpackb(payload)
        document["trajectories"][0]["reward"] = 123.0
        conn.execute("UPDATE groups SET payload=? WHERE group_id=?", (packb(document), victim))
        conn.commit()
    finally:
        conn.close()
    with pytest.raises(IntegrityError):
        trainer.group(victim)
    with pytest.raises(IntegrityError):
        exchange.trainer(trainer_id="late-reader").fetch(limit=8)
    unchecked = TrainerClient(exchange.url, TRAINER_TOKEN, verify_hashes=False).group(victim)
    assert unchecked.group.trajectories[0].reward == 123.0


# -- operations -----------------------------------------------------------------------------

EXPECTED_ROUTES = {
    "/v1/workers/register": {"post"},
    "/v1/workers/heartbeat": {"post"},
    "/v1/leases": {"post"},
    "/v1/leases/{lease_id}/fail": {"post"},
    "/v1/groups": {"post", "get"},
    "/v1/groups/{group_id}": {"get"},
    "/v1/groups/{group_id}/report": {"post"},
    "/v1/reload-acks": {"post"},
    "/v1/policies": {"post", "get"},
    "/v1/jobs": {"post", "get"},
    "/v1/pool": {"get"},
    "/v1/workers": {"get"},
    "/v1/audit": {"get"},
    "/healthz": {"get"},
    "/metrics": {"get"},
}


def test_healthz_metrics_openapi_and_docs(exchange):
    health = httpx.get(exchange.url + "/healthz", timeout=10)
    assert health.status_code == 200
    assert health.json()["status"] == "ok" and health.json()["version"]

    before = metric_samples(exchange.url)
    assert metric(before, "rollmarket_submissions_total", outcome="accepted") == 0

    trainer = exchange.trainer()
    trainer.publish_policy(policy(0))
    worker = ready_worker(exchange.url)
    deliver(trainer, worker, job(0, group_size=2), seed=0)

    after = metric_samples(exchange.url)
    assert metric(after, "rollmarket_submissions_total", outcome="accepted") == 1
    assert metric(after, "rollmarket_groups_stored_total", tier="fresh") == 1
    assert metric(after, "rollmarket_response_tokens_ingested_total") == 2 * 16
    assert metric(after, "rollmarket_lease_requests_total", result="granted") == 1
    assert metric(after, "rollmarket_jobs", state="done") == 1
    assert metric(after, "rollmarket_leases", state="submitted") == 1
    assert metric(after, "rollmarket_workers", status="alive") == 1
    assert metric(after, "rollmarket_groups_available", tier="fresh") == 1
    assert metric(after, "rollmarket_policy_active_version") == 0
    assert metric(after, "rollmarket_policy_published_version") == 0
    assert metric(before, "rollmarket_policy_active_version") == -1
    assert metric(after, "rollmarket_http_requests_total", route="/v1/groups", method="POST",
                  status="200") == 1
    assert metric(after, "rollmarket_http_request_seconds_count", route="/v1/leases", method="POST") == 1
    assert metric(after, "rollmarket_store_write_batch_ops_count") > metric(
        before, "rollmarket_store_write_batch_ops_count")
    text = httpx.get(exchange.url + "/metrics", timeout=10).text
    for family in ("rollmarket_http_requests_total", "rollmarket_http_request_seconds",
                   "rollmarket_submissions_total", "rollmarket_rejections_total",
                   "rollmarket_response_tokens_ingested_total", "rollmarket_groups_stored_total",
                   "rollmarket_lease_requests_total", "rollmarket_lease_endings_total",
                   "rollmarket_decisions_total", "rollmarket_reload_violations_total",
                   "rollmarket_store_write_batch_ops", "rollmarket_jobs", "rollmarket_workers",
                   "rollmarket_groups_available", "rollmarket_leases",
                   "rollmarket_policy_active_version", "rollmarket_policy_published_version"):
        assert f"# TYPE {family} " in text, family

    spec = httpx.get(exchange.url + "/openapi.json", timeout=10).json()
    paths = spec["paths"]
    for path, methods in EXPECTED_ROUTES.items():
        assert path in paths, f"{path} missing from the OpenAPI document"
        assert methods <= set(paths[path]), (path, set(paths[path]))
    schemas = spec["components"]["schemas"]
    for name in ("SampleGroup", "Trajectory", "WorkerManifest", "PolicyManifest", "RolloutJob",
                 "ReloadAck", "FetchResult", "ErrorBody"):
        assert name in schemas, name
    assert {"trajectories", "content_hash", "lease_id", "engine_fingerprint"} <= set(
        schemas["SampleGroup"]["properties"])
    body = paths["/v1/groups"]["post"]["requestBody"]["content"]
    assert body["application/json"]["schema"]["$ref"].endswith("/SampleGroup")
    assert "application/msgpack" in body

    docs = httpx.get(exchange.url + "/docs", timeout=10)
    assert docs.status_code == 200 and "text/html" in docs.headers["content-type"]
    assert "swagger" in docs.text.lower() and "/openapi.json" in docs.text
