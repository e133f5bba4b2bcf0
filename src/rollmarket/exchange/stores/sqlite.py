"""SQLite backend: WAL mode, one writer thread with group commit, readers on their own connections.

All writes go through one thread. It drains whatever operations are waiting, runs each inside its
own SAVEPOINT (so one failing operation rolls back alone), commits the batch once, and only then
answers the callers: an acknowledged write is on disk, and with ``synchronous=FULL`` it survives a
power cut as well as a ``kill -9``. Reads use per-thread connections that WAL lets run beside the
writer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ...sqlite_commit import batches, commit_each, connect
from ..settings import ExchangeSettings
from .sql import Refusal, SqlStore, dumps

log = logging.getLogger(__name__)
T = TypeVar("T")

SCHEMA_VERSION = 1

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS pool (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    active_version INTEGER,
    published_version INTEGER
);
INSERT OR IGNORE INTO pool (id) VALUES (1);
CREATE TABLE IF NOT EXISTS policies (
    version INTEGER PRIMARY KEY,
    digest TEXT NOT NULL,
    manifest TEXT NOT NULL,
    quorum INTEGER,
    published_at REAL NOT NULL,
    activated_at REAL
);
CREATE TABLE IF NOT EXISTS workers (
    worker_id TEXT PRIMARY KEY,
    manifest TEXT NOT NULL,
    token_hash TEXT NOT NULL,
    status TEXT NOT NULL,
    registered_at REAL NOT NULL,
    last_heartbeat_at REAL NOT NULL,
    loaded_version INTEGER,
    loaded_digest TEXT,
    loaded_fingerprint TEXT,
    active_leases INTEGER NOT NULL DEFAULT 0,
    quality REAL NOT NULL,
    feedback_count INTEGER NOT NULL DEFAULT 0,
    rejected_count INTEGER NOT NULL DEFAULT 0,
    price REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS reload_acks (
    worker_id TEXT NOT NULL,
    policy_version INTEGER NOT NULL,
    digest TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    acked_at REAL NOT NULL,
    PRIMARY KEY (worker_id, policy_version)
);
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    idempotency_key TEXT NOT NULL UNIQUE,
    digest TEXT NOT NULL,
    body TEXT NOT NULL,
    policy_version INTEGER NOT NULL,
    priority INTEGER NOT NULL,
    req_precision TEXT,
    req_quantization TEXT,
    max_context INTEGER NOT NULL,
    needs_experts INTEGER NOT NULL,
    engines TEXT,
    deadline REAL,
    state TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    enqueued_at REAL NOT NULL,
    queued_at REAL NOT NULL,
    group_id TEXT
);
CREATE INDEX IF NOT EXISTS jobs_queue ON jobs (state, priority DESC, queued_at);
CREATE TABLE IF NOT EXISTS leases (
    lease_id TEXT PRIMARY KEY,
    job_id TEXT NOT NULL,
    worker_id TEXT NOT NULL,
    policy_version INTEGER NOT NULL,
    body TEXT NOT NULL,
    issued_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    state TEXT NOT NULL,
    ended_at REAL
);
CREATE INDEX IF NOT EXISTS leases_live ON leases (state, expires_at);
CREATE INDEX IF NOT EXISTS leases_worker ON leases (worker_id, state);
CREATE TABLE IF NOT EXISTS groups (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    group_id TEXT NOT NULL UNIQUE,
    lease_id TEXT NOT NULL UNIQUE,
    job_id TEXT NOT NULL,
    worker_id TEXT NOT NULL,
    task_id TEXT NOT NULL,
    policy_version INTEGER NOT NULL,
    precision_class TEXT NOT NULL,
    engine_fingerprint TEXT NOT NULL,
    content_hash TEXT NOT NULL,
    n_tokens INTEGER NOT NULL,
    tier TEXT NOT NULL,
    status TEXT NOT NULL,
    lag_at_arrival INTEGER NOT NULL,
    receipt TEXT NOT NULL,
    received_at REAL NOT NULL,
    payload BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS groups_serve ON groups (tier, status, seq);
CREATE TABLE IF NOT EXISTS served (
    group_id TEXT NOT NULL,
    trainer_id TEXT NOT NULL,
    tier TEXT NOT NULL,
    count INTEGER NOT NULL,
    first_at REAL NOT NULL,
    last_at REAL NOT NULL,
    PRIMARY KEY (group_id, trainer_id, tier)
);
CREATE TABLE IF NOT EXISTS decisions (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    group_id TEXT NOT NULL,
    trainer_id TEXT NOT NULL,
    status TEXT NOT NULL,
    body TEXT NOT NULL,
    decided_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS feedback (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    group_id TEXT NOT NULL,
    worker_id TEXT NOT NULL,
    trainer_id TEXT NOT NULL,
    score REAL NOT NULL,
    body TEXT NOT NULL,
    received_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS fingerprints (
    fingerprint TEXT PRIMARY KEY,
    quality REAL NOT NULL,
    feedback_count INTEGER NOT NULL DEFAULT 0,
    rejected_count INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS audit (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    kind TEXT NOT NULL,
    actor TEXT NOT NULL,
    subject TEXT NOT NULL,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS audit_kind ON audit (kind, seq);
CREATE INDEX IF NOT EXISTS audit_subject ON audit (subject, seq);
"""


