"""The market rules (exchange/rules.py) without a database: each case states the rule it locks.
Both stores call these functions, so these cases hold for SQLite and PostgreSQL alike."""

from __future__ import annotations

import pytest

from helpers import policy
from rollmarket.contracts import DecisionStatus, NoLeaseReason, Tier
from rollmarket.exchange import rules


@pytest.mark.parametrize(("loaded", "active", "published", "lag", "expected"), [
    (3, 3, 3, 0, rules.LeaseVersion(3)),                                  # aligned
    (None, None, 0, 0, rules.LeaseVersion(None, NoLeaseReason.reload_required)),
    (2, 3, 3, 0, rules.LeaseVersion(None, NoLeaseReason.reload_required)),  # no declared lag
    (2, 3, 3, 1, rules.LeaseVersion(2)),                                  # within its declared lag
    (1, 3, 3, 1, rules.LeaseVersion(None, NoLeaseReason.reload_required)),  # beyond it
    (3, 2, 3, 0, rules.LeaseVersion(None, NoLeaseReason.awaiting_quorum)),  # loaded, not yet active
    (2, 1, 3, 2, rules.LeaseVersion(None, NoLeaseReason.reload_required)),  # its version never active
])
def test_lease_version(loaded, active, published, lag, expected):
    assert rules.lease_version(loaded, active, published, lag) == expected


def test_quorum_is_the_override_else_a_share_of_live_workers_at_least_the_minimum():
    assert rules.quorum_needed(10, 7, 0.5, 1) == 7
    assert rules.quorum_needed(5, None, 0.5, 1) == 3   # ceil(2.5)
    assert rules.quorum_needed(0, None, 0.5, 2) == 2
    assert rules.activates(None, 0, 1, 1) and not rules.activates(None, 0, 2, 1)
    assert not rules.activates(4, 4, 0, 9)  # already active
    assert not rules.activates(None, None, 0, 0)


def test_publish_refusal():
    assert rules.publish_refusal(policy(1), None, None) is None
    assert rules.publish_refusal(policy(2), None, 1) is None
    assert "not newer" in rules.publish_refusal(policy(1), None, 1)
    repeat = policy(1).model_copy(update={"created_at": policy(1).created_at.replace(year=2001)})
    assert rules.publish_refusal(repeat, policy(1), 1) == ""
    assert "other content" in rules.publish_refusal(policy(1, vocab_size=7), policy(1), 1)


def test_competition_prices_are_judged_against_the_pool():
    scores = rules.competitor_scores([("a", 0.5, 1.0), ("b", 0.5, 2.0), ("c", 0.9, 2.0)], price_weight=0.3)
    assert scores == {"a": pytest.approx(0.5 - 0.15), "b": pytest.approx(0.2), "c": pytest.approx(0.6)}
    assert rules.better_ranked(scores, "b") == ["a", "c"]
    assert rules.better_ranked(scores, "outsider") == ["a", "b", "c"]  # scores 0 when not a candidate
    assert rules.competitor_scores([], 0.3) == {}


def test_jobs_are_held_only_when_scarce():
    assert not rules.must_hold(better=0, available=0)
    assert rules.must_hold(better=2, available=2)
    assert not rules.must_hold(better=2, available=3)


@pytest.mark.parametrize(("retry", "attempts", "deadline", "expected"), [
    (True, 1, None, "queued"),
    (True, 3, None, "failed"),    # max_attempts used up
    (False, 1, None, "failed"),   # not retryable
    (True, 1, 100.0, "expired"),  # deadline passed (now = 100)
    (False, 1, 100.0, "expired"),
    (True, 1, 101.0, "queued"),
])
def test_end_of_lease(retry, attempts, deadline, expected):
    assert rules.end_of_lease(retry, attempts, 3, deadline, now=100.0) == expected


def test_heartbeat_grace_after_a_restart():
    assert rules.heartbeat_cutoff(now=100.0, started_at=95.0, heartbeat_ttl_s=10.0) is None
    assert rules.heartbeat_cutoff(now=100.0, started_at=90.0, heartbeat_ttl_s=10.0) == 90.0


def test_groups_arrival_lag_placement_and_quality():
    assert rules.arrival_lag(5, 3) == 2 and rules.arrival_lag(None, 0) == 0 and rules.arrival_lag(2, 3) == 0
    assert rules.placement(DecisionStatus.train, Tier.replay, "available") == (Tier.replay, "consumed")
    assert rules.placement(DecisionStatus.train_with_correction, Tier.fresh, "available") == (Tier.fresh, "consumed")
    assert rules.placement(DecisionStatus.replay, Tier.fresh, "available") == (Tier.replay, "available")
    assert rules.placement(DecisionStatus.quarantine, Tier.fresh, "available") == (Tier.quarantine, "available")
    assert rules.placement(DecisionStatus.reject, Tier.fresh, "available") == (Tier.fresh, "dropped")
    assert rules.updated_quality(0.5, 1.0, 0.2) == pytest.approx(0.6)
    assert rules.updated_quality(0.5, rules.REJECTED_SCORE, 0.2) == pytest.approx(0.4)


def test_fetch_window():
    window = rules.fetch_window(active=7, max_staleness=2, include_served=False, now=1000.0, redeliver_after_s=300.0)
    assert window == rules.FetchWindow(oldest_version=5, redeliver_before=700.0)
    assert rules.fetch_window(None, 2, True, 1000.0, 300.0) == rules.FetchWindow(None, None)
