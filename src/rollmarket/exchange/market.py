"""The marketplace report (contracts.MarketReport) computed from an exchange's database.

One function over a connection, so the running exchange (`GET /v1/market`, its own read
connection) and the dashboard (a database file opened read-only) give the same numbers. It only
reads; it needs nothing but the standard library and the contracts. The few SQL fragments where
SQLite and PostgreSQL differ come in a `MarketSql`.
"""

from __future__ import annotations

import json
import math
import sqlite3
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from ..contracts import (
    LagBin,
    MarketBucket,
    MarketFingerprint,
    MarketReport,
    MarketWorker,
    ReloadLatency,
    TrainerIdle,
)
from ..contracts.limits import MAX_ITEMS
from ..contracts.market import MAX_BUCKETS

BUCKET_STEPS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400)
"""Bucket widths a person reads easily; the smallest that keeps the timeline under MAX_BUCKETS wins."""


@dataclass(frozen=True)
class MarketSql:
    """The dialect's fragments: a bucket index, the arrival tier, the reason tables, a snapshot."""

    bucket: str = "MIN(CAST(({} - :origin) / :width AS INTEGER), :top)"
    arrival_tier: str = "json_extract(g.receipt, '$.tier')"
    submission_reasons: str = "json_each(a.data, '$.reasons') r"
    gate_reasons: str = "json_each(d.body, '$.rejection_reasons') r"
    reason: str = "r.value"
    begin: str = "BEGIN"
    has_fingerprints: str = "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = 'fingerprints'"


SQLITE = MarketSql()
POSTGRES = MarketSql(
    bucket="LEAST(CAST(FLOOR(({} - :origin) / :width) AS INTEGER), :top)",
    arrival_tier="CAST(g.receipt AS jsonb) ->> 'tier'",
    submission_reasons="jsonb_array_elements_text(CAST(a.data AS jsonb) -> 'reasons') r",
    gate_reasons="jsonb_array_elements_text(CAST(d.body AS jsonb) -> 'rejection_reasons') r",
    reason="r",
    begin="BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY",
    has_fingerprints="SELECT COUNT(*) FROM pg_tables WHERE tablename = 'fingerprints'",
)


def _utc(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, timezone.utc)


def bucket_width(span_s: float) -> float:
    """The narrowest readable width that covers `span_s` in at most MAX_BUCKETS buckets."""
    for step in BUCKET_STEPS_S:
        if span_s < step * MAX_BUCKETS:
            return float(step)
    return float(math.ceil(span_s / MAX_BUCKETS / 86400) * 86400)


def open_readonly(path: Path) -> sqlite3.Connection:
    """Open an exchange database without writing anything beside it.

    A WAL-mode database opened read-only still creates (and leaves) its -wal and -shm files, so a
    closed database (no -wal beside it) is opened as immutable: nothing is created. A database with
    a -wal is live (or its exchange crashed): it is read through the existing WAL, which is current."""
    path = Path(path).resolve()
    live = path.with_name(path.name + "-wal").exists()
    uri = path.as_uri() + ("?mode=ro" if live else "?mode=ro&immutable=1")
    conn = sqlite3.connect(uri, uri=True, timeout=30, check_same_thread=False, isolation_level=None)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA query_only = 1")
    return conn


def _workers(conn: sqlite3.Connection) -> list[MarketWorker]:
    leases = dict(conn.execute("SELECT worker_id, COUNT(*) FROM leases GROUP BY worker_id").fetchall())
    stored = {r[0]: (r[1], r[2]) for r in conn.execute(
        "SELECT worker_id, COUNT(*), COALESCE(SUM(n_tokens), 0) FROM groups GROUP BY worker_id")}
    decisions: dict[str, dict[str, int]] = defaultdict(dict)
    for worker_id, status, n in conn.execute(
            "SELECT g.worker_id, d.status, COUNT(*) FROM decisions d JOIN groups g ON g.group_id = d.group_id"
            " GROUP BY g.worker_id, d.status"):
        decisions[worker_id][status] = n
    workers = []
    for row in conn.execute("SELECT * FROM workers ORDER BY worker_id"):
        manifest = json.loads(row["manifest"])
        accepted, tokens = stored.get(row["worker_id"], (0, 0))
        workers.append(MarketWorker(
            worker_id=row["worker_id"], pool=manifest.get("pool"), status=row["status"],
            engine_name=manifest["engine_name"],
            engine_version=manifest["engine_version"], device_type=manifest.get("device_type", "cpu"),
            device_count=manifest.get("device_count", 1), region=manifest.get("region", "local"),
            precision_classes=manifest["precision_classes"],
            engine_fingerprint=row["loaded_fingerprint"] or manifest["engine_fingerprint"],
            quality=row["quality"], price_hint=row["price"], leases=leases.get(row["worker_id"], 0),
            active_leases=row["active_leases"], accepted=accepted, rejected=row["rejected_count"],
            accepted_tokens=tokens, decisions=decisions.get(row["worker_id"], {}),
        ))
    return workers


