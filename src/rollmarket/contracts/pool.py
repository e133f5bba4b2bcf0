"""Read models: the pool's state and the audit log, as the exchange reports them."""

from __future__ import annotations

from pydantic import Field

from .base import Identifier, Record, UtcDatetime
from .limits import MAX_ITEMS, MAX_NAMES, Count, Int64, JsonObject, Key, Name, Version
from .policy import PolicyManifest
from .worker import WorkerManifest


class WorkerSummary(Record):
    worker_id: Identifier
    pool: Identifier | None = Field(default=None, description="The pool it belongs to, from its manifest.")
    status: Name = Field(description="alive or dead.")
    engine_name: Name
    engine_fingerprint: Key
    precision_classes: list[Name] = Field(max_length=MAX_NAMES)
    loaded_version: Version | None
    aligned: bool
    active_leases: Count
    quality: float = Field(
        description="EWMA of trainer feedback scores (prior 0.5); a rejected submission scores 0."
    )
    feedback_count: Count
    rejected_count: Count
    price_hint: float
    last_heartbeat_at: UtcDatetime
    registered_at: UtcDatetime


class WorkerDetail(Record):
    summary: WorkerSummary
    manifest: WorkerManifest


class PoolStatus(Record):
    active_version: Version | None
    published_version: Version | None
    policy: PolicyManifest | None = Field(description="The latest published manifest.")
    quorum: Count = Field(description="Acks the published version needs to become active.")
    acks: Count = Field(description="Acks of the published version from live workers.")
    alive_workers: Count
    dead_workers: Count
    jobs: dict[Name, Int64] = Field(max_length=MAX_NAMES, description="Job counts by state.")
    leases: dict[Name, Int64] = Field(max_length=MAX_NAMES, description="Lease counts by state.")
    groups: dict[Name, Int64] = Field(max_length=MAX_NAMES, description="Available group counts by tier.")
    workers: list[WorkerSummary] = Field(max_length=MAX_ITEMS * 100)


class AuditEvent(Record):
    seq: int = Field(ge=0, le=2**63 - 1)
    at: UtcDatetime
    kind: Name
    actor: Key
    subject: Key
    data: JsonObject


class AuditPage(Record):
    events: list[AuditEvent] = Field(max_length=MAX_ITEMS)
    next_seq: int = Field(ge=0, le=2**63 - 1, description="Pass as since_seq to read on.")