def _connect(path: Path, synchronous: str, *, readonly: bool = False) -> sqlite3.Connection:
    return connect(path, synchronous, readonly=readonly, foreign_keys=True)


class _Writer:
    """The single writer thread: batches operations into one transaction each round."""

    _STOP = object()

    def __init__(self, path: Path, synchronous: str, batch_max: int,
                 on_batch: Callable[[int], object] | None = None):
        self._on_batch = on_batch
        self._path = path
        self._synchronous = synchronous
        self._batch_max = batch_max
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.batches = 0
        self.operations = 0
        self._thread = threading.Thread(target=self._run, name="rollmarket-sqlite-writer", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        self._queue.put(self._STOP)
        self._thread.join()

    def submit(self, fn: Callable[[sqlite3.Connection], T]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((fn, future))
        return future

    def _run(self) -> None:
        try:
            conn = _connect(self._path, self._synchronous)
        except BaseException as exc:  # surfaced to start()
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        for batch in batches(self._queue, self._batch_max, self._STOP):
            self._run_batch(conn, batch)
        conn.close()

    def _run_batch(self, conn: sqlite3.Connection, batch: list) -> None:
        runnable = [(fn, future) for fn, future in batch if future.set_running_or_notify_cancel()]
        try:
            outcomes = commit_each(conn, [fn for fn, _ in runnable],
                                   kept=lambda exc: exc.fault if isinstance(exc, Refusal) else None)
        except BaseException as exc:
            log.exception("write batch failed; rolled back %d operations", len(runnable))
            for _, future in runnable:
                future.set_exception(exc)
            return
        self.batches += 1
        self.operations += len(outcomes)
        if self._on_batch is not None:
            self._on_batch(len(outcomes))
        # Answer only after COMMIT: an acknowledged write is durable.
        for (_, future), (result, error) in zip(runnable, outcomes):
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)


class SqliteStore(SqlStore):
    """The exchange's state in one SQLite file."""

    def __init__(self, path: Path | str, settings: ExchangeSettings):
        super().__init__(settings)
        self.path = Path(path)
        self._writer = _Writer(self.path, settings.sqlite_synchronous, settings.write_batch_max,
                               on_batch=lambda size: self.on_batch and self.on_batch(size))
        self._local = threading.local()
        self._readers: list[sqlite3.Connection] = []
        self._readers_lock = threading.Lock()

    # -- plumbing -------------------------------------------------------------------------
    async def _write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        return await asyncio.wrap_future(self._writer.submit(fn))

    def _reader(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = _connect(self.path, self.settings.sqlite_synchronous, readonly=True)
            self._local.conn = conn
            with self._readers_lock:
                self._readers.append(conn)
        return conn

    async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        return await asyncio.to_thread(lambda: fn(self._reader()))

    @property
    def write_stats(self) -> tuple[int, int]:
        """(batches committed, operations committed) since start."""
        return self._writer.batches, self._writer.operations

    async def open(self, settings_json: dict, now: float) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._started_at = now

        def init(conn: sqlite3.Connection) -> None:
            found = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if found is not None and int(found[0]) != SCHEMA_VERSION:
                raise RuntimeError(f"database schema {found[0]} != supported {SCHEMA_VERSION}")
            conn.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            conn.execute("INSERT OR REPLACE INTO meta VALUES ('settings', ?)", (dumps(settings_json),))
            self._audit(conn, now, "exchange.started", "exchange", "exchange", {"settings": settings_json})

        # executescript manages its own transaction, so the schema is made before the writer starts.
        setup = _connect(self.path, self.settings.sqlite_synchronous)
        setup.executescript(SCHEMA)
        setup.close()
        self._writer.start()
        await self._write(init)

    async def close(self) -> None:
        await asyncio.to_thread(self._writer.stop)
        with self._readers_lock:
            for conn in self._readers:
                conn.close()
            self._readers.clear()
