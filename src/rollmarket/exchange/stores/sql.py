"""The exchange's state in SQL, shared by the SQLite and PostgreSQL backends.

`SqlStore` holds every transaction of the Store interface as plain SQL over a DB-API-like
connection (`execute(sql, params)` with `?` or `:name` parameters, rows readable by index and by
name) and calls the market rules (`exchange/rules.py`) for every decision. A backend supplies the
plumbing (`_write` runs a function as one committed transaction, `_read` on a reading connection)
and the few fragments where the dialects differ. Rows another process may change at the same
time are read with `_LOCK` (``FOR UPDATE`` on PostgreSQL; SQLite has a single writer).
"""

from __future__ import annotations

import json
from abc import abstractmethod
import logging
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any, TypeVar

from ...contracts import (
    AuditEvent,
    AuditPage,
    EnqueueReceipt,
    ErrorCode,
    FailureReport,
    GroupDecision,
    HeartbeatReply,
    JobView,
    LeaseGrant,
    LeaseState,
    MarketReport,
    NoLeaseReason,
    PolicyManifest,
    PoolStatus,
    RejectionReason,
    ReloadAck,
    ReloadStatus,
    ReportReceipt,
    RolloutJob,
    RolloutLease,
    SampleGroup,
    SubmissionReceipt,
    Tier,
    TrainerFeedback,
    WorkerHeartbeat,
    WorkerManifest,
    WorkerSummary,
    new_id,
)
from ...gate import Finding, check_against_lease, load_public_key, triage_on_arrival
from .. import rules
from ..dispatch import job_mismatch, lease_requirements, policy_mismatch
from ..errors import ExchangeFault
from ..market import SQLITE, market_report
from ..settings import ExchangeSettings
from ..store import FetchBatch, FetchFilter, ReapResult, StoredGroup, Store, SubmitOutcome

log = logging.getLogger(__name__)
T = TypeVar("T")


def _ts(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, timezone.utc)


def dumps(value: Any) -> str:
    """Canonical compact JSON, as stored in audit data and settings."""
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


class Refusal(Exception):
    """Raised by an operation to refuse a request yet keep what it wrote (an audit record)."""

    def __init__(self, fault: ExchangeFault):
        super().__init__(fault.message)
        self.fault = fault


UNKNOWN_LEASE = "no lease with this id was issued to this worker"
"""The one answer to a lease id that does not exist and to one held by another worker."""


def _fault(code: ErrorCode, message: str, **details: Any) -> ExchangeFault:
    return ExchangeFault(code, message, details=details)