def _fingerprints(conn: sqlite3.Connection, sql: MarketSql) -> list[MarketFingerprint]:
    """Quality per engine fingerprint, with the workers running each now and its stored groups.
    A database from before fingerprints were kept has none."""
    if not conn.execute(sql.has_fingerprints).fetchone()[0]:
        return []
    running: dict[str, list[str]] = defaultdict(list)
    for worker_id, loaded, manifest in conn.execute(
            "SELECT worker_id, loaded_fingerprint, manifest FROM workers ORDER BY worker_id"):
        running[loaded or json.loads(manifest)["engine_fingerprint"]].append(worker_id)
    accepted = dict(conn.execute("SELECT engine_fingerprint, COUNT(*) FROM groups GROUP BY engine_fingerprint"))
    return [
        MarketFingerprint(engine_fingerprint=fp, quality=quality, feedback_count=feedback, rejected_count=rejected,
                          accepted=accepted.get(fp, 0), workers=running.get(fp, [])[:MAX_ITEMS])
        for fp, quality, feedback, rejected in conn.execute(
            "SELECT fingerprint, quality, feedback_count, rejected_count FROM fingerprints ORDER BY fingerprint")
    ][:MAX_ITEMS]


def _timeline(conn: sqlite3.Connection, sql: MarketSql) -> tuple[float, list[MarketBucket]]:
    """Decisions (by worker, arrival tier, status) and stored groups, bucketed by time (in SQL)."""
    first, last = conn.execute(
        "SELECT MIN(t), MAX(t) FROM (SELECT MIN(decided_at) AS t FROM decisions UNION ALL"
        " SELECT MAX(decided_at) FROM decisions UNION ALL SELECT MIN(received_at) FROM groups UNION ALL"
        " SELECT MAX(received_at) FROM groups) AS ends").fetchone()
    if first is None:
        return 1.0, []
    width = bucket_width(last - first)
    origin = math.floor(first / width) * width
    count = int((last - origin) // width) + 1
    at = {"origin": origin, "width": width, "top": count - 1}
    bucket = sql.bucket
    by_worker: list[Counter[str]] = [Counter() for _ in range(count)]
    by_tier: list[Counter[str]] = [Counter() for _ in range(count)]
    by_status: list[Counter[str]] = [Counter() for _ in range(count)]
    for i, worker_id, tier, status, n in conn.execute(
            f"SELECT {bucket.format('d.decided_at')} AS i, g.worker_id, {sql.arrival_tier} AS arrival,"
            " d.status, COUNT(*) FROM decisions d JOIN groups g ON g.group_id = d.group_id"
            " GROUP BY i, g.worker_id, arrival, d.status", at):
        by_worker[i][worker_id] += n
        by_tier[i][tier] += n
        by_status[i][status] += n
    groups, tokens = [0] * count, [0] * count
    for i, n, n_tokens in conn.execute(
            f"SELECT {bucket.format('received_at')} AS i, COUNT(*), SUM(n_tokens) FROM groups GROUP BY i", at):
        groups[i], tokens[i] = n, n_tokens
    return width, [
        MarketBucket(start=_utc(origin + i * width), by_worker=dict(by_worker[i]), by_tier=dict(by_tier[i]),
                     by_status=dict(by_status[i]), accepted_groups=groups[i], accepted_tokens=tokens[i])
        for i in range(count)
    ]


def _rejections(conn: sqlite3.Connection, sql: MarketSql) -> tuple[dict[str, int], dict[str, int]]:
    """Reason counts, counted in SQL: decision bodies are large and there may be many."""
    at_submission = dict(conn.execute(
        f"SELECT {sql.reason}, COUNT(*) FROM audit a, {sql.submission_reasons}"
        f" WHERE a.kind = 'submission.rejected' GROUP BY {sql.reason}").fetchall())
    at_gate = dict(conn.execute(
        f"SELECT {sql.reason}, COUNT(*) FROM decisions d, {sql.gate_reasons}"
        f" GROUP BY {sql.reason}").fetchall())
    return at_submission, at_gate


def _trainers(conn: sqlite3.Connection) -> list[TrainerIdle]:
    """Each trainer's groups as (first served, first decided or None, last served), in serving order."""
    per_trainer: dict[str, list[tuple[float, float | None, float]]] = defaultdict(list)
    for trainer_id, first_at, decided_at, last_at in conn.execute(
            "WITH s AS (SELECT trainer_id, group_id, MIN(first_at) AS f, MAX(last_at) AS l FROM served"
            " GROUP BY trainer_id, group_id),"
            " d AS (SELECT trainer_id, group_id, MIN(decided_at) AS t FROM decisions GROUP BY trainer_id, group_id)"
            " SELECT s.trainer_id, s.f, d.t, s.l FROM s LEFT JOIN d USING (trainer_id, group_id)"
            " ORDER BY s.trainer_id, s.f"):
        per_trainer[trainer_id].append((first_at, decided_at, last_at))
    last_decision = dict(conn.execute("SELECT trainer_id, MAX(decided_at) FROM decisions GROUP BY trainer_id"))
    out = []
    for trainer_id, rows in per_trainer.items():
        start = rows[0][0]
        end = max(max(last for _, _, last in rows), last_decision.get(trainer_id, start))
        busy, cursor = 0.0, start
        for first, done, _ in rows:  # the length of the union of [first served, decided], in start order
            lo, hi = max(first, cursor), end if done is None else max(first, done)
            if hi > lo:
                busy += hi - lo
                cursor = hi
        span = end - start
        out.append(TrainerIdle(trainer_id=trainer_id, groups=len(rows), span_s=span, busy_s=busy,
                               idle_fraction=None if span <= 0 else max(0.0, 1.0 - busy / span)))
    return out


def market_report(conn: sqlite3.Connection, now: float, sql: MarketSql = SQLITE) -> MarketReport:
    """The marketplace as the database holds it at `now` (POSIX seconds), from one snapshot."""
    conn.execute(sql.begin)  # every query below sees the same state, even while the exchange writes
    try:
        return _report(conn, now, sql)
    finally:
        conn.execute("ROLLBACK")


def _report(conn: sqlite3.Connection, now: float, sql: MarketSql) -> MarketReport:
    active, published = conn.execute("SELECT active_version, published_version FROM pool WHERE id = 1").fetchone()
    width, timeline = _timeline(conn, sql)
    submission, gate = _rejections(conn, sql)
    lags = dict(conn.execute("SELECT lag_at_arrival, COUNT(*) FROM groups GROUP BY lag_at_arrival").fetchall())
    acks = [ReloadLatency(worker_id=r[0], policy_version=r[1], seconds=r[2]) for r in conn.execute(
        "SELECT a.worker_id, a.policy_version, a.acked_at - p.published_at FROM reload_acks a"
        " JOIN policies p ON p.version = a.policy_version ORDER BY a.acked_at, a.worker_id")]
    top = MAX_ITEMS - 1  # the histogram's last bin holds every larger lag
    lag_bins = Counter({min(lag, top): 0 for lag in lags})
    for lag, n in lags.items():
        lag_bins[min(lag, top)] += n
    groups, tokens, first, last = conn.execute(
        "SELECT COUNT(*), COALESCE(SUM(n_tokens), 0), MIN(received_at), MAX(received_at) FROM groups").fetchone()
    span = 0.0 if groups == 0 else last - first
    decisions = dict(conn.execute("SELECT status, COUNT(*) FROM decisions GROUP BY status").fetchall())
    return MarketReport(
        generated_at=_utc(now), active_version=active, published_version=published, workers=_workers(conn),
        decisions=decisions, bucket_s=width, timeline=timeline, submission_rejections=submission,
        gate_rejections=gate,
        lag_histogram=[LagBin(lag=lag, groups=lag_bins[lag]) for lag in range(max(lag_bins, default=-1) + 1)],
        reload_acks=acks[-MAX_ITEMS:],
        reload_latency_mean_s=sum(a.seconds for a in acks) / len(acks) if acks else None,
        reload_latency_max_s=max((a.seconds for a in acks), default=None),
        accepted_groups=groups, accepted_tokens=tokens, accepted_span_s=span,
        accepted_tokens_per_s=tokens / span if groups >= 2 and span > 0 else None,
        trainers=_trainers(conn),
        fingerprints=_fingerprints(conn, sql),
    )
