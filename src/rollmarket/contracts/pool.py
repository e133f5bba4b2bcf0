"""Read models: the pool's state and the audit log, as the exchange reports them."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from .base import Record, UtcDatetime
from .policy import PolicyManifest
from .worker import WorkerManifest


class WorkerSummary(Record):
    worker_id: str
    status: str = Field(description="alive or dead.")
    engine_name: str
    engine_fingerprint: str
    precision_classes: list[str]
    loaded_version: int | None
    aligned: bool
    active_leases: int
    quality: float = Field(
        description="EWMA of trainer feedback scores (prior 0.5); a rejected submission scores 0."
    )
    feedback_count: int
    rejected_count: int
    price_hint: float
    last_heartbeat_at: UtcDatetime
    registered_at: UtcDatetime


class WorkerDetail(Record):
    summary: WorkerSummary
    manifest: WorkerManifest


class PoolStatus(Record):
    active_version: int | None
    published_version: int | None
    policy: PolicyManifest | None = Field(description="The latest published manifest.")
    quorum: int = Field(description="Acks the published version needs to become active.")
    acks: int = Field(description="Acks of the published version from live workers.")
    alive_workers: int
    dead_workers: int
    jobs: dict[str, int] = Field(description="Job counts by state.")
    leases: dict[str, int] = Field(description="Lease counts by state.")
    groups: dict[str, int] = Field(description="Available group counts by tier.")
    workers: list[WorkerSummary]


class AuditEvent(Record):
    seq: int
    at: UtcDatetime
    kind: str
    actor: str
    subject: str
    data: dict[str, Any]


class AuditPage(Record):
    events: list[AuditEvent]
    next_seq: int = Field(description="Pass as since_seq to read on.")
