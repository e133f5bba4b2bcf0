"""The exchange's behaviour, between HTTP and the store: auth, validation, long polls, reaping."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from ..contracts import (
    AuditPage,
    EnqueueReceipt,
    ErrorCode,
    FailureReport,
    GroupDecision,
    HeartbeatReply,
    LeaseGrant,
    MarketReport,
    NoLeaseReason,
    PolicyManifest,
    PoolStatus,
    ReloadAck,
    ReloadStatus,
    ReportReceipt,
    RolloutJob,
    RolloutLease,
    SampleGroup,
    SubmissionReceipt,
    TrainerFeedback,
    WorkerHeartbeat,
    WorkerManifest,
    WorkerRegistration,
    WorkerSummary,
)
from ..contracts.wire import packb
from ..gate import check_group, load_public_key, reasons_of
from . import auth
from .errors import ExchangeFault
from .leader import Leadership, leadership_for
from .metrics import ExchangeMetrics
from .settings import ExchangeSettings
from .store import FetchBatch, FetchFilter, ReapResult, Store, StoredGroup
from .stores import open_store

log = logging.getLogger(__name__)

_WAIT_FOR_WORK = {NoLeaseReason.queue_empty, NoLeaseReason.no_matching_jobs, NoLeaseReason.deferred,
                  NoLeaseReason.no_policy, NoLeaseReason.awaiting_quorum}


class Exchange:
    """One exchange process, possibly one of several replicas on a shared store.

    `start()` opens the store, starts contending for leadership and starts the reaper, which
    sweeps only while this replica leads. Nothing a request depends on lives only in this
    process: worker tokens missing from the cache are re-read from the store, and a waiting lease
    request re-reads the store every `work_recheck_s` besides waking on this process's own events.
    """

    def __init__(self, settings: ExchangeSettings, store: Store | None = None,
                 leadership: Leadership | None = None):
        self.settings = settings
        self.store = store or open_store(settings.db, settings)
        self.leadership = leadership or leadership_for(settings.db, retry_s=settings.leader_retry_s)
        self.metrics = ExchangeMetrics()
        self._token_hashes: dict[str, str] = {}
        self._token_reloads = 0
        self._token_lock = asyncio.Lock()
        self._work = asyncio.Event()
        self._reaper: asyncio.Task | None = None
        self.store.on_batch = self.metrics.write_batch.observe

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        self._work = asyncio.Event()
        self._token_lock = asyncio.Lock()
        await self.store.open(self.settings.public_dict(), time.time())
        self._token_hashes = await self.store.worker_token_hashes()
        await self.leadership.start()
        if self.leadership.is_leader:
            await self.reap()  # leases that expired while we were down are re-queued at once
        self._reaper = asyncio.create_task(self._reap_forever(), name="rollmarket-reaper")

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        await self.leadership.stop()
        await self.store.close()

    @property
    def is_leader(self) -> bool:
        """Whether this replica runs the singleton sweeps now."""
        return self.leadership.is_leader

    def _notify_work(self) -> None:
        self._work.set()
        self._work = asyncio.Event()

    async def reap(self) -> ReapResult:
        result = await self.store.reap(time.time())
        for _ in result.expired_leases:
            self.metrics.lease_endings.labels("expired").inc()
        for _ in result.abandoned_leases:
            self.metrics.lease_endings.labels("abandoned").inc()
        if result.changed:
            self._notify_work()
        return result

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.reaper_interval_s)
            if not self.leadership.is_leader:
                continue
            try:
                await self.reap()
            except Exception:  # the reaper must outlive one bad sweep
                log.exception("reaper sweep failed")

    # -- auth -----------------------------------------------------------------------------
    async def _worker_from_token(self, token: str | None) -> str | None:
        """The token's worker, re-reading the store's token hashes on a miss: the worker may
        have registered through another replica. Misses at the same moment share one re-read."""
        worker_id = auth.worker_from_token(token, self._token_hashes)
        if worker_id is not None or token is None or auth.split_worker_token(token) is None:
            return worker_id
        seen = self._token_reloads  # re-reads begun so far
        async with self._token_lock:
            # Only a re-read begun after this miss is sure to see a registration that preceded it.
            if self._token_reloads == seen:
                self._token_reloads += 1
                self._token_hashes = await self.store.worker_token_hashes()
        return auth.worker_from_token(token, self._token_hashes)

    async def worker_of(self, authorization: str | None) -> str:
        worker_id = await self._worker_from_token(auth.bearer(authorization))
        if worker_id is None:
            raise auth.unauthorized("a worker bearer token is required")
        return worker_id

    async def require_trainer(self, authorization: str | None) -> None:
        token = auth.bearer(authorization)
        if auth.is_trainer(token, self.settings.trainer_token):
            return
        if await self._worker_from_token(token) is not None:
            raise auth.forbidden("this endpoint is for trainers; a worker token cannot use it")
        raise auth.unauthorized("the trainer bearer token is required")

    def check_registration(self, authorization: str | None) -> None:
        required = self.settings.registration_token
        if required is None:
            return
        if not auth.is_trainer(auth.bearer(authorization), required):
            raise auth.unauthorized("registration requires the registration token")

    @staticmethod
    def _same_worker(worker_id: str, claimed: str, what: str) -> None:
        if claimed != worker_id:
            raise auth.forbidden(f"{what} names worker {claimed}, but the token is {worker_id}'s")

    # -- worker side ----------------------------------------------------------------------
    async def register(self, manifest: WorkerManifest) -> WorkerRegistration:
        if manifest.public_key is not None:
            try:
                load_public_key(manifest.public_key)
            except ValueError as exc:
                raise ExchangeFault(ErrorCode.invalid_request, str(exc)) from None
        token, token_hash = auth.new_worker_token(manifest.worker_id)
        await self.store.register_worker(manifest, token_hash, time.time())
        self._token_hashes[manifest.worker_id] = token_hash
        return WorkerRegistration(
            worker_id=manifest.worker_id, token=token, heartbeat_ttl_s=self.settings.heartbeat_ttl_s,
            lease_ttl_s=self.settings.lease_ttl_s, policy=await self.store.latest_policy(),
        )

    async def heartbeat(self, worker_id: str, beat: WorkerHeartbeat) -> HeartbeatReply:
        self._same_worker(worker_id, beat.worker_id, "the heartbeat")
        return await self.store.heartbeat(beat, time.time())

    async def lease(self, worker_id: str, wait_s: float = 0.0) -> LeaseGrant:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(max(wait_s, 0.0), self.settings.max_lease_wait_s)
        while True:
            work = self._work
            grant = await self.store.lease(worker_id, time.time())
            remaining = deadline - loop.time()
            if grant.lease is not None or grant.reason not in _WAIT_FOR_WORK or remaining <= 0:
                self.metrics.leases.labels("granted" if grant.lease or grant.reason is None
                                           else grant.reason.value).inc()
                return grant
            # Work another replica adds raises no event here: re-read the store at least this often.
            recheck = min(remaining, grant.retry_after_s or self.settings.work_recheck_s,
                          self.settings.work_recheck_s)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(work.wait(), timeout=recheck)

    async def submit(self, worker_id: str, group: SampleGroup, payload: bytes | None) -> SubmissionReceipt:
        self._same_worker(worker_id, group.worker_id, "the group")
        findings = check_group(group, self.settings.gate)
        outcome = await self.store.submit(group, payload if payload is not None else packb(group),
                                          findings, time.time())
        if outcome.rejected:
            reasons = reasons_of(outcome.rejected)
            self.metrics.submissions.labels("rejected").inc()
            for reason in reasons:
                self.metrics.rejections.labels(reason.value).inc()
            raise ExchangeFault(
                ErrorCode.rejected,
                "; ".join(f.message if f.sample_index is None else f"sample {f.sample_index}: {f.message}"
                          for f in outcome.rejected[:5]),
                reasons=[r.value for r in reasons],
                details={"findings": [f.as_dict() for f in outcome.rejected[:50]]},
            )
        receipt = outcome.receipt
        assert receipt is not None  # the store answers every group it did not reject with a receipt
        if receipt.duplicate:
            self.metrics.submissions.labels("duplicate").inc()
        else:
            self.metrics.submissions.labels("accepted").inc()
            self.metrics.tokens.inc(outcome.tokens)
            self.metrics.groups_stored.labels(receipt.tier.value).inc()
        return receipt

    async def renew(self, worker_id: str, lease_id: str) -> RolloutLease:
        return await self.store.renew_lease(worker_id, lease_id, time.time())

    async def fail(self, worker_id: str, lease_id: str, report: FailureReport) -> str:
        state = await self.store.fail_lease(worker_id, lease_id, report, time.time())
        self.metrics.lease_endings.labels("failed").inc()
        if state == "queued":
            self._notify_work()
        return state

    async def ack_reload(self, worker_id: str, ack: ReloadAck) -> ReloadStatus:
        self._same_worker(worker_id, ack.worker_id, "the reload ack")
        try:
            status = await self.store.ack_reload(ack, time.time())
        except ExchangeFault as fault:
            if fault.code is ErrorCode.digest_mismatch:
                self.metrics.reload_violations.inc()
            raise
        if status.active_version == status.published_version:
            self._notify_work()
        return status

    # -- trainer side ---------------------------------------------------------------------
    async def publish(self, manifest: PolicyManifest, quorum: int | None) -> PoolStatus:
        status = await self.store.publish_policy(manifest, quorum, time.time())
        self._notify_work()
        return status

    async def policies(self) -> list[PolicyManifest]:
        return await self.store.policies()

    async def enqueue(self, jobs: list[RolloutJob]) -> list[EnqueueReceipt]:
        receipts = await self.store.enqueue(jobs, time.time())
        if any(r.created for r in receipts):
            self._notify_work()
        return receipts

    async def fetch(self, query: FetchFilter) -> FetchBatch:
        return await self.store.fetch(query, time.time())

    async def group(self, group_id: str) -> StoredGroup:
        stored = await self.store.group(group_id)
        if stored is None:
            raise ExchangeFault(ErrorCode.not_found, f"unknown group {group_id}")
        return stored

    @staticmethod
    def _check_report(group_id: str, decision: GroupDecision | None, feedback: TrainerFeedback | None) -> None:
        if decision is None and feedback is None:
            raise ExchangeFault(ErrorCode.invalid_request, "a report needs a decision, feedback or both")
        for name, item in (("decision", decision), ("feedback", feedback)):
            if item is not None and item.group_id != group_id:
                raise ExchangeFault(ErrorCode.invalid_request,
                                    f"the {name} is for group {item.group_id}, not {group_id}")

    async def report(self, trainer_id: str, group_id: str, decision: GroupDecision | None,
                     feedback: TrainerFeedback | None) -> ReportReceipt:
        self._check_report(group_id, decision, feedback)
        receipt = await self.store.report(trainer_id, group_id, decision, feedback, time.time())
        if decision is not None:
            self.metrics.decisions.labels(decision.status.value).inc()
        return receipt

    async def report_many(self, reports: list[tuple[str, str, GroupDecision | None, TrainerFeedback | None]]
                          ) -> list[ReportReceipt]:
        """Several (trainer_id, group_id, decision, feedback) reports in one write: all or none."""
        for _, group_id, decision, feedback in reports:
            self._check_report(group_id, decision, feedback)
        receipts = await self.store.report_many(reports, time.time())
        for _, _, decision, _ in reports:
            if decision is not None:
                self.metrics.decisions.labels(decision.status.value).inc()
        return receipts

    async def pool(self) -> PoolStatus:
        return await self.store.pool_status(time.time())

    async def workers(self) -> list[WorkerSummary]:
        return await self.store.workers()

    async def market(self) -> MarketReport:
        return await self.store.market(time.time())

    async def audit(self, since_seq: int, kind: str | None, subject: str | None, limit: int) -> AuditPage:
        return await self.store.audit(since_seq, kind, subject, limit)

    async def render_metrics(self) -> bytes:
        counts = await self.store.counts()
        pool = counts.get("pool", {})
        active, published = pool.get("active", -1), pool.get("published", -1)
        return self.metrics.render(counts, None if active < 0 else active,
                                   None if published < 0 else published, leader=self.is_leader)
