"""The storage interface of the exchange, implemented by SQLite and PostgreSQL (`stores/`).

Every method is one atomic step of the exchange's state machine and is awaited by the service.
A backend must make each call all-or-nothing and durable before it returns, and must record an
audit event for every state change in the same transaction as the change.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from ..contracts import (
    AuditPage,
    EnqueueReceipt,
    FailureReport,
    GroupDecision,
    HeartbeatReply,
    JobView,
    LeaseGrant,
    MarketReport,
    PolicyManifest,
    PoolStatus,
    ReportReceipt,
    ReloadAck,
    ReloadStatus,
    RolloutJob,
    RolloutLease,
    SampleGroup,
    SubmissionReceipt,
    Tier,
    TrainerFeedback,
    WorkerHeartbeat,
    WorkerManifest,
    WorkerSummary,
)
from ..gate import Finding


class StoreError(RuntimeError):
    """The store cannot be opened or reached: a bad URL, a server that is down, a missing extra,
    a database whose schema is newer than this exchange."""


@dataclass(frozen=True)
class FetchFilter:
    """Which stored groups a trainer asks for."""

    trainer_id: str = "default"
    tier: Tier = Tier.fresh
    policy_version: int | None = None
    max_staleness: int | None = None
    precision_class: str | None = None
    limit: int = 16
    include_served: bool = False
    newest_first: bool = False


@dataclass(frozen=True)
class StoredGroup:
    """A stored group's metadata and its payload exactly as stored (msgpack bytes)."""

    group_id: str
    tier: Tier
    status: str
    received_at: float
    policy_version: int
    lag_at_arrival: int
    served_count: int
    payload: bytes


@dataclass(frozen=True)
class FetchBatch:
    groups: list[StoredGroup]
    active_version: int | None
    remaining: int


@dataclass
class ReapResult:
    expired_leases: list[str] = field(default_factory=list)
    abandoned_leases: list[str] = field(default_factory=list)
    dead_workers: list[str] = field(default_factory=list)
    requeued_jobs: list[str] = field(default_factory=list)
    failed_jobs: list[str] = field(default_factory=list)
    activated_version: int | None = None

    @property
    def changed(self) -> bool:
        return bool(self.expired_leases or self.abandoned_leases or self.dead_workers
                    or self.failed_jobs or self.activated_version is not None)


@dataclass(frozen=True)
class SubmitOutcome:
    receipt: SubmissionReceipt | None
    rejected: list[Finding]
    tokens: int = 0


class Store(ABC):
    """Durable state of one exchange. Times are POSIX seconds passed in by the caller."""

    @abstractmethod
    async def open(self, settings_json: dict, now: float) -> None: ...

    @abstractmethod
    async def close(self) -> None: ...

    # -- workers --------------------------------------------------------------------------
    @abstractmethod
    async def register_worker(self, manifest: WorkerManifest, token_hash: str, now: float) -> None: ...

    @abstractmethod
    async def worker_token_hashes(self) -> dict[str, str]: ...

    @abstractmethod
    async def latest_policy(self) -> PolicyManifest | None: ...

    @abstractmethod
    async def workers(self) -> list[WorkerSummary]: ...

    @abstractmethod
    async def heartbeat(self, beat: WorkerHeartbeat, now: float) -> HeartbeatReply: ...

    @abstractmethod
    async def lease(self, worker_id: str, now: float) -> LeaseGrant: ...

    @abstractmethod
    async def submit(self, group: SampleGroup, payload: bytes, findings: list[Finding],
                     now: float) -> SubmitOutcome: ...

    @abstractmethod
    async def renew_lease(self, worker_id: str, lease_id: str, now: float) -> RolloutLease: ...

    @abstractmethod
    async def fail_lease(self, worker_id: str, lease_id: str, report: FailureReport, now: float) -> str: ...

    @abstractmethod
    async def ack_reload(self, ack: ReloadAck, now: float) -> ReloadStatus: ...

    # -- trainer --------------------------------------------------------------------------
    @abstractmethod
    async def publish_policy(self, manifest: PolicyManifest, quorum: int | None, now: float) -> PoolStatus: ...

    @abstractmethod
    async def policies(self) -> list[PolicyManifest]: ...

    @abstractmethod
    async def enqueue(self, jobs: list[RolloutJob], now: float) -> list[EnqueueReceipt]: ...

    @abstractmethod
    async def jobs(self, state: str | None, limit: int) -> list[JobView]: ...

    @abstractmethod
    async def fetch(self, query: FetchFilter, now: float) -> FetchBatch: ...

    @abstractmethod
    async def group(self, group_id: str) -> StoredGroup | None: ...

    @abstractmethod
    async def report(self, trainer_id: str, group_id: str, decision: GroupDecision | None,
                     feedback: TrainerFeedback | None, now: float) -> ReportReceipt: ...

    @abstractmethod
    async def report_many(self, reports: list[tuple[str, str, GroupDecision | None, TrainerFeedback | None]],
                          now: float) -> list[ReportReceipt]:
        """(trainer_id, group_id, decision, feedback) reports applied all together or not at all."""

    # -- operations -----------------------------------------------------------------------
    @abstractmethod
    async def reap(self, now: float) -> ReapResult: ...

    @abstractmethod
    async def pool_status(self, now: float) -> PoolStatus: ...

    @abstractmethod
    async def audit(self, since_seq: int, kind: str | None, subject: str | None, limit: int) -> AuditPage: ...

    @abstractmethod
    async def market(self, now: float) -> MarketReport:
        """Workers, decisions over time, rejections, lags, reload latency, throughput, trainer idle."""

    @abstractmethod
    async def counts(self) -> dict[str, dict[str, int]]:
        """Counts by state for jobs, leases, workers, available groups (by tier), audit kinds,
        and the pool's versions under "pool" ("active", "published"; -1 when none)."""

    on_batch: Callable[[int], object] | None = None
    """Optional callback a backend calls with the size of each committed write batch."""
