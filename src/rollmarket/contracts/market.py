"""The marketplace report: what an exchange's workers sold and what the trainer bought, over time.

`GET /v1/market` answers it from a running exchange; `rollmarket.exchange.market.market_report`
computes the same record from an exchange database file, so the dashboard shows the same numbers
either way.
"""

from __future__ import annotations

from pydantic import Field

from .base import Identifier, Record, UtcDatetime
from .limits import MAX_ITEMS, MAX_NAMES, Count, Key, Name, Version

MAX_BUCKETS = 40
"""At most this many timeline buckets (one more when the first event falls late in its bucket)."""


class MarketWorker(Record):
    """One worker: its profile (what it runs on), its standing and what it delivered."""

    worker_id: Identifier
    status: Name = Field(description="alive or dead.")
    engine_name: Name
    engine_version: Name
    device_type: Name
    device_count: Count
    region: Name
    precision_classes: list[Name] = Field(max_length=MAX_NAMES)
    engine_fingerprint: Key = Field(description="The fingerprint of the engine it last acked (else its manifest's).")
    quality: float = Field(description="EWMA of trainer feedback scores; a rejected submission scores 0.")
    price_hint: float = Field(description="Relative price per 1M tokens, from its manifest.")
    leases: Count = Field(description="Leases ever issued to it.")
    active_leases: Count
    accepted: Count = Field(description="Groups the exchange stored from it.")
    rejected: Count = Field(description="Submissions the exchange refused from it.")
    accepted_tokens: Count = Field(description="Response tokens in its stored groups.")
    decisions: dict[Name, Count] = Field(max_length=MAX_NAMES, description="The trainer's decisions on its groups, by status.")


class MarketFingerprint(Record):
    """Trainer feedback kept per engine fingerprint: what one build's numerics earn across workers."""

    engine_fingerprint: Key
    quality: float = Field(description="EWMA of the feedback scores of its groups; a rejected submission scores 0.")
    feedback_count: Count = Field(description="Feedback scores received for its groups.")
    rejected_count: Count = Field(description="Submissions refused from workers running it.")
    accepted: Count = Field(description="Groups the exchange stored with this fingerprint.")
    workers: list[Identifier] = Field(max_length=MAX_ITEMS, description="Workers running it now.")


class MarketBucket(Record):
    """One time bucket: decisions made in it, by worker, by arrival tier and by status, and what arrived."""

    start: UtcDatetime
    by_worker: dict[Identifier, Count] = Field(max_length=MAX_ITEMS)
    by_tier: dict[Name, Count] = Field(max_length=MAX_NAMES, description="By the tier the group arrived in (fresh, replay, quarantine).")
    by_status: dict[Name, Count] = Field(max_length=MAX_NAMES)
    accepted_groups: Count = Field(description="Groups stored in this bucket.")
    accepted_tokens: Count = Field(description="Response tokens of the groups stored in this bucket.")


class LagBin(Record):
    lag: Version = Field(description="Policy versions behind the active one when the group arrived.")
    groups: Count


class ReloadLatency(Record):
    """How long a worker took to load a published policy version."""

    worker_id: Identifier
    policy_version: Version
    seconds: float = Field(description="acked_at − published_at.")


class TrainerIdle(Record):
    """trainer idle fraction = 1 − busy / span. A trainer is busy on a group from the first time it is
    served to it until the trainer's first decision on it (undecided: until the span ends); span runs
    from its first served group to its last serve or decision. Idle is time it held nothing to train
    on: waiting for rollouts."""

    trainer_id: Identifier
    groups: Count = Field(description="Groups served to it.")
    span_s: float
    busy_s: float
    idle_fraction: float | None = Field(description="None when the span is empty (a single instant).")


class MarketReport(Record):
    generated_at: UtcDatetime
    active_version: Version | None
    published_version: Version | None
    workers: list[MarketWorker] = Field(max_length=MAX_ITEMS)
    decisions: dict[Name, Count] = Field(max_length=MAX_NAMES, description="Every trainer decision, by status.")
    bucket_s: float = Field(description="Width of each timeline bucket in seconds.")
    timeline: list[MarketBucket] = Field(max_length=MAX_BUCKETS + 1, description="Oldest first; every bucket from the first event to the last.")
    submission_rejections: dict[Name, Count] = Field(
        max_length=MAX_NAMES,
        description="Why the exchange refused submissions (RejectionReason values; one submission may count "
                    "under several).")
    gate_rejections: dict[Name, Count] = Field(
        max_length=MAX_NAMES,
        description="Rejection reasons in the trainer's decisions (its gate's findings).")
    lag_histogram: list[LagBin] = Field(
        max_length=MAX_ITEMS, description="Stored groups by policy lag at arrival, every lag from 0; the last bin "
                                          "also holds every larger lag.")
    reload_acks: list[ReloadLatency] = Field(max_length=MAX_ITEMS, description="The newest acks, oldest first.")
    reload_latency_mean_s: float | None = Field(description="Over every ack.")
    reload_latency_max_s: float | None = Field(description="Over every ack.")
    accepted_groups: Count
    accepted_tokens: Count
    accepted_span_s: float = Field(description="From the first stored group to the last.")
    accepted_tokens_per_s: float | None = Field(description="accepted_tokens / accepted_span_s; None under 2 groups.")
    trainers: list[TrainerIdle] = Field(max_length=MAX_ITEMS)
    fingerprints: list[MarketFingerprint] = Field(
        default_factory=list, max_length=MAX_ITEMS,
        description="Feedback quality per engine fingerprint (empty for a database from before it was kept).")
