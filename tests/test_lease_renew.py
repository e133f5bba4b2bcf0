"""Lease renewal: a worker on a long agent rollout keeps its lease alive; an ended lease cannot be
renewed, and another worker cannot renew it."""

from __future__ import annotations

import time

import pytest

from helpers import job, lease_one, policy, ready_worker, trajectories
from rollmarket.client import Conflict, NotFound


def test_renewal_keeps_a_lease_past_its_ttl_and_the_group_is_accepted(start_exchange):
    server = start_exchange("--lease-ttl-s", "1.5", "--reaper-interval-s", "0.1")
    trainer = server.trainer()
    trainer.publish_policy(policy(0))
    worker = ready_worker(server.url, "w1")
    trainer.enqueue(job(0))
    grant = lease_one(worker)
    first_expiry = grant.lease.expires_at
    deadline = time.monotonic() + 4.0  # well past the 1.5 s TTL
    renewed = grant.lease
    while time.monotonic() < deadline:
        time.sleep(0.4)
        renewed = worker.renew(grant.lease.lease_id)
    assert renewed.expires_at > first_expiry
    receipt = worker.submit(worker.group_for(grant, trajectories(2)))
    assert receipt.lease_id == grant.lease.lease_id
    kinds = [e.kind for e in trainer.audit(subject=grant.lease.lease_id).events]
    assert "lease.renewed" in kinds and "lease.expired" not in kinds


def test_an_expired_lease_cannot_be_renewed_and_its_job_moves_on(start_exchange):
    server = start_exchange("--lease-ttl-s", "0.5", "--reaper-interval-s", "0.1")
    trainer = server.trainer()
    trainer.publish_policy(policy(0))
    worker = ready_worker(server.url, "w1")
    trainer.enqueue(job(0))
    grant = lease_one(worker)
    deadline = time.monotonic() + 30
    while trainer.jobs()[0].state != "queued":
        assert time.monotonic() < deadline, "the lease never expired"
        time.sleep(0.1)
    with pytest.raises(Conflict) as error:
        worker.renew(grant.lease.lease_id)
    assert error.value.code == "lease_not_active"


def test_only_the_owner_can_renew(start_exchange):
    server = start_exchange()
    trainer = server.trainer()
    trainer.publish_policy(policy(0))
    owner = ready_worker(server.url, "owner")
    other = ready_worker(server.url, "other")
    trainer.enqueue(job(0))
    grant = lease_one(owner)
    before = trainer.audit(subject=grant.lease.lease_id).events
    # Another worker's lease is answered exactly as a lease that does not exist.
    with pytest.raises(NotFound) as theirs:
        other.renew(grant.lease.lease_id)
    with pytest.raises(NotFound) as nobodys:
        other.renew("lease_does_not_exist")
    assert (theirs.value.message, theirs.value.details) == (nobodys.value.message, nobodys.value.details)
    assert trainer.audit(subject=grant.lease.lease_id).events == before
