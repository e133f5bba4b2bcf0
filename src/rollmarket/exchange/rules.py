"""The market rules of the exchange, as pure functions over contracts and plain values.

Every store backend reads the rows a rule needs, calls the rule, and writes what it decides, so
SQLite and PostgreSQL share one set of rules and a rule is tested without a database. Which
worker may run which job (and its score) lives beside these in `dispatch.py`; arrival triage is
the gate's `triage_on_arrival`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..contracts import DecisionStatus, NoLeaseReason, PolicyManifest, Tier
from .dispatch import worker_score

NEUTRAL_QUALITY = 0.5
"""Quality a worker (or an engine fingerprint) starts with, before any trainer feedback."""

REJECTED_SCORE = 0.0
"""A rejected submission counts as trainer feedback of this score."""


# -- reload and the policy quorum -----------------------------------------------------------
@dataclass(frozen=True)
class LeaseVersion:
    """The policy version a worker may lease at now, or why it may not lease."""

    version: int | None
    refusal: NoLeaseReason | None = None


def lease_version(loaded: int | None, active: int | None, published: int,
                  max_reload_lag: int) -> LeaseVersion:
    """Which version a worker that has `loaded` leases at, given the pool's versions.

    A worker that declared max_reload_lag (a slow host that reloads every few versions) goes on
    leasing at the version it runs while that is at most max_reload_lag behind the published one
    and already active; its groups carry that version, so their lag is real. Every other worker
    moves to the newest published version, and leases flow again once the quorum made it active.
    """
    if (loaded is not None and active is not None and loaded < published and loaded <= active
            and published - loaded <= max_reload_lag):
        return LeaseVersion(loaded)
    if loaded != published:
        return LeaseVersion(None, NoLeaseReason.reload_required)
    if active != published:
        return LeaseVersion(None, NoLeaseReason.awaiting_quorum)
    return LeaseVersion(published)


def quorum_needed(alive_workers: int, override: int | None, fraction: float, minimum: int) -> int:
    """Reload acks that activate a version: the publisher's override, else a share of live workers."""
    if override is not None:
        return int(override)
    return max(minimum, math.ceil(fraction * alive_workers))


def activates(active: int | None, published: int | None, needed: int, acks: int) -> bool:
    """Whether the published version becomes active now."""
    return published is not None and published != active and acks >= needed


def publish_refusal(manifest: PolicyManifest, stored: PolicyManifest | None,
                    published: int | None) -> str | None:
    """Why `manifest` may not be published, "" when it is a repeat (a no-op), None when it may.

    The same content again (created_at aside: a retry or a resumed trainer builds the manifest
    anew) is a repeat; other content under a version, or a version not newer, is a conflict.
    """
    if stored is not None:
        if stored.model_copy(update={"created_at": manifest.created_at}) == manifest:
            return ""
        return f"policy version {manifest.policy_version} was already published with other content"
    if published is not None and manifest.policy_version <= published:
        return f"policy version {manifest.policy_version} is not newer than {published}"
    return None


# -- leases ---------------------------------------------------------------------------------
def competitor_scores(candidates: list[tuple[str, float, float]], price_weight: float) -> dict[str, float]:
    """Scores of (worker_id, quality, price) candidates, their prices judged against each other."""
    max_price = max((price for _, _, price in candidates), default=0.0)
    return {worker_id: worker_score(quality, price, max_price, price_weight)
            for worker_id, quality, price in candidates}


def better_ranked(scores: dict[str, float], worker_id: str) -> list[str]:
    """Workers that outrank `worker_id` (which scores 0 when it is not a candidate itself)."""
    own = scores.get(worker_id, 0.0)
    return [w for w, s in scores.items() if s > own and w != worker_id]


def must_hold(better: int, available: int) -> bool:
    """Whether matching jobs are scarce enough to be left to `better` better-ranked free workers
    (until a job has waited preference_hold_s)."""
    return better > 0 and available <= better


def end_of_lease(retry: bool, attempts: int, max_attempts: int, deadline: float | None,
                 now: float) -> str:
    """The job's next state when its lease ends without a group: queued, failed or expired."""
    past_deadline = deadline is not None and deadline <= now
    if retry and attempts < max_attempts and not past_deadline:
        return "queued"
    return "expired" if past_deadline else "failed"


def heartbeat_cutoff(now: float, started_at: float, heartbeat_ttl_s: float) -> float | None:
    """Workers silent since before this are dead; None while the exchange's restart grace lasts
    (after a restart every worker gets one full TTL from the moment the exchange started)."""
    cutoff = now - heartbeat_ttl_s
    return cutoff if started_at <= cutoff else None


# -- groups and trainers --------------------------------------------------------------------
def arrival_lag(active: int | None, policy_version: int) -> int:
    """Policy lag of a group when it arrives: steps its version is behind the active one."""
    return max(0, (active or 0) - policy_version)


def placement(decision: DecisionStatus, tier: Tier, status: str) -> tuple[Tier, str]:
    """Where a group goes once a trainer decided on it: (tier, status)."""
    if decision in (DecisionStatus.train, DecisionStatus.train_with_correction):
        return tier, "consumed"
    if decision is DecisionStatus.replay:
        return Tier.replay, status
    if decision is DecisionStatus.quarantine:
        return Tier.quarantine, status
    return tier, "dropped"


def updated_quality(quality: float, score: float, alpha: float) -> float:
    """Quality after one more feedback score (an EWMA; a rejection scores REJECTED_SCORE)."""
    return (1 - alpha) * quality + alpha * score


@dataclass(frozen=True)
class FetchWindow:
    """Bounds a fetch applies beyond tier and precision."""

    oldest_version: int | None
    """Groups of older policy versions are too stale; None when any version will do."""
    redeliver_before: float | None
    """A group served but undecided since before this is served again; None: served ones too."""


def fetch_window(active: int | None, max_staleness: int | None, include_served: bool, now: float,
                 redeliver_after_s: float) -> FetchWindow:
    """What a fetch may return. Served but undecided groups come back after redeliver_after_s, so
    a fetch whose answer was lost in transit cannot lose groups."""
    oldest = active - max_staleness if max_staleness is not None and active is not None else None
    return FetchWindow(oldest_version=oldest,
                       redeliver_before=None if include_served else now - redeliver_after_s)