class SqlStore(Store):
    """Every Store transaction over a SQL connection; backends add plumbing and dialect."""

    _LOCK = ""
    """Appended to a SELECT of rows this transaction goes on to change."""
    _SKIP_LOCKED = ""
    """Appended to the SELECT that picks a job to lease: rows other transactions hold are skipped."""
    _SKIP_LOCKED_GROUPS = ""
    """Appended to the SELECT of groups a fetch serves (alias g): two fetches never share one."""
    _ARRIVAL = "rowid"
    """The column that orders jobs enqueued in the same instant."""

    _MARKET = SQLITE
    """The market report's SQL fragments."""

    @staticmethod
    def _in_json_array(value: str, array: str) -> str:
        """SQL that is true when `value` is an element of the JSON text array `array`."""
        return f"{value} IN (SELECT value FROM json_each({array}))"

    @staticmethod
    def _json_field(column: str, field: str) -> str:
        """SQL for the JSON value of `field` in the JSON text column `column` (NULL when absent)."""
        return f"json_extract({column}, '$.{field}')"

    @staticmethod
    def _json_array_empty(array: str) -> str:
        """SQL that is true when the JSON array `array` is empty or NULL."""
        return f"COALESCE(json_array_length({array}), 0) = 0"

    def __init__(self, settings: ExchangeSettings):
        self.settings = settings
        self._started_at = 0.0
        # Parsed manifests never change once written, so each is parsed once per process.
        self._manifests: dict[str, WorkerManifest] = {}
        self._policies: dict[int, PolicyManifest] = {}
        self._public_keys: dict[str, Any] = {}

    @abstractmethod
    async def _write(self, fn: Callable[[Any], T]) -> T:
        """Run `fn(conn)` as one transaction, committed before this returns. A `Refusal` it raises
        keeps what `fn` wrote and is raised as its fault after the commit."""

    @abstractmethod
    async def _read(self, fn: Callable[[Any], T]) -> T:
        """Run `fn(conn)` on a connection that only reads."""
    # -- helpers used inside transactions ---------------------------------------------------
    @staticmethod
    def _audit(conn: Any, now: float, kind: str, actor: str, subject: str,
               data: dict[str, Any]) -> None:
        conn.execute(
            "INSERT INTO audit (at, kind, actor, subject, data) VALUES (?, ?, ?, ?, ?)",
            (now, kind, actor, subject, dumps(data)),
        )

    def _manifest(self, conn: Any, worker_id: str) -> WorkerManifest:
        manifest = self._manifests.get(worker_id)
        if manifest is None:
            row = conn.execute("SELECT manifest FROM workers WHERE worker_id=?", (worker_id,)).fetchone()
            if row is None:
                raise _fault(ErrorCode.not_found, f"unknown worker {worker_id}")
            manifest = WorkerManifest.model_validate_json(row[0])
            self._manifests[worker_id] = manifest
        return manifest

    def _public_key(self, manifest: WorkerManifest):
        if manifest.public_key is None:
            return None
        key = self._public_keys.get(manifest.worker_id)
        if key is None:
            key = self._public_keys[manifest.worker_id] = load_public_key(manifest.public_key)
        return key

    def _policy(self, conn: Any, version: int | None) -> PolicyManifest | None:
        if version is None:
            return None
        policy = self._policies.get(version)
        if policy is None:
            row = conn.execute("SELECT manifest FROM policies WHERE version=?", (version,)).fetchone()
            if row is None:
                return None
            policy = self._policies[version] = PolicyManifest.model_validate_json(row[0])
        return policy

    def _pool(self, conn: Any, *, lock: bool = False) -> tuple[int | None, int | None]:
        row = conn.execute("SELECT active_version, published_version FROM pool WHERE id=1"
                           + (self._LOCK if lock else "")).fetchone()
        return row[0], row[1]

    def _quorum(self, conn: Any, version: int) -> tuple[int, int]:
        """(acks needed, acks present) for `version` among live workers."""
        override = conn.execute("SELECT quorum FROM policies WHERE version=?", (version,)).fetchone()
        alive = conn.execute("SELECT COUNT(*) FROM workers WHERE status='alive'").fetchone()[0]
        needed = rules.quorum_needed(alive, None if override is None else override[0],
                                     self.settings.reload_quorum_fraction, self.settings.reload_quorum_min)
        acks = conn.execute(
            "SELECT COUNT(*) FROM workers WHERE status='alive' AND loaded_version=?", (version,)
        ).fetchone()[0]
        return needed, acks

    def _maybe_activate(self, conn: Any, now: float) -> int | None:
        active, published = self._pool(conn, lock=True)
        if published is None or published == active:
            return None
        needed, acks = self._quorum(conn, published)
        if not rules.activates(active, published, needed, acks):
            return None
        conn.execute("UPDATE pool SET active_version=? WHERE id=1", (published,))
        conn.execute("UPDATE policies SET activated_at=? WHERE version=?", (now, published))
        self._audit(conn, now, "policy.activated", "exchange", f"policy:{published}",
                    {"version": published, "previous": active, "acks": acks, "quorum": needed})
        return published

    def _end_lease(self, conn: Any, now: float, lease_id: str, job_id: str,
                   worker_id: str, state: LeaseState, *, retry: bool, actor: str,
                   result: ReapResult | None = None, detail: dict | None = None) -> str:
        """Close an issued lease and re-queue (or fail) its job. Returns the job's new state."""
        conn.execute("UPDATE leases SET state=?, ended_at=? WHERE lease_id=?", (state.value, now, lease_id))
        conn.execute("UPDATE workers SET active_leases = CASE WHEN active_leases > 0 THEN active_leases - 1 ELSE 0 END WHERE worker_id=?",
                     (worker_id,))
        self._audit(conn, now, f"lease.{state.value}", actor, lease_id,
                    {"job_id": job_id, "worker_id": worker_id, **(detail or {})})
        job = conn.execute("SELECT attempts, deadline FROM jobs WHERE job_id=?", (job_id,)).fetchone()
        new_state = rules.end_of_lease(retry, job["attempts"], self.settings.max_attempts, job["deadline"], now)
        if new_state == "queued":
            conn.execute("UPDATE jobs SET state='queued', queued_at=? WHERE job_id=?", (now, job_id))
            self._audit(conn, now, "job.requeued", actor, job_id,
                        {"after": state.value, "lease_id": lease_id, "attempts": job["attempts"]})
            if result is not None:
                result.requeued_jobs.append(job_id)
            return "queued"
        conn.execute("UPDATE jobs SET state=? WHERE job_id=?", (new_state, job_id))
        self._audit(conn, now, f"job.{new_state}", actor, job_id,
                    {"after": state.value, "lease_id": lease_id, "attempts": job["attempts"]})
        if result is not None:
            result.failed_jobs.append(job_id)
        return new_state

    def _fingerprint_feedback(self, conn: Any, fingerprint: str, score: float, *, rejected: bool) -> float:
        """Fold one score into an engine fingerprint's quality; its new quality. The row is made
        first and then locked, so concurrent first scores cannot overwrite each other."""
        conn.execute("INSERT INTO fingerprints (fingerprint, quality) VALUES (?, ?)"
                     " ON CONFLICT (fingerprint) DO NOTHING", (fingerprint, rules.NEUTRAL_QUALITY))
        current = conn.execute("SELECT quality FROM fingerprints WHERE fingerprint=?" + self._LOCK,
                               (fingerprint,)).fetchone()[0]
        quality = rules.updated_quality(current, score, self.settings.feedback_alpha)
        counter = "rejected_count" if rejected else "feedback_count"
        conn.execute(f"UPDATE fingerprints SET quality=?, {counter}={counter}+1 WHERE fingerprint=?",
                     (quality, fingerprint))
        return quality

    def _record_rejection(self, conn: Any, now: float, group: SampleGroup,
                          findings: list[Finding]) -> None:
        """A rejection stores nothing of the group, but it counts against the worker's quality and
        its engine fingerprint's (as a feedback score of 0) so that dispatch stops preferring it.
        The fingerprint is the one the exchange knows for the worker, never the submission's claim."""
        reasons = list(dict.fromkeys(f.reason.value for f in findings))
        worker = conn.execute("SELECT quality, loaded_fingerprint FROM workers WHERE worker_id=?" + self._LOCK,
                              (group.worker_id,)).fetchone()
        data: dict[str, Any] = {"group_id": group.group_id, "reasons": reasons}
        if worker is not None:
            conn.execute(
                "UPDATE workers SET quality=?, rejected_count=rejected_count+1 WHERE worker_id=?",
                (rules.updated_quality(worker["quality"], rules.REJECTED_SCORE, self.settings.feedback_alpha),
                 group.worker_id),
            )
            fingerprint = worker["loaded_fingerprint"] or self._manifest(conn, group.worker_id).engine_fingerprint
            self._fingerprint_feedback(conn, fingerprint, rules.REJECTED_SCORE, rejected=True)
            data["fingerprint"] = fingerprint
        self._audit(conn, now, "submission.rejected", group.worker_id, group.lease_id, data)

    def _touch_worker(self, conn: Any, worker_id: str, now: float) -> Any:
        row = conn.execute("SELECT * FROM workers WHERE worker_id=?" + self._LOCK, (worker_id,)).fetchone()
        if row is None:
            raise _fault(ErrorCode.not_found, f"unknown worker {worker_id}")
        conn.execute("UPDATE workers SET last_heartbeat_at=?, status='alive' WHERE worker_id=?",
                     (now, worker_id))
        if row["status"] != "alive":
            self._audit(conn, now, "worker.revived", worker_id, worker_id, {"was": row["status"]})
        return row

    # -- workers --------------------------------------------------------------------------
    async def register_worker(self, manifest: WorkerManifest, token_hash: str, now: float) -> None:
        def tx(conn: Any) -> None:
            if conn.execute("SELECT 1 FROM workers WHERE worker_id=?", (manifest.worker_id,)).fetchone():
                raise _fault(ErrorCode.worker_exists, f"worker {manifest.worker_id} is already registered")
            conn.execute(
                "INSERT INTO workers (worker_id, manifest, token_hash, status, registered_at,"
                " last_heartbeat_at, quality, price) VALUES (?, ?, ?, 'alive', ?, ?, 0.5, ?)",
                (manifest.worker_id, manifest.model_dump_json(), token_hash, now, now, manifest.price_hint),
            )
            self._audit(conn, now, "worker.registered", manifest.worker_id, manifest.worker_id, {
                "engine": manifest.engine_name, "fingerprint": manifest.engine_fingerprint,
                "precision_classes": manifest.precision_classes, "price_hint": manifest.price_hint,
            })

        await self._write(tx)

    async def worker_token_hashes(self) -> dict[str, str]:
        return await self._read(lambda conn: {
            row[0]: row[1] for row in conn.execute("SELECT worker_id, token_hash FROM workers")
        })

    async def latest_policy(self) -> PolicyManifest | None:
        def read(conn: Any) -> PolicyManifest | None:
            return self._policy(conn, self._pool(conn)[1])

        return await self._read(read)

    async def heartbeat(self, beat: WorkerHeartbeat, now: float) -> HeartbeatReply:
        def tx(conn: Any) -> HeartbeatReply:
            row = self._touch_worker(conn, beat.worker_id, now)
            active, published = self._pool(conn)
            cancelled = []
            for lease_id in beat.active_lease_ids:
                lease = conn.execute("SELECT worker_id, state FROM leases WHERE lease_id=?",
                                     (lease_id,)).fetchone()
                if lease is None or lease["worker_id"] != beat.worker_id or lease["state"] != "issued":
                    cancelled.append(lease_id)
            return HeartbeatReply(
                worker_id=beat.worker_id,
                status="alive",
                active_version=active,
                policy=self._policy(conn, published),
                reload_required=published is not None and row["loaded_version"] != published,
                cancelled_lease_ids=cancelled,
            )

        return await self._write(tx)

    def _competitors(self, conn: Any, policy: PolicyManifest) -> dict[str, float]:
        """Scores of live workers aligned with `policy` that have spare capacity."""
        rows = conn.execute(
            "SELECT worker_id, quality, price, active_leases FROM workers"
            " WHERE status='alive' AND loaded_version=? AND loaded_digest=?",
            (policy.policy_version, policy.checkpoint_digest),
        ).fetchall()
        candidates = []
        for row in rows:
            manifest = self._manifest(conn, row["worker_id"])
            if row["active_leases"] < manifest.max_concurrent_groups and policy_mismatch(manifest, policy) is None:
                candidates.append((row["worker_id"], row["quality"], row["price"]))
        return rules.competitor_scores(candidates, self.settings.price_weight)

    @property
    def _job_match(self) -> str:
        """FROM and WHERE of the queued jobs a worker can run (parameters from `lease`)."""
        excluded = self._json_field("jobs.body", "excluded_fingerprints")
        required = self._json_field("jobs.body", "required_fingerprints")
        return (
            " FROM jobs WHERE state='queued' AND policy_version <= :active"
            " AND (deadline IS NULL OR deadline > :now)"
            " AND (CASE WHEN req_precision IS NULL THEN :policy_precision_ok = 1"
            f"      ELSE {self._in_json_array('req_precision', ':precisions')} END)"
            " AND (CASE WHEN req_quantization IS NULL THEN :policy_quantization_ok = 1"
            f"      ELSE {self._in_json_array('req_quantization', ':quantizations')} END)"
            " AND max_context <= :context AND (needs_experts = 0 OR :experts = 1)"
            f" AND (engines IS NULL OR {self._in_json_array(':engine', 'jobs.engines')})"
            # A job's fingerprint rules (dispatch.job_mismatch), read from its body: no column to migrate.
            # The LIKE is a cheap pre-filter (a JSON key with a non-empty list; quotes inside JSON
            # strings are escaped, so no text matches it by accident, and one that did would only be
            # checked exactly): parsing every queued job's body made a lease 100 ms on PostgreSQL.
            " AND (jobs.body NOT LIKE :fingerprint_rules"
            f"      OR (NOT {self._in_json_array(':fingerprint', excluded)}"
            f"          AND ({self._json_array_empty(required)} OR {self._in_json_array(':fingerprint', required)})))"
        )

    async def lease(self, worker_id: str, now: float) -> LeaseGrant:
        def tx(conn: Any) -> LeaseGrant:
            row = self._touch_worker(conn, worker_id, now)
            manifest = self._manifest(conn, worker_id)
            active, published = self._pool(conn)
            latest = self._policy(conn, published)
            if latest is None or published is None:
                return LeaseGrant(reason=NoLeaseReason.no_policy, retry_after_s=1.0,
                                  detail="no policy has been published yet")
            chosen = rules.lease_version(row["loaded_version"], active, published, manifest.max_reload_lag)
            if chosen.refusal is NoLeaseReason.reload_required:
                return LeaseGrant(reason=NoLeaseReason.reload_required, policy=latest, retry_after_s=0.5,
                                  detail=f"load policy version {published} and ack it before leasing")
            if chosen.refusal is NoLeaseReason.awaiting_quorum:
                needed, acks = self._quorum(conn, published)
                return LeaseGrant(reason=NoLeaseReason.awaiting_quorum, policy=latest, retry_after_s=0.2,
                                  detail=f"version {published} has {acks}/{needed} reload acks")
            policy = self._policy(conn, chosen.version)
            if policy is None:  # no refusal leaves a version that was never published; say so if one does
                return LeaseGrant(reason=NoLeaseReason.no_policy, retry_after_s=1.0,
                                  detail=f"policy version {chosen.version} is not held")
            mismatch = policy_mismatch(manifest, policy)
            if mismatch:
                return LeaseGrant(reason=NoLeaseReason.no_matching_jobs, detail=mismatch, retry_after_s=5.0)
            if row["active_leases"] >= manifest.max_concurrent_groups:
                return LeaseGrant(reason=NoLeaseReason.at_capacity, retry_after_s=1.0,
                                  detail=f"{row['active_leases']} leases held")
            params = {
                "active": active, "now": now,
                "policy_precision_ok": int(policy.precision_class in manifest.precision_classes),
                "precisions": json.dumps(manifest.precision_classes),
                "policy_quantization_ok": int(policy.quantization_class in manifest.quantization_classes),
                "quantizations": json.dumps(manifest.quantization_classes),
                "context": manifest.max_context_tokens,
                "experts": int(manifest.returns_routed_experts),
                "engine": manifest.engine_name,
                "fingerprint": row["loaded_fingerprint"] or manifest.engine_fingerprint,
                "fingerprint_rules": '%_fingerprints":["%',
            }
            order = f" ORDER BY priority DESC, queued_at, {self._ARRIVAL} LIMIT 1" + self._SKIP_LOCKED
            better_ids = rules.better_ranked(self._competitors(conn, policy), worker_id)
            available = 0
            if better_ids:
                available = conn.execute(
                    "SELECT COUNT(*) FROM (SELECT 1" + self._job_match + " LIMIT :cap) AS matching",
                    {**params, "cap": len(better_ids) + 1},
                ).fetchone()[0]
                if available <= len(better_ids):
                    # Jobs are scarce. Only better-ranked workers that can run one of them count:
                    # a job only this worker can run is never held back for anyone.
                    mine = [RolloutJob.model_validate_json(r[0]) for r in conn.execute(
                        "SELECT body" + self._job_match + f" ORDER BY priority DESC, queued_at, {self._ARRIVAL} LIMIT :cap",
                        {**params, "cap": available})]
                    better_ids = [w for w in better_ids
                                  if any(job_mismatch(self._manifest(conn, w), j, policy) is None for j in mine)]
            better = len(better_ids)
            if not rules.must_hold(better, available):
                job = conn.execute("SELECT job_id, body" + self._job_match + order, params).fetchone()
            else:
                # Leave the matching jobs to the better-ranked workers free to take them until a
                # job has waited preference_hold_s; then anyone may take it.
                job = conn.execute(
                    "SELECT job_id, body" + self._job_match + " AND queued_at <= :cutoff" + order,
                    {**params, "cutoff": now - self.settings.preference_hold_s},
                ).fetchone()
                if job is None and available:
                    return LeaseGrant(
                        reason=NoLeaseReason.deferred, retry_after_s=0.5,
                        detail=f"{better} better-ranked worker(s) are free for the {available} matching job(s)",
                    )
            if job is None:
                any_queued = conn.execute("SELECT 1 FROM jobs WHERE state='queued' LIMIT 1").fetchone()
                if any_queued is None:
                    return LeaseGrant(reason=NoLeaseReason.queue_empty, retry_after_s=1.0)
                return LeaseGrant(reason=NoLeaseReason.no_matching_jobs, retry_after_s=2.0,
                                  detail="queued jobs need a precision, quantization, context, engine "
                                         "or policy version this worker does not offer")
            rollout_job = RolloutJob.model_validate_json(job["body"])
            lease = RolloutLease(
                lease_id=new_id("lease"),
                job_id=rollout_job.job_id,
                worker_id=worker_id,
                policy_version=policy.policy_version,
                requirements=lease_requirements(rollout_job, policy),
                issued_at=_ts(now),
                expires_at=_ts(now + self.settings.lease_ttl_s),
            )
            conn.execute(
                "INSERT INTO leases (lease_id, job_id, worker_id, policy_version, body, issued_at,"
                " expires_at, state) VALUES (?, ?, ?, ?, ?, ?, ?, 'issued')",
                (lease.lease_id, lease.job_id, worker_id, lease.policy_version,
                 lease.model_dump_json(), now, now + self.settings.lease_ttl_s),
            )
            conn.execute("UPDATE jobs SET state='leased', attempts=attempts+1 WHERE job_id=?", (lease.job_id,))
            conn.execute("UPDATE workers SET active_leases=active_leases+1 WHERE worker_id=?", (worker_id,))
            self._audit(conn, now, "lease.issued", worker_id, lease.lease_id,
                        {"job_id": lease.job_id, "worker_id": worker_id, "policy_version": lease.policy_version,
                         "expires_at": now + self.settings.lease_ttl_s})
            return LeaseGrant(lease=lease, job=rollout_job, policy=policy)

        return await self._write(tx)

    async def submit(self, group: SampleGroup, payload: bytes, findings: list[Finding],
                     now: float) -> SubmitOutcome:
        def tx(conn: Any) -> SubmitOutcome:
            # Ownership first, idempotency second: another worker's lease answers exactly as a
            # lease never issued, and its stored group (receipt, hash) is never looked at.
            lease_row = conn.execute("SELECT worker_id, body, state FROM leases WHERE lease_id=?" + self._LOCK,
                                     (group.lease_id,)).fetchone()
            if lease_row is None or lease_row["worker_id"] != group.worker_id:
                unknown = list(findings) + [Finding(RejectionReason.unknown_lease, UNKNOWN_LEASE)]
                self._record_rejection(conn, now, group, unknown)
                return SubmitOutcome(receipt=None, rejected=unknown)
            stored = conn.execute(
                "SELECT group_id, lease_id, content_hash, receipt FROM groups WHERE lease_id=? OR group_id=?",
                (group.lease_id, group.group_id),
            ).fetchall()
            for row in stored:
                if row["lease_id"] != group.lease_id:
                    # The group id is taken under some other lease, perhaps another worker's:
                    # say only that, and nothing about that group.
                    raise _fault(ErrorCode.idempotency_conflict,
                                 "this group_id is already taken by another submission; use a new group id")
                if row["group_id"] == group.group_id and row["content_hash"] == group.content_hash:
                    receipt = SubmissionReceipt.model_validate_json(row["receipt"])
                    return SubmitOutcome(receipt=receipt.model_copy(update={"duplicate": True}), rejected=[])
                raise ExchangeFault(  # this worker's own lease and group: naming them leaks nothing
                    ErrorCode.idempotency_conflict,
                    f"lease {row['lease_id']} already delivered group {row['group_id']} with other content",
                    details={"stored_group_id": row["group_id"], "stored_content_hash": row["content_hash"]},
                )
            lease = RolloutLease.model_validate_json(lease_row["body"])
            lease = lease.model_copy(update={"state": LeaseState(lease_row["state"])})
            manifest = self._manifest(conn, group.worker_id)
            ack = conn.execute("SELECT fingerprint FROM reload_acks WHERE worker_id=? AND policy_version=?",
                               (group.worker_id, lease.policy_version)).fetchone()
            all_findings = list(findings) + check_against_lease(
                group, lease, now=_ts(now), acked_fingerprint=None if ack is None else ack[0],
                public_key=self._public_key(manifest), manifest=manifest,
            )
            if all_findings:
                self._record_rejection(conn, now, group, all_findings)
                return SubmitOutcome(receipt=None, rejected=all_findings)
            active, _ = self._pool(conn)
            lag = rules.arrival_lag(active, group.policy_version)
            tier, reasons = triage_on_arrival(lag, self.settings.gate)
            tokens = group.num_response_tokens
            receipt = SubmissionReceipt(
                group_id=group.group_id, lease_id=group.lease_id, content_hash=group.content_hash,
                tier=tier, policy_lag_steps=lag, reasons=reasons, received_at=_ts(now),
            )
            conn.execute(
                "INSERT INTO groups (group_id, lease_id, job_id, worker_id, task_id, policy_version,"
                " precision_class, engine_fingerprint, content_hash, n_tokens, tier, status,"
                " lag_at_arrival, receipt, received_at, payload)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'available', ?, ?, ?, ?)",
                (group.group_id, group.lease_id, group.job_id, group.worker_id, group.task_id,
                 group.policy_version, group.precision_class, group.engine_fingerprint,
                 group.content_hash, tokens, tier.value, lag, receipt.model_dump_json(), now, payload),
            )
            conn.execute("UPDATE leases SET state='submitted', ended_at=? WHERE lease_id=?", (now, group.lease_id))
            conn.execute("UPDATE jobs SET state='done', group_id=? WHERE job_id=?", (group.group_id, group.job_id))
            conn.execute("UPDATE workers SET active_leases=CASE WHEN active_leases > 0 THEN active_leases - 1 ELSE 0 END WHERE worker_id=?",
                         (group.worker_id,))
            self._audit(conn, now, "group.accepted", group.worker_id, group.group_id, {
                "lease_id": group.lease_id, "job_id": group.job_id, "tier": tier.value, "lag": lag,
                "tokens": tokens, "content_hash": group.content_hash,
                "reasons": [r.value for r in reasons],
            })
            return SubmitOutcome(receipt=receipt, rejected=[], tokens=tokens)

        return await self._write(tx)

    def _issued_lease(self, conn: Any, worker_id: str, lease_id: str) -> Any:
        """The lease row, if it exists, is `worker_id`'s and still issued; else the typed fault.
        Another worker's lease is answered exactly as one that does not exist."""
        row = conn.execute("SELECT job_id, worker_id, state, expires_at, body FROM leases WHERE lease_id=?"
                           + self._LOCK, (lease_id,)).fetchone()
        if row is None or row["worker_id"] != worker_id:
            raise ExchangeFault(ErrorCode.not_found, UNKNOWN_LEASE)
        if row["state"] != "issued":
            raise ExchangeFault(ErrorCode.lease_not_active, f"lease {lease_id} is {row['state']}",
                                details={"state": row["state"]})
        return row

    async def renew_lease(self, worker_id: str, lease_id: str, now: float) -> RolloutLease:
        def tx(conn: Any) -> RolloutLease:
            row = self._issued_lease(conn, worker_id, lease_id)
            if row["expires_at"] <= now:  # expired, though the reaper has not swept it yet
                raise ExchangeFault(ErrorCode.lease_not_active, f"lease {lease_id} is expired",
                                    details={"state": "expired"})
            self._touch_worker(conn, worker_id, now)
            expires = now + self.settings.lease_ttl_s
            lease = RolloutLease.model_validate_json(row["body"]).model_copy(update={"expires_at": _ts(expires)})
            conn.execute("UPDATE leases SET expires_at=?, body=? WHERE lease_id=?",
                         (expires, lease.model_dump_json(), lease_id))
            self._audit(conn, now, "lease.renewed", worker_id, lease_id, {"expires_at": expires})
            return lease

        return await self._write(tx)

    async def fail_lease(self, worker_id: str, lease_id: str, report: FailureReport, now: float) -> str:
        def tx(conn: Any) -> str:
            row = self._issued_lease(conn, worker_id, lease_id)
            self._touch_worker(conn, worker_id, now)
            return self._end_lease(conn, now, lease_id, row["job_id"], worker_id, LeaseState.failed,
                                   retry=report.retryable, actor=worker_id,
                                   detail={"kind": report.kind.value, "message": report.message[:500]})

        return await self._write(tx)

    async def ack_reload(self, ack: ReloadAck, now: float) -> ReloadStatus:
        def tx(conn: Any) -> ReloadStatus:
            policy = self._policy(conn, ack.policy_version)
            if policy is None:
                raise _fault(ErrorCode.not_found, f"policy version {ack.policy_version} was never published")
            if ack.checkpoint_digest != policy.checkpoint_digest:
                # Other workers' conflicting acks go to the audit log, never into the answer.
                others = [dict(r) for r in conn.execute(
                    "SELECT worker_id, digest FROM reload_acks WHERE policy_version=? AND digest != ?",
                    (ack.policy_version, ack.checkpoint_digest))]
                self._audit(conn, now, "reload.violation", ack.worker_id, f"policy:{ack.policy_version}", {
                    "worker_id": ack.worker_id, "acked_digest": ack.checkpoint_digest,
                    "published_digest": policy.checkpoint_digest, "other_acks": others,
                })
                # The violation is recorded even though the ack itself is refused.
                raise Refusal(ExchangeFault(
                    ErrorCode.digest_mismatch,
                    f"worker {ack.worker_id} acked version {ack.policy_version} with digest "
                    f"{ack.checkpoint_digest[:12]}…, the published digest is {policy.checkpoint_digest[:12]}…",
                    details={"published_digest": policy.checkpoint_digest,
                             "acked_digest": ack.checkpoint_digest},
                ))
            # Touched only once the ack is accepted: a refused ack keeps nothing but its violation.
            self._touch_worker(conn, ack.worker_id, now)
            conn.execute(
                "INSERT INTO reload_acks (worker_id, policy_version, digest, fingerprint, acked_at)"
                " VALUES (?, ?, ?, ?, ?) ON CONFLICT (worker_id, policy_version) DO UPDATE SET"
                " digest=excluded.digest, fingerprint=excluded.fingerprint, acked_at=excluded.acked_at",
                (ack.worker_id, ack.policy_version, ack.checkpoint_digest, ack.engine_fingerprint, now),
            )
            conn.execute(
                "UPDATE workers SET loaded_version=?, loaded_digest=?, loaded_fingerprint=? WHERE worker_id=?",
                (ack.policy_version, ack.checkpoint_digest, ack.engine_fingerprint, ack.worker_id),
            )
            self._audit(conn, now, "reload.acked", ack.worker_id, f"policy:{ack.policy_version}", {
                "worker_id": ack.worker_id, "fingerprint": ack.engine_fingerprint,
                "load_seconds": ack.load_seconds,
            })
            self._maybe_activate(conn, now)
            active, published = self._pool(conn)
            needed, acks = self._quorum(conn, published) if published is not None else (0, 0)
            return ReloadStatus(
                worker_id=ack.worker_id, policy_version=ack.policy_version,
                aligned=active == ack.policy_version, active_version=active,
                published_version=published, acks=acks, quorum=needed,
            )

        return await self._write(tx)

    # -- trainer --------------------------------------------------------------------------
    async def publish_policy(self, manifest: PolicyManifest, quorum: int | None, now: float) -> PoolStatus:
        def tx(conn: Any) -> None:
            _, published = self._pool(conn, lock=True)
            refusal = rules.publish_refusal(manifest, self._policy(conn, manifest.policy_version), published)
            if refusal == "":
                return
            if refusal is not None:
                raise _fault(ErrorCode.version_conflict, refusal, published_version=published)
            if manifest.parent_version is not None and manifest.parent_version >= manifest.policy_version:
                raise _fault(ErrorCode.invalid_request, "parent_version must be older than policy_version")
            conn.execute(
                "INSERT INTO policies (version, digest, manifest, quorum, published_at) VALUES (?, ?, ?, ?, ?)",
                (manifest.policy_version, manifest.checkpoint_digest, manifest.model_dump_json(), quorum, now),
            )
            conn.execute("UPDATE pool SET published_version=? WHERE id=1", (manifest.policy_version,))
            self._audit(conn, now, "policy.published", "trainer", f"policy:{manifest.policy_version}", {
                "version": manifest.policy_version, "parent": manifest.parent_version,
                "digest": manifest.checkpoint_digest, "quorum": quorum,
            })
            self._maybe_activate(conn, now)

        await self._write(tx)
        return await self.pool_status(now)

    async def policies(self) -> list[PolicyManifest]:
        return await self._read(lambda conn: [
            PolicyManifest.model_validate_json(row[0])
            for row in conn.execute("SELECT manifest FROM policies ORDER BY version")
        ])

    async def enqueue(self, jobs: list[RolloutJob], now: float) -> list[EnqueueReceipt]:
        def tx(conn: Any) -> list[EnqueueReceipt]:
            receipts = []
            for job in jobs:
                digest = job.digest()
                row = conn.execute(
                    "SELECT job_id, idempotency_key, digest FROM jobs WHERE idempotency_key=? OR job_id=?",
                    (job.idempotency_key, job.job_id),
                ).fetchone()
                if row is not None:
                    if row["digest"] == digest:
                        receipts.append(EnqueueReceipt(job_id=row["job_id"], created=False))
                        continue
                    raise ExchangeFault(
                        ErrorCode.idempotency_conflict,
                        f"job {row['job_id']} (key {row['idempotency_key']!r}) exists with other content",
                        details={"job_id": row["job_id"], "idempotency_key": row["idempotency_key"]},
                    )
                conn.execute(
                    "INSERT INTO jobs (job_id, idempotency_key, digest, body, policy_version, priority,"
                    " req_precision, req_quantization, max_context, needs_experts, engines, deadline,"
                    " state, enqueued_at, queued_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'queued', ?, ?)",
                    (job.job_id, job.idempotency_key, digest, job.model_dump_json(), job.policy_version,
                     job.priority, job.required_precision, job.required_quantization,
                     job.max_context_tokens, int(job.requires_routed_experts),
                     json.dumps(job.allowed_engines) if job.allowed_engines else None,
                     job.deadline.timestamp() if job.deadline else None, now, now),
                )
                self._audit(conn, now, "job.enqueued", "trainer", job.job_id, {
                    "task_id": job.task.task_id, "policy_version": job.policy_version,
                    "group_size": job.group_size,
                })
                receipts.append(EnqueueReceipt(job_id=job.job_id, created=True))
            return receipts

        return await self._write(tx)

    async def jobs(self, state: str | None, limit: int) -> list[JobView]:
        def read(conn: Any) -> list[JobView]:
            sql = "SELECT body, state, attempts, queued_at, group_id FROM jobs"
            args: tuple = ()
            if state:
                sql += " WHERE state=?"
                args = (state,)
            sql += f" ORDER BY enqueued_at, {self._ARRIVAL} LIMIT ?"
            return [
                JobView(job=RolloutJob.model_validate_json(r["body"]), state=r["state"],
                        attempts=r["attempts"], queued_at=_ts(r["queued_at"]), group_id=r["group_id"])
                for r in conn.execute(sql, args + (limit,))
            ]

        return await self._read(read)

    _STORED_COLUMNS = ("g.group_id, g.tier, g.status, g.received_at, g.policy_version,"
                       " g.lag_at_arrival, g.payload")

    async def fetch(self, query: FetchFilter, now: float) -> FetchBatch:
        def tx(conn: Any) -> FetchBatch:
            active, _ = self._pool(conn)
            where = ["g.tier = :tier", "g.status = 'available'"]
            params: dict[str, Any] = {"tier": query.tier.value, "trainer": query.trainer_id}
            if query.policy_version is not None:
                where.append("g.policy_version = :version")
                params["version"] = query.policy_version
            window = rules.fetch_window(active, query.max_staleness, query.include_served, now,
                                        self.settings.redeliver_after_s)
            if window.oldest_version is not None:
                where.append("g.policy_version >= :oldest")
                params["oldest"] = window.oldest_version
            if query.precision_class is not None:
                where.append("g.precision_class = :precision")
                params["precision"] = query.precision_class
            if window.redeliver_before is not None:
                where.append("(s.group_id IS NULL OR s.last_at <= :redeliver)")
                params["redeliver"] = window.redeliver_before
            # Served-ness is per tier: a group a decision moved to replay can be served from there.
            base = (" FROM groups g LEFT JOIN served s ON s.group_id = g.group_id"
                    " AND s.trainer_id = :trainer AND s.tier = g.tier"
                    " WHERE " + " AND ".join(where))
            order = " ORDER BY g.seq DESC" if query.newest_first else " ORDER BY g.seq"
            rows = conn.execute(
                "SELECT " + self._STORED_COLUMNS + ", COALESCE(s.count, 0) AS served" + base + order + " LIMIT :limit"
                + self._SKIP_LOCKED_GROUPS,
                {**params, "limit": query.limit},
            ).fetchall()
            total = conn.execute("SELECT COUNT(*)" + base, params).fetchone()[0]
            groups = []
            for row in rows:
                conn.execute(
                    "INSERT INTO served (group_id, trainer_id, tier, count, first_at, last_at)"
                    " VALUES (?, ?, ?, 1, ?, ?) ON CONFLICT (group_id, trainer_id, tier)"
                    " DO UPDATE SET count = served.count + 1, last_at = excluded.last_at",
                    (row["group_id"], query.trainer_id, row["tier"], now, now),
                )
                groups.append(StoredGroup(
                    group_id=row["group_id"], tier=Tier(row["tier"]), status=row["status"],
                    received_at=row["received_at"], policy_version=row["policy_version"],
                    lag_at_arrival=row["lag_at_arrival"], served_count=row["served"] + 1,
                    payload=row["payload"],
                ))
            if groups:
                self._audit(conn, now, "groups.served", query.trainer_id, query.trainer_id, {
                    "tier": query.tier.value, "group_ids": [g.group_id for g in groups],
                })
            remaining = max(total - len(groups), 0)
            return FetchBatch(groups=groups, active_version=active, remaining=remaining)

        return await self._write(tx)

    async def group(self, group_id: str) -> StoredGroup | None:
        def read(conn: Any) -> StoredGroup | None:
            row = conn.execute(
                "SELECT " + self._STORED_COLUMNS + " FROM groups g WHERE g.group_id=?", (group_id,)
            ).fetchone()
            if row is None:
                return None
            served = conn.execute("SELECT COALESCE(SUM(count), 0) FROM served WHERE group_id=?",
                                  (group_id,)).fetchone()[0]
            return StoredGroup(
                group_id=row["group_id"], tier=Tier(row["tier"]), status=row["status"],
                received_at=row["received_at"], policy_version=row["policy_version"],
                lag_at_arrival=row["lag_at_arrival"], served_count=served, payload=row["payload"],
            )

        return await self._read(read)

    def _report(self, conn: Any, trainer_id: str, group_id: str, decision: GroupDecision | None,
                feedback: TrainerFeedback | None, now: float) -> ReportReceipt:
        row = conn.execute("SELECT worker_id, tier, status, engine_fingerprint FROM groups WHERE group_id=?"
                           + self._LOCK,
                           (group_id,)).fetchone()
        if row is None:
            raise _fault(ErrorCode.not_found, f"unknown group {group_id}")
        tier, status = row["tier"], row["status"]
        if decision is not None:
            conn.execute(
                "INSERT INTO decisions (group_id, trainer_id, status, body, decided_at) VALUES (?, ?, ?, ?, ?)",
                (group_id, trainer_id, decision.status.value, decision.model_dump_json(), now),
            )
            placed, status = rules.placement(decision.status, Tier(tier), status)
            tier = placed.value
            conn.execute("UPDATE groups SET tier=?, status=? WHERE group_id=?", (tier, status, group_id))
            self._audit(conn, now, "group.decided", trainer_id, group_id, {
                "status": decision.status.value, "reasons": [r.value for r in decision.reasons],
                "rejection_reasons": [r.value for r in decision.rejection_reasons],
                "tier": tier, "group_status": status,
                "token_ess": None if decision.report is None else decision.report.token_ess,
            })
        worker = conn.execute("SELECT quality FROM workers WHERE worker_id=?" + self._LOCK,
                              (row["worker_id"],)).fetchone()
        quality = worker["quality"]
        if feedback is not None:
            quality = rules.updated_quality(quality, feedback.score, self.settings.feedback_alpha)
            conn.execute(
                "UPDATE workers SET quality=?, feedback_count=feedback_count+1 WHERE worker_id=?",
                (quality, row["worker_id"]),
            )
            conn.execute(
                "INSERT INTO feedback (group_id, worker_id, trainer_id, score, body, received_at)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (group_id, row["worker_id"], trainer_id, feedback.score, feedback.model_dump_json(), now),
            )
            fingerprint = row["engine_fingerprint"]  # checked against the worker's reload ack on arrival
            self._audit(conn, now, "feedback.recorded", trainer_id, row["worker_id"], {
                "group_id": group_id, "score": feedback.score, "quality": quality, "fingerprint": fingerprint,
                "fingerprint_quality": self._fingerprint_feedback(conn, fingerprint, feedback.score, rejected=False),
            })
        return ReportReceipt(group_id=group_id, tier=tier, status=status,
                             worker_id=row["worker_id"], worker_quality=quality)

    async def report(self, trainer_id: str, group_id: str, decision: GroupDecision | None,
                     feedback: TrainerFeedback | None, now: float) -> ReportReceipt:
        return await self._write(lambda conn: self._report(conn, trainer_id, group_id, decision, feedback, now))

    async def report_many(self, reports: list[tuple[str, str, GroupDecision | None, TrainerFeedback | None]],
                          now: float) -> list[ReportReceipt]:
        # One operation, so one savepoint: an unknown group anywhere rolls the whole batch back.
        return await self._write(lambda conn: [self._report(conn, trainer_id, group_id, decision, feedback, now)
                                               for trainer_id, group_id, decision, feedback in reports])

    # -- operations -----------------------------------------------------------------------
    async def reap(self, now: float) -> ReapResult:
        def tx(conn: Any) -> ReapResult:
            result = ReapResult()
            for row in conn.execute(
                "SELECT lease_id, job_id, worker_id FROM leases WHERE state='issued' AND expires_at <= ?"
                + self._LOCK, (now,)
            ).fetchall():
                self._end_lease(conn, now, row["lease_id"], row["job_id"], row["worker_id"],
                                LeaseState.expired, retry=True, actor="reaper", result=result)
                result.expired_leases.append(row["lease_id"])
            cutoff = rules.heartbeat_cutoff(now, self._started_at, self.settings.heartbeat_ttl_s)
            if cutoff is not None:
                for row in conn.execute(
                    "SELECT worker_id, last_heartbeat_at FROM workers WHERE status='alive' AND last_heartbeat_at < ?"
                    + self._LOCK,
                    (cutoff,),
                ).fetchall():
                    worker_id = row["worker_id"]
                    conn.execute("UPDATE workers SET status='dead' WHERE worker_id=?", (worker_id,))
                    self._audit(conn, now, "worker.dead", "reaper", worker_id,
                                {"silent_for_s": round(now - row["last_heartbeat_at"], 3)})
                    result.dead_workers.append(worker_id)
                    for lease in conn.execute(
                        "SELECT lease_id, job_id FROM leases WHERE worker_id=? AND state='issued'" + self._LOCK,
                        (worker_id,)
                    ).fetchall():
                        self._end_lease(conn, now, lease["lease_id"], lease["job_id"], worker_id,
                                        LeaseState.abandoned, retry=True, actor="reaper", result=result)
                        result.abandoned_leases.append(lease["lease_id"])
            for row in conn.execute(
                "SELECT job_id FROM jobs WHERE state='queued' AND deadline IS NOT NULL AND deadline <= ?" + self._LOCK,
                (now,)
            ).fetchall():
                conn.execute("UPDATE jobs SET state='expired' WHERE job_id=?", (row["job_id"],))
                self._audit(conn, now, "job.expired", "reaper", row["job_id"], {"reason": "deadline"})
                result.failed_jobs.append(row["job_id"])
            result.activated_version = self._maybe_activate(conn, now)
            return result

        return await self._write(tx)

    def _worker_summaries(self, conn: Any, active: int | None) -> list[WorkerSummary]:
        policy = self._policy(conn, active)
        summaries = []
        for row in conn.execute("SELECT * FROM workers ORDER BY worker_id"):
            manifest = self._manifest(conn, row["worker_id"])
            summaries.append(WorkerSummary(
                worker_id=row["worker_id"], status=row["status"], engine_name=manifest.engine_name,
                engine_fingerprint=row["loaded_fingerprint"] or manifest.engine_fingerprint,
                precision_classes=manifest.precision_classes, loaded_version=row["loaded_version"],
                aligned=(policy is not None and row["status"] == "alive"
                         and row["loaded_version"] == active and row["loaded_digest"] == policy.checkpoint_digest),
                active_leases=row["active_leases"], quality=row["quality"],
                feedback_count=row["feedback_count"], rejected_count=row["rejected_count"],
                price_hint=row["price"],
                last_heartbeat_at=_ts(row["last_heartbeat_at"]), registered_at=_ts(row["registered_at"]),
                pool=manifest.pool,
            ))
        return summaries

    async def pool_status(self, now: float) -> PoolStatus:
        def read(conn: Any) -> PoolStatus:
            active, published = self._pool(conn)
            needed, acks = self._quorum(conn, published) if published is not None else (0, 0)
            counts = self._counts(conn)
            workers = self._worker_summaries(conn, active)
            return PoolStatus(
                active_version=active, published_version=published, policy=self._policy(conn, published),
                quorum=needed, acks=acks,
                alive_workers=sum(1 for w in workers if w.status == "alive"),
                dead_workers=sum(1 for w in workers if w.status == "dead"),
                jobs=counts["jobs"], leases=counts["leases"], groups=counts["groups"], workers=workers,
            )

        return await self._read(read)

    async def workers(self) -> list[WorkerSummary]:
        return await self._read(lambda conn: self._worker_summaries(conn, self._pool(conn)[0]))

    async def audit(self, since_seq: int, kind: str | None, subject: str | None, limit: int) -> AuditPage:
        def read(conn: Any) -> AuditPage:
            sql = "SELECT seq, at, kind, actor, subject, data FROM audit WHERE seq > ?"
            args: list[Any] = [since_seq]
            if kind:
                if kind.endswith("*") or kind.endswith("."):
                    sql += " AND kind LIKE ?"
                    args.append(kind.rstrip("*") + "%")
                else:
                    sql += " AND kind = ?"
                    args.append(kind)
            if subject:
                sql += " AND subject = ?"
                args.append(subject)
            sql += " ORDER BY seq LIMIT ?"
            args.append(limit)
            events = [
                AuditEvent(seq=r["seq"], at=_ts(r["at"]), kind=r["kind"], actor=r["actor"],
                           subject=r["subject"], data=json.loads(r["data"]))
                for r in conn.execute(sql, args)
            ]
            return AuditPage(events=events, next_seq=events[-1].seq if events else since_seq)

        return await self._read(read)

    def _counts(self, conn: Any) -> dict[str, dict[str, int]]:
        def by(sql: str) -> dict[str, int]:
            return {row[0]: row[1] for row in conn.execute(sql)}

        return {
            "jobs": by("SELECT state, COUNT(*) FROM jobs GROUP BY state"),
            "leases": by("SELECT state, COUNT(*) FROM leases GROUP BY state"),
            "groups": by("SELECT tier, COUNT(*) FROM groups WHERE status='available' GROUP BY tier"),
            "workers": by("SELECT status, COUNT(*) FROM workers GROUP BY status"),
            "audit": by("SELECT kind, COUNT(*) FROM audit GROUP BY kind"),
            "pool": {
                name: -1 if value is None else value
                for name, value in zip(("active", "published"), self._pool(conn))
            },
        }

    async def counts(self) -> dict[str, dict[str, int]]:
        return await self._read(self._counts)

    async def market(self, now: float) -> MarketReport:
        return await self._read(lambda conn: market_report(conn, now, self._MARKET))

