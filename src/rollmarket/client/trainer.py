"""TrainerClient: publish policies, enqueue jobs, fetch gated groups, report decisions."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import httpx

from ..contracts import (
    AuditPage,
    EnqueueReceipt,
    FetchedGroup,
    FetchResult,
    GroupDecision,
    JobView,
    MarketReport,
    PolicyManifest,
    PoolStatus,
    ReportReceipt,
    RolloutJob,
    Tier,
    TrainerFeedback,
    WorkerSummary,
    content_hash,
)
from .errors import ExchangeError, IntegrityError
from .http import HttpClient, Wire


class TrainerClient:
    """A trainer's session with an exchange (`url`: one base URL, or several replicas' — a list or
    one string separated by commas — among which it fails over).

    >>> trainer = TrainerClient("http://127.0.0.1:8470", token)
    >>> trainer.publish_policy(manifest); trainer.enqueue(jobs)
    >>> for fetched in trainer.fetch(limit=8).groups: ...
    """

    def __init__(self, url: str | Sequence[str], token: str, *, trainer_id: str = "default", timeout: float = 60.0,
                 retries: int = 4, wire: Wire = "msgpack", verify_hashes: bool = True,
                 transport: httpx.BaseTransport | None = None):
        self.http = HttpClient(url, token, timeout=timeout, retries=retries, wire=wire, transport=transport)
        self.trainer_id = trainer_id
        self.verify_hashes = verify_hashes

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "TrainerClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def publish_policy(self, manifest: PolicyManifest, *, quorum: int | None = None) -> PoolStatus:
        """Publish a version; it becomes active once `quorum` (default: the exchange's rule) workers ack it."""
        return self.http.call("POST", "/v1/policies", body=manifest, params={"quorum": quorum},
                              answer=PoolStatus, idempotent=True)

    def policies(self) -> list[PolicyManifest]:
        return self.http.call("GET", "/v1/policies", answer=list[PolicyManifest], idempotent=True)

    def enqueue(self, jobs: RolloutJob | Iterable[RolloutJob]) -> list[EnqueueReceipt]:
        """Enqueue jobs atomically. Safe to retry: each job's idempotency key makes it happen once."""
        batch = [jobs] if isinstance(jobs, RolloutJob) else list(jobs)
        answer = self.http.call("POST", "/v1/jobs", body={"jobs": batch}, idempotent=True)
        return [EnqueueReceipt.model_validate(r) for r in answer["receipts"]]

    def jobs(self, state: str | None = None, limit: int = 100) -> list[JobView]:
        return self.http.call("GET", "/v1/jobs", params={"state": state, "limit": limit},
                              answer=list[JobView], idempotent=True)

    def fetch(self, *, tier: Tier | str = Tier.fresh, policy_version: int | None = None,
              max_staleness: int | None = None, precision_class: str | None = None, limit: int = 16,
              include_served: bool = False, newest_first: bool = False) -> FetchResult:
        """Groups that fit the filters, each checked against its content hash.

        Groups already served to this trainer are skipped until they are redelivered (when no
        decision arrived in time), unless `include_served`.
        """
        params = {
            "tier": Tier(tier).value, "policy_version": policy_version, "max_staleness": max_staleness,
            "precision_class": precision_class, "limit": limit,
            "include_served": str(include_served).lower(), "newest_first": str(newest_first).lower(),
            "trainer_id": self.trainer_id,
        }
        result = self.http.call("GET", "/v1/groups", params=params, answer=FetchResult)
        return result.model_copy(update={"groups": [self._checked(g) for g in result.groups]})

    def group(self, group_id: str) -> FetchedGroup:
        fetched = self.http.call("GET", f"/v1/groups/{group_id}", answer=FetchedGroup, idempotent=True)
        return self._checked(fetched)

    def _checked(self, fetched: FetchedGroup) -> FetchedGroup:
        """Verify the content hash, then stamp the group with its current lag (not hashed), so
        that `budget_report(fetched.group, ...)` sees how stale it is."""
        group = fetched.group
        if self.verify_hashes and group.content_hash != content_hash(group):
            raise IntegrityError(f"group {group.group_id} does not match its content hash")
        stamped = group.model_copy(update={"policy_lag_steps": fetched.current_lag})
        return fetched.model_copy(update={"group": stamped})

    def _feedback(self, decision: GroupDecision | None, feedback: TrainerFeedback | None | bool
                  ) -> TrainerFeedback | None:
        """`report`'s feedback argument as sent: True derives it from the decision, False sends none."""
        if feedback is True:
            if decision is None:
                raise ExchangeError("feedback=True needs a decision to derive it from")
            return TrainerFeedback.from_decision(decision, trainer_id=self.trainer_id)
        return None if feedback is False else feedback

    def report(self, group_id: str, decision: GroupDecision | None = None,
               feedback: TrainerFeedback | None | bool = True) -> ReportReceipt:
        """Record a decision (moving the group between tiers) and feedback on its worker.

        `feedback=True` derives the feedback from the decision; `False` sends none.
        """
        body = {"decision": decision, "feedback": self._feedback(decision, feedback)}
        return self.http.call("POST", f"/v1/groups/{group_id}/report", body=body, answer=ReportReceipt,
                              headers={"x-trainer-id": self.trainer_id})

    def report_many(self, reports: Iterable[tuple[str, GroupDecision | None, TrainerFeedback | None | bool]]
                    ) -> list[ReportReceipt]:
        """Several `report` calls in one request and one write: all are recorded or none is (an
        unknown group refuses the batch). Each item is (group_id, decision, feedback) with
        `feedback` as in `report`."""
        items = [{"group_id": group_id, "decision": decision, "feedback": self._feedback(decision, feedback)}
                 for group_id, decision, feedback in reports]
        answer = self.http.call("POST", "/v1/groups/reports", body={"reports": items},
                                headers={"x-trainer-id": self.trainer_id})
        return [ReportReceipt.model_validate(r) for r in answer["receipts"]]

    def pool(self) -> PoolStatus:
        return self.http.call("GET", "/v1/pool", answer=PoolStatus, idempotent=True)

    def workers(self) -> list[WorkerSummary]:
        return self.http.call("GET", "/v1/workers", answer=list[WorkerSummary], idempotent=True)

    def market(self) -> MarketReport:
        """The exchange's marketplace report (what the dashboard's /market page shows)."""
        return self.http.call("GET", "/v1/market", answer=MarketReport, idempotent=True)

    def audit(self, *, since_seq: int = 0, kind: str | None = None, subject: str | None = None,
              limit: int = 500) -> AuditPage:
        return self.http.call("GET", "/v1/audit", answer=AuditPage, idempotent=True,
                              params={"since_seq": since_seq, "kind": kind, "subject": subject, "limit": limit})

    def wait_for_quorum(self, version: int, *, timeout: float = 60.0, poll_s: float = 0.1) -> PoolStatus:
        """Block until `version` (or a later one) is active; raise ExchangeError on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.pool()
            if status.active_version is not None and status.active_version >= version:
                return status
            if time.monotonic() >= deadline:
                raise ExchangeError(
                    f"version {version} not active after {timeout}s: {status.acks}/{status.quorum} acks, "
                    f"{status.alive_workers} live workers"
                )
            time.sleep(poll_s)
