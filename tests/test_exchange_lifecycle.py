"""Leases, workers and policy versions over time, against a real exchange process.

Covers lease expiry, worker death and revival, heartbeat replies, the k-of-n reload quorum,
reload violations, dispatch constraints, preference for better or cheaper workers, and a
restart on the same database. TTLs are short (1-3 s) and every wait polls with a deadline.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from helpers import job, last_seen, lease_one, manifest, policy, ready_worker, sha, trajectories, wait_until
from rollmarket import TrainerClient, WorkerClient
from rollmarket.client import Conflict, DigestMismatch, Rejected
from rollmarket.contracts import NoLeaseReason, RejectionReason, Tier
from rollmarket.gate import budget_report, decide


# -- small local helpers ------------------------------------------------------------------

def audit_events(trainer: TrainerClient, kind: str | None = None, subject: str | None = None):
    return trainer.audit(kind=kind, subject=subject, limit=10_000).events


def job_states(trainer: TrainerClient) -> dict[str, tuple[str, int]]:
    return {j.job.job_id: (j.state, j.attempts) for j in trainer.jobs(limit=1000)}


def submit_for(worker: WorkerClient, grant, *, seed: int = 0, **overrides):
    group = worker.group_for(grant, trajectories(grant.job.group_size, seed=seed), **overrides)
    return worker.submit(group)


def worker_status(trainer: TrainerClient) -> dict[str, str]:
    return {w.worker_id: w.status for w in trainer.workers()}


# -- lease expiry and worker death ---------------------------------------------------------

def test_an_expired_lease_is_requeued_and_leased_by_another_worker(start_exchange):
    # Leases last 1.5 s until the slow worker's has expired; then the exchange restarts with long
    # leases, so that on a loaded machine the quick worker's lease cannot run out before it submits.
    server = start_exchange("--lease-ttl-s", "1.5", "--reaper-interval-s", "0.2")
    trainer = server.trainer()
    trainer.publish_policy(policy(0))
    slow = ready_worker(server.url, "slow")
    quick = ready_worker(server.url, "quick")
    rollout_job = job(0)
    trainer.enqueue(rollout_job)

    grant = lease_one(slow)
    lease_id = grant.lease.lease_id
    assert (grant.lease.expires_at - grant.lease.issued_at).total_seconds() == pytest.approx(1.5)

    wait_until("lease.expired", lambda: audit_events(trainer, "lease.expired", lease_id))
    (expired,) = audit_events(trainer, "lease.expired", lease_id)
    assert expired.actor == "reaper" and expired.data["job_id"] == rollout_job.job_id
    (requeued,) = audit_events(trainer, "job.requeued", rollout_job.job_id)
    assert requeued.data["after"] == "expired" and requeued.data["lease_id"] == lease_id
    assert job_states(trainer)[rollout_job.job_id] == ("queued", 1)

    # The slow worker learns its lease no longer stands, and a late group is refused.
    assert slow.heartbeat(active_lease_ids=[lease_id]).cancelled_lease_ids == [lease_id]
    with pytest.raises(Rejected) as caught:
        submit_for(slow, grant)
    assert RejectionReason.expired_lease in caught.value.rejection_reasons

    server.stop()
    server.args = ["--lease-ttl-s", "3600", "--reaper-interval-s", "0.2"]
    server.start()
    second = lease_one(quick)
    assert second.job.job_id == rollout_job.job_id and second.lease.lease_id != lease_id
    receipt = submit_for(quick, second, seed=1)
    assert receipt.tier is Tier.fresh
    assert job_states(trainer)[rollout_job.job_id] == ("done", 2)
    pool = trainer.pool()
    assert pool.leases == {"expired": 1, "submitted": 1}
    fetched = trainer.fetch().groups
    assert [(f.group.worker_id, f.group.lease_id) for f in fetched] == [("quick", second.lease.lease_id)]
    assert [e.subject for e in audit_events(trainer, "submission.rejected")] == [lease_id]


def test_a_silent_worker_dies_its_leases_are_abandoned_and_it_can_revive(start_exchange):
    server = start_exchange("--heartbeat-ttl-s", "1.5", "--lease-ttl-s", "120",
                            "--reaper-interval-s", "0.2", "--preference-hold-s", "0")
    trainer = server.trainer()
    trainer.publish_policy(policy(0))
    doomed = ready_worker(server.url, "doomed")
    survivor = ready_worker(server.url, "survivor")
    rollout_job = job(0)
    trainer.enqueue(rollout_job)
    grant = lease_one(doomed)
    lease_id = grant.lease.lease_id

    # The survivor keeps beating; the doomed worker says nothing.
    wait_until("worker.dead", lambda: audit_events(trainer, "worker.dead", "doomed"),
               tick=survivor.heartbeat)
    assert worker_status(trainer) == {"doomed": "dead", "survivor": "alive"}
    (abandoned,) = audit_events(trainer, "lease.abandoned", lease_id)
    assert abandoned.actor == "reaper" and abandoned.data["worker_id"] == "doomed"
    (requeued,) = audit_events(trainer, "job.requeued", rollout_job.job_id)
    assert requeued.data["after"] == "abandoned"
    assert audit_events(trainer, "lease.expired") == []  # abandoned, not expired
    pool = trainer.pool()
    assert (pool.alive_workers, pool.dead_workers) == (1, 1)
    assert pool.leases == {"abandoned": 1}

    second = lease_one(survivor)
    assert second.job.job_id == rollout_job.job_id
    submit_for(survivor, second)
    assert job_states(trainer)[rollout_job.job_id] == ("done", 2)

    # The dead worker beats again: it is revived, and told its old lease is gone.
    reply = doomed.heartbeat(active_lease_ids=[lease_id])
    assert reply.status == "alive" and reply.cancelled_lease_ids == [lease_id]
    assert worker_status(trainer)["doomed"] == "alive"
    (revived,) = audit_events(trainer, "worker.revived", "doomed")
    assert revived.data["was"] == "dead"
    with pytest.raises(Rejected) as caught:
        submit_for(doomed, grant)
    assert RejectionReason.lease_not_active in caught.value.rejection_reasons
    next_job = job(1)
    trainer.enqueue(next_job)
    assert lease_one(doomed).job.job_id == next_job.job_id


def test_heartbeat_reply_carries_reload_required_and_cancelled_leases(exchange):
    trainer = exchange.trainer()
    trainer.publish_policy(policy(0))
    worker = ready_worker(exchange.url, "w1", max_concurrent_groups=3)
    other = ready_worker(exchange.url, "w2")
    jobs = [job(i) for i in range(4)]
    trainer.enqueue(jobs)
    live, done = lease_one(worker), lease_one(worker)
    submit_for(worker, done)
    foreign = lease_one(other)

    reply = worker.heartbeat(active_lease_ids=[live.lease.lease_id, done.lease.lease_id,
                                               foreign.lease.lease_id, "lease_never_issued"])
    assert reply.worker_id == "w1" and reply.status == "alive"
    assert reply.reload_required is False and reply.active_version == 0
    assert reply.cancelled_lease_ids == [done.lease.lease_id, foreign.lease.lease_id,
                                         "lease_never_issued"]

    trainer.publish_policy(policy(1), quorum=2)
    reply = worker.heartbeat(active_lease_ids=[live.lease.lease_id])
    assert reply.reload_required is True and reply.policy.policy_version == 1
    assert reply.active_version == 0 and reply.cancelled_lease_ids == []

    worker.ack_reload(1, sha("ckpt-1"))
    reply = worker.heartbeat()
    assert reply.reload_required is False and reply.active_version == 0  # 1 of 2 acks
    assert other.heartbeat().reload_required is True
    other.ack_reload(1, sha("ckpt-1"))
    assert worker.heartbeat().active_version == 1


# -- reload quorum --------------------------------------------------------------------------

def test_k_of_n_reload_quorum_and_per_version_override(start_exchange):
    server = start_exchange("--reaper-interval-s", "0.2", "--reload-quorum-fraction", "0.75")
    trainer = server.trainer()
    workers = []
    for index in range(4):
        client = WorkerClient(server.url)
        client.register(manifest(f"w{index}"))
        workers.append(client)
    w0, w1, w2, w3 = workers

    status = trainer.publish_policy(policy(0))
    assert (status.quorum, status.acks, status.active_version) == (3, 0, None)
    first = w0.ack_reload(0, sha("ckpt-0"))
    assert (first.aligned, first.acks, first.quorum, first.active_version) == (False, 1, 3, None)
    second = w1.ack_reload(0, sha("ckpt-0"))
    assert (second.aligned, second.acks, second.active_version) == (False, 2, None)
    wanted = job(0)
    trainer.enqueue(wanted)
    waiting = w0.lease()
    assert waiting.lease is None and waiting.reason is NoLeaseReason.awaiting_quorum
    unacked = w3.lease()
    assert unacked.lease is None and unacked.reason is NoLeaseReason.reload_required
    assert trainer.pool().active_version is None

    # w0 long-polls while the version waits for its quorum; the third ack releases the job to it.
    answer: dict = {}
    seen = last_seen(server.db, "w0")
    poller = threading.Thread(target=lambda: answer.setdefault("grant", w0.lease(wait_s=30)), daemon=True)
    poller.start()
    wait_until("the long poll to reach the exchange", lambda: last_seen(server.db, "w0") > seen)
    assert poller.is_alive(), answer
    third = w2.ack_reload(0, sha("ckpt-0"))
    assert (third.aligned, third.acks, third.active_version) == (True, 3, 0)
    poller.join(20)
    held = answer["grant"]
    assert held.lease is not None and held.job.job_id == wanted.job_id, held
    (activated,) = audit_events(trainer, "policy.activated")
    assert activated.data["acks"] == 3 and activated.data["quorum"] == 3

    still_unaligned = w3.lease()
    assert still_unaligned.lease is None and still_unaligned.reason is NoLeaseReason.reload_required
    assert still_unaligned.policy.policy_version == 0

    # quorum= on publish overrides the fraction for that version only.
    status = trainer.publish_policy(policy(1), quorum=1)
    assert (status.quorum, status.active_version) == (1, 0)
    assert w1.ack_reload(1, sha("ckpt-1")).aligned is True
    assert trainer.pool().active_version == 1
    trainer.enqueue(job(1, version=1))
    for lagging in (w2, w3):
        grant = lagging.lease()
        assert grant.lease is None and grant.reason is NoLeaseReason.reload_required
    assert lease_one(w1).job.policy_version == 1
    submit_for(w0, held)  # a lease issued at v0 still completes
    summaries = {w.worker_id: w.aligned for w in trainer.workers()}
    assert summaries == {"w0": False, "w1": True, "w2": False, "w3": False}

    status = trainer.publish_policy(policy(2))
    assert status.quorum == 3 and status.active_version == 1


def test_conflicting_reload_acks_are_a_digest_mismatch_violation(exchange):
    trainer = exchange.trainer()
    trainer.publish_policy(policy(0), quorum=2)
    honest = WorkerClient(exchange.url)
    honest.register(manifest("honest"))
    liar = WorkerClient(exchange.url)
    liar.register(manifest("liar"))

    assert honest.ack_reload(0, sha("ckpt-0")).acks == 1
    with pytest.raises(DigestMismatch) as caught:
        liar.ack_reload(0, sha("some-other-weights"))
    assert caught.value.status == 409 and caught.value.code == "digest_mismatch"
    assert caught.value.details["published_digest"] == sha("ckpt-0")

    (violation,) = audit_events(trainer, "reload.violation")
    assert violation.subject == "policy:0" and violation.actor == "liar"
    assert violation.data["acked_digest"] == sha("some-other-weights")
    assert violation.data["published_digest"] == sha("ckpt-0")
    assert [a["worker_id"] for a in violation.data["other_acks"]] == ["honest"]

    pool = trainer.pool()
    assert pool.acks == 1 and pool.active_version is None
    assert {w.worker_id: w.loaded_version for w in pool.workers} == {"honest": 0, "liar": None}
    assert [e.actor for e in audit_events(trainer, "reload.acked")] == ["honest"]
    text = httpx.get(exchange.url + "/metrics", timeout=10).text
    assert "rollmarket_reload_violations_total 1.0" in text


# -- dispatch -------------------------------------------------------------------------------

def test_dispatch_honours_job_and_policy_requirements(exchange):
    trainer = exchange.trainer()
    trainer.publish_policy(policy(0))
    plain = ready_worker(exchange.url, "plain")
    capable = ready_worker(
        exchange.url, "capable", engine_name="vllm", precision_classes=["bf16", "fp8"],
        quantization_classes=["none", "fp8-e4m3"], max_context_tokens=32768,
        returns_routed_experts=True, max_concurrent_groups=8,
    )
    stranger = ready_worker(exchange.url, "stranger", supported_tokenizer_hashes=[sha("other")])

    special = {
        "precision": job(0, required_precision="fp8"),
        "quantization": job(1, required_quantization="fp8-e4m3"),
        "context": job(2, max_context_tokens=16384),
        "engine": job(3, allowed_engines=["vllm", "sglang"]),
        "experts": job(4, requires_routed_experts=True),
    }
    trainer.enqueue(list(special.values()))
    refused = plain.lease(wait_s=0.3)
    assert refused.lease is None and refused.reason is NoLeaseReason.no_matching_jobs
    alien = stranger.lease()
    assert alien.reason is NoLeaseReason.no_matching_jobs and "tokenizer" in alien.detail

    grants = {}
    for _ in special:
        grant = lease_one(capable)
        grants[grant.job.job_id] = grant
    assert set(grants) == {j.job_id for j in special.values()}
    reqs = {name: grants[j.job_id].lease.requirements for name, j in special.items()}
    assert reqs["precision"].precision_class == "fp8"
    assert reqs["quantization"].quantization_class == "fp8-e4m3"
    assert reqs["context"].max_context_tokens == 16384
    assert sorted(reqs["engine"].allowed_engines) == ["sglang", "vllm"]
    assert reqs["experts"].requires_routed_experts is True

    experts_grant = grants[special["experts"].job_id]
    with pytest.raises(Rejected) as caught:
        submit_for(capable, experts_grant)
    assert RejectionReason.missing_routed_experts in caught.value.rejection_reasons
    routed = [t.model_copy(update={"routed_experts": np.zeros((16, 2, 2), np.int16)})
              for t in trajectories(2)]
    capable.submit(capable.group_for(experts_grant, routed))
    precision_receipt = submit_for(capable, grants[special["precision"].job_id])
    fetched = {f.group.group_id: f.group for f in trainer.fetch(limit=16).groups}
    assert fetched[precision_receipt.group_id].precision_class == "fp8"

    # A plain job goes to the plain worker; the stranger still cannot run this policy.
    ordinary = job(5)
    trainer.enqueue(ordinary)
    assert stranger.lease().reason is NoLeaseReason.no_matching_jobs
    assert lease_one(plain).job.job_id == ordinary.job_id

    # The policy's own engine allow-list: the hf engine may not roll out v1.
    trainer.publish_policy(policy(1, allowed_engines=["vllm"]), quorum=1)
    capable.ack_reload(1, sha("ckpt-1"))
    plain.ack_reload(1, sha("ckpt-1"))
    trainer.wait_for_quorum(1, timeout=10)
    v1_job = job(6, version=1)
    trainer.enqueue(v1_job)
    blocked = plain.lease()
    assert blocked.reason is NoLeaseReason.no_matching_jobs and "engine hf" in blocked.detail
    v1_grant = lease_one(capable)
    assert v1_grant.job.job_id == v1_job.job_id
    assert v1_grant.lease.requirements.allowed_engines == ["vllm"]


# -- preference -----------------------------------------------------------------------------

def test_a_worker_with_better_feedback_is_preferred_until_the_hold_ends(start_exchange):
    server = start_exchange("--reaper-interval-s", "0.2", "--preference-hold-s", "3")
    trainer = server.trainer()
    trainer.publish_policy(policy(0))
    good = ready_worker(server.url, "good")
    sloppy = ready_worker(server.url, "sloppy")

    # Give the sloppy worker a quarantined group first: its feedback quality drops below 0.5.
    trainer.enqueue(job(0))
    grant = lease_one(sloppy)
    submit_for(sloppy, grant)
    (fetched,) = trainer.fetch().groups
    vetoed = [t.logprobs.astype(np.float64) + 40.0 for t in fetched.group.trajectories]
    receipt = trainer.report(fetched.group.group_id, decide(budget_report(fetched.group, vetoed)))
    assert receipt.tier == "quarantine" and receipt.worker_quality < 0.5
    qualities = {w.worker_id: w.quality for w in trainer.workers()}
    assert qualities["sloppy"] < qualities["good"]

    wanted = job(1)
    trainer.enqueue(wanted)
    first_ask = sloppy.lease()
    assert first_ask.lease is None and first_ask.reason is NoLeaseReason.deferred
    taken = lease_one(good, wait_s=0)
    assert taken.job.job_id == wanted.job_id
    submit_for(good, taken)

    # With nobody better asking, the hold runs out and the sloppy worker may take the job.
    later = job(2)
    enqueued_at = time.monotonic()
    trainer.enqueue(later)
    assert sloppy.lease().reason is NoLeaseReason.deferred
    grant = sloppy.lease(wait_s=20)
    assert grant.lease is not None and grant.job.job_id == later.job_id, grant
    assert time.monotonic() - enqueued_at >= 2.5
    issued = {e.data["job_id"]: e.actor for e in audit_events(trainer, "lease.issued")}
    assert issued[wanted.job_id] == "good" and issued[later.job_id] == "sloppy"


def test_a_cheaper_worker_is_preferred(start_exchange):
    server = start_exchange("--reaper-interval-s", "0.2", "--preference-hold-s", "3")
    trainer = server.trainer()
    trainer.publish_policy(policy(0))
    pricey = ready_worker(server.url, "pricey", price_hint=10.0)
    cheap = ready_worker(server.url, "cheap", price_hint=1.0)
    wanted = job(0)
    trainer.enqueue(wanted)
    refused = pricey.lease()
    assert refused.lease is None and refused.reason is NoLeaseReason.deferred
    assert lease_one(cheap, wait_s=0).job.job_id == wanted.job_id
    assert pricey.lease().reason is NoLeaseReason.queue_empty


def test_a_better_worker_that_cannot_run_a_job_does_not_hold_it_back(start_exchange):
    """Preference only defers to better-ranked workers that could actually take the job."""
    server = start_exchange("--reaper-interval-s", "0.2", "--preference-hold-s", "30")
    trainer = server.trainer()
    trainer.publish_policy(policy(0))
    plain = ready_worker(server.url, "plain", price_hint=0.0)  # better ranked, but bf16 only
    capable = ready_worker(server.url, "capable", price_hint=10.0, precision_classes=["bf16", "fp8"])

    ordinary = job(0)
    trainer.enqueue(ordinary)
    assert capable.lease().reason is NoLeaseReason.deferred  # plain is free and could take it
    submit_for(plain, lease_one(plain, wait_s=0))  # plain is idle again, and stays so

    only_mine = job(1, required_precision="fp8")
    trainer.enqueue(only_mine)
    grant = capable.lease()
    assert grant.lease is not None, grant
    assert grant.job.job_id == only_mine.job_id


# -- restart --------------------------------------------------------------------------------

def test_restart_keeps_tokens_and_state_and_requeues_leases_expired_meanwhile(start_exchange):
    server = start_exchange("--reaper-interval-s", "0.2", "--lease-ttl-s", "120")
    trainer = server.trainer()
    trainer.publish_policy(policy(0))
    keeper = ready_worker(server.url, "keeper")
    sleeper = ready_worker(server.url, "sleeper")
    done_job, long_job, short_job = job(0), job(1), job(2)
    trainer.enqueue(done_job)
    done_grant = lease_one(keeper)
    done_receipt = submit_for(keeper, done_grant)
    trainer.enqueue(long_job)
    long_grant = lease_one(keeper)  # 120 s lease: outlives both restarts

    def restart(*args: str) -> None:
        server.stop()
        # SIGTERM shuts down cleanly: the store closed every connection, so SQLite folded the
        # write-ahead log back into the database file and removed it.
        assert not Path(f"{server.db}-wal").exists()
        server.args = list(args)
        server.start()

    # Second life: leases last 2 s, and the sleeper takes one just before the next shutdown.
    restart("--reaper-interval-s", "0.2", "--lease-ttl-s", "2")
    trainer.enqueue(short_job)
    sleeper_again = WorkerClient(server.url, sleeper.http.token, manifest=sleeper.manifest)
    short_grant = lease_one(sleeper_again)
    assert short_grant.job.job_id == short_job.job_id
    server.stop()
    wait_until("the short lease to pass its expiry while the exchange is down",
               lambda: time.time() > short_grant.lease.expires_at.timestamp() + 0.5, every=0.1)

    # Third life: the reaper sweeps only every 60 s, so only start-up can re-queue the lease.
    server.args = ["--reaper-interval-s", "60", "--lease-ttl-s", "120"]
    server.start()
    trainer = server.trainer()
    (expired,) = audit_events(trainer, "lease.expired", short_grant.lease.lease_id)
    assert expired.actor == "reaper"
    states = job_states(trainer)
    assert states[short_job.job_id] == ("queued", 1)
    assert states[long_job.job_id] == ("leased", 1)
    assert states[done_job.job_id] == ("done", 1)
    assert len(audit_events(trainer, "exchange.started")) == 3

    # Tokens still work; the long lease still stands and can be completed.
    keeper_again = WorkerClient(server.url, keeper.http.token, manifest=keeper.manifest)
    reply = keeper_again.heartbeat(active_lease_ids=[long_grant.lease.lease_id])
    assert reply.status == "alive" and reply.cancelled_lease_ids == [] and not reply.reload_required
    long_receipt = submit_for(keeper_again, long_grant, seed=5)
    assert long_receipt.tier is Tier.fresh
    with pytest.raises(Conflict):
        WorkerClient(server.url).register(manifest("keeper"))

    pool = trainer.pool()
    assert pool.active_version == 0 and [p.policy_version for p in trainer.policies()] == [0]
    assert {w.worker_id for w in pool.workers} == {"keeper", "sleeper"}
    assert pool.leases == {"submitted": 2, "expired": 1}
    groups = {f.group.group_id: f.group for f in trainer.fetch(limit=16).groups}
    assert set(groups) == {done_receipt.group_id, long_receipt.group_id}
    assert groups[done_receipt.group_id].content_hash == done_receipt.content_hash

    # The re-queued job is leased again, by whoever asks.
    assert lease_one(sleeper_again).job.job_id == short_job.job_id


def test_a_worker_that_declares_a_reload_lag_leases_at_the_version_it_runs_until_it_is_too_far_behind(exchange):
    """A slow host (`max_reload_lag = 1`) keeps leasing at its loaded version while the published one
    is at most one newer; its group carries that version, so the lag is the group's real age; two
    versions behind it must reload like any worker. A worker without the declaration must always
    reload (the default is unchanged)."""
    trainer = exchange.trainer()
    trainer.publish_policy(policy(0))
    slow = ready_worker(exchange.url, "slow", max_reload_lag=1)
    prompt = ready_worker(exchange.url, "prompt")
    trainer.publish_policy(policy(1))
    prompt.ack_reload(1, sha("ckpt-1"))
    assert trainer.pool().active_version == 1  # quorum: 1 of 2 live workers

    trainer.enqueue([job(0, version=1), job(1, version=1)])
    grant = lease_one(slow)
    assert grant.lease.policy_version == 0 and grant.lease.requirements.checkpoint_digest == sha("ckpt-0")
    receipt = submit_for(slow, grant)
    assert receipt.policy_lag_steps == 1  # active 1 − its version 0
    (stored,) = trainer.fetch(tier=Tier.fresh, limit=10).groups
    assert stored.group.policy_version == 0 and stored.current_lag == 1

    trainer.publish_policy(policy(2))
    prompt.ack_reload(2, sha("ckpt-2"))
    behind = slow.lease()
    assert behind.lease is None and behind.reason is NoLeaseReason.reload_required
    assert behind.policy.policy_version == 2
    slow.ack_reload(2, sha("ckpt-2"))
    assert lease_one(slow).lease.policy_version == 2

    trainer.publish_policy(policy(3))
    unlagged = prompt.lease()
    assert unlagged.lease is None and unlagged.reason is NoLeaseReason.reload_required
