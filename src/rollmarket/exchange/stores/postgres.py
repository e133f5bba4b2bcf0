"""PostgreSQL backend: every Store call one transaction on a pooled connection, committed before it
returns, so several exchange processes (replicas) can share one database.

Why synchronous psycopg 3 in worker threads rather than its async API: the transactions are the
SQL of `SqlStore`, written once as plain functions over a connection and shared with SQLite, whose
driver is synchronous; a thread per call keeps one code path for both and the event loop free.

What keeps replicas correct lives in the database, not in a process: a job to lease is picked with
``SELECT … FOR UPDATE SKIP LOCKED`` and a partial unique index allows one issued lease per job; a
row a transaction goes on to change is read ``FOR UPDATE``; unique constraints refuse a second
group for a lease or a group id and a second job for an idempotency key; a transaction that loses
such a race (or a deadlock, or its connection before COMMIT) is run again from the start and then
sees the winner's row (a resubmitted group gets the first receipt). A transaction's audit events are
inserted at its end under a transaction-level advisory lock, so their sequence numbers are in
commit order and `since_seq` paging never skips one, while the rest of the call runs unserialized. The schema is versioned SQL files in `migrations/postgres/`, applied in order at open
under a session advisory lock, so replicas that start together migrate once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
from collections.abc import Callable
from importlib import resources
from typing import Any, TypeVar

import psycopg
from psycopg import errors
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import ConnectionPool, PoolTimeout

from ...contracts import EnqueueReceipt, RolloutJob
from ..market import POSTGRES
from ..settings import ExchangeSettings, redact_url
from ..store import StoreError
from .sql import Refusal, SqlStore, dumps

log = logging.getLogger(__name__)
T = TypeVar("T")

MIGRATION_LOCK = 0x726F6C6C6D6B7401
"""Session advisory lock held while the schema is migrated ("rollmkt" + 1)."""
AUDIT_LOCK = 0x726F6C6C6D6B7402
"""Transaction advisory lock taken before an audit insert: audit seq follows commit order."""
POOL_SIZE = 10
CONNECT_TIMEOUT_S = 10.0
UNAVAILABLE_RETRY_S = 30.0
"""How long a call waits for a lost server to come back (a restart) before it fails."""
RACE_RETRIES = 8
ANALYZE_AFTER_JOBS = 256
"""An enqueue that adds this many jobs refreshes the planner's statistics of the queue."""

_RACES = (errors.SerializationFailure, errors.DeadlockDetected, errors.UniqueViolation)
_GONE = (psycopg.OperationalError, PoolTimeout)
_PARAM = re.compile(r"\?|(?<![:\w]):([A-Za-z_]\w*)")


@functools.lru_cache(maxsize=512)
def _translate(sql: str) -> str:
    """SQLite-style `?` and `:name` parameters as psycopg's `%s` and `%(name)s`."""
    return _PARAM.sub(lambda m: "%s" if m.group(0) == "?" else f"%({m.group(1)})s", sql.replace("%", "%%"))


class _Row(tuple):
    """A row readable by index and by column name, like sqlite3.Row."""

    _index: dict[str, int]

    def __getitem__(self, key):
        return super().__getitem__(self._index[key] if isinstance(key, str) else key)

    def keys(self) -> list[str]:
        return list(self._index)


def _row_factory(cursor: psycopg.Cursor) -> Callable[[Any], _Row]:
    index = {column.name: i for i, column in enumerate(cursor.description or ())}

    def make(values) -> _Row:
        row = _Row(values)
        row._index = index
        return row

    return make


class _Conn:
    """A psycopg connection that speaks SqlStore's parameter style."""

    def __init__(self, conn: psycopg.Connection):
        self._conn = conn
        self.audit_rows: list[tuple] = []
        """Audit events of this transaction, written just before its COMMIT (PostgresStore._audit)."""

    def execute(self, sql: str, params: Any = None) -> psycopg.Cursor:
        if params is None:
            return self._conn.execute(sql)
        return self._conn.execute(_translate(sql), params)


def migrations() -> list[tuple[int, str, str]]:
    """(version, name, SQL) of every schema migration, in order."""
    folder = resources.files(__package__) / "migrations" / "postgres"
    found = []
    for entry in folder.iterdir():
        if entry.name.endswith(".sql"):
            found.append((int(entry.name.split("_", 1)[0]), entry.name, entry.read_text()))
    return sorted(found)


def migrate(conn: psycopg.Connection) -> list[int]:
    """Bring the schema up to date; the versions applied now. Safe when replicas start together:
    they queue on one advisory lock and the later ones find nothing left to apply."""
    conn.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK,))
    try:
        conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER PRIMARY KEY,"
                     " name TEXT NOT NULL, applied_at TIMESTAMPTZ NOT NULL DEFAULT now())")
        applied = {row[0] for row in conn.execute("SELECT version FROM schema_version")}
        known = migrations()
        newest = max((version for version, _, _ in known), default=0)
        if applied and max(applied) > newest:
            raise StoreError(f"the database schema is at version {max(applied)}, newer than this exchange "
                             f"knows ({newest}): upgrade rollmarket")
        done = []
        for version, name, sql in known:
            if version in applied:
                continue
            with conn.transaction():
                conn.execute(sql)
                conn.execute("INSERT INTO schema_version (version, name) VALUES (%s, %s)", (version, name))
            log.info("applied schema migration %s", name)
            done.append(version)
        return done
    finally:
        conn.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK,))


def prepare(url: str) -> None:
    """Check that `url` names a reachable PostgreSQL database and bring its schema up to date;
    a StoreError says what is wrong (a bad URL, a server that is down or refuses us)."""
    where = redact_url(url)
    try:
        conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        raise StoreError(f"not a PostgreSQL URL: {where} ({exc})") from None
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=int(CONNECT_TIMEOUT_S)) as conn:
            migrate(conn)
    except psycopg.OperationalError as exc:
        raise StoreError(f"cannot connect to PostgreSQL at {where}: {str(exc).strip()}") from None


class PostgresStore(SqlStore):
    """The exchange's state in a PostgreSQL database, shareable by several exchange processes."""

    _LOCK = " FOR UPDATE"
    _SKIP_LOCKED = " FOR UPDATE SKIP LOCKED"
    _SKIP_LOCKED_GROUPS = " FOR UPDATE OF g SKIP LOCKED"
    _ARRIVAL = "seq"
    _MARKET = POSTGRES

    @staticmethod
    def _in_json_array(value: str, array: str) -> str:
        return f"{value} IN (SELECT jsonb_array_elements_text(CAST({array} AS jsonb)))"

    @staticmethod
    def _json_field(column: str, field: str) -> str:
        return f"(CAST({column} AS jsonb) -> '{field}')"

    @staticmethod
    def _json_array_empty(array: str) -> str:
        return f"COALESCE(jsonb_array_length(CAST({array} AS jsonb)), 0) = 0"

    def __init__(self, url: str, settings: ExchangeSettings):
        super().__init__(settings)
        self.url = url
        self._connections: ConnectionPool | None = None

    @property
    def where(self) -> str:
        """The database URL without its password."""
        return redact_url(self.url)

    # -- plumbing -------------------------------------------------------------------------
    @staticmethod
    def _audit(conn: Any, now: float, kind: str, actor: str, subject: str, data: dict[str, Any]) -> None:
        # Held back to the end of the transaction (_flush_audit): the lock that orders audit seq by
        # commit order is then held for the inserts and the COMMIT only, not for the whole call —
        # taken mid-call it made every writing call on the database run one at a time.
        conn.audit_rows.append((now, kind, actor, subject, dumps(data)))

    @staticmethod
    def _flush_audit(conn: _Conn) -> None:
        if conn.audit_rows:
            conn.execute("SELECT pg_advisory_xact_lock(?)", (AUDIT_LOCK,))
            with conn._conn.cursor() as cursor:
                cursor.executemany("INSERT INTO audit (at, kind, actor, subject, data) VALUES (%s, %s, %s, %s, %s)",
                                   conn.audit_rows)
            conn.audit_rows.clear()

    def _call(self, fn: Callable[[_Conn], T], *, write: bool) -> T:
        """Run `fn` (in a transaction when `write`), again when it lost a race or the server."""
        races = 0
        gone_since: float | None = None
        while True:
            committing = False
            try:
                if self._connections is None:
                    raise RuntimeError("the PostgreSQL store is not open")
                with self._connections.connection(timeout=CONNECT_TIMEOUT_S) as conn:
                    if not write:
                        return fn(_Conn(conn))
                    refusal = None
                    with conn.transaction():
                        wrapped = _Conn(conn)
                        try:
                            result = fn(wrapped)
                        except Refusal as kept:  # commit what it wrote, then refuse
                            refusal = kept
                        self._flush_audit(wrapped)
                        committing = True
                    if self.on_batch is not None:
                        self.on_batch(1)  # one call, one transaction: every batch is of one
                    if refusal is not None:
                        raise refusal.fault
                    return result
            except _RACES as exc:
                races += 1
                if races > RACE_RETRIES:
                    raise
                log.debug("transaction lost a race (%s); running it again", type(exc).__name__)
                time.sleep(0.005 * races)
            except _GONE as exc:
                if committing:
                    # The COMMIT was sent and not answered: it may have committed. Running the
                    # call again could apply it twice, so the caller hears that the outcome is
                    # unknown (a 500) and retries through the idempotent API if it needs to.
                    raise StoreError(f"PostgreSQL at {self.where} went away during COMMIT: {exc}") from exc
                # Nothing was committed (the transaction died with its connection): wait out a
                # restart of PostgreSQL, then run the call again from the start.
                gone_since = gone_since or time.monotonic()
                if time.monotonic() - gone_since > UNAVAILABLE_RETRY_S:
                    raise StoreError(f"PostgreSQL at {self.where} is unavailable: {exc}") from exc
                log.warning("PostgreSQL connection lost (%s); retrying", exc)
                time.sleep(0.5)

    async def _write(self, fn: Callable[[Any], T]) -> T:
        return await asyncio.to_thread(self._call, fn, write=True)

    async def enqueue(self, jobs: list[RolloutJob], now: float) -> list[EnqueueReceipt]:
        receipts = await super().enqueue(jobs, now)
        if sum(r.created for r in receipts) >= ANALYZE_AFTER_JOBS:
            # A lease walks the queue index (migration 0003) only once the planner knows the queue
            # is long; until autovacuum analyzes it (a minute or more) it filters and sorts every
            # queued job instead, ~50 ms a lease at a few thousand. ANALYZE samples; it is cheap.
            await self._read(lambda conn: conn.execute("ANALYZE jobs"))
        return receipts

    async def _read(self, fn: Callable[[Any], T]) -> T:
        return await asyncio.to_thread(self._call, fn, write=False)

    async def open(self, settings_json: dict, now: float) -> None:
        await asyncio.to_thread(self._connect)
        self._started_at = now

        def init(conn: Any) -> None:
            conn.execute("INSERT INTO meta VALUES ('settings', ?) ON CONFLICT (key) DO UPDATE SET value=excluded.value",
                         (dumps(settings_json),))
            self._audit(conn, now, "exchange.started", "exchange", "exchange", {"settings": settings_json})

        await self._write(init)

    def _connect(self) -> None:
        prepare(self.url)
        pool = ConnectionPool(self.url, min_size=1, max_size=POOL_SIZE, open=False,
                              kwargs={"autocommit": True}, configure=self._configure,
                              name="rollmarket-exchange")
        try:
            pool.open(wait=True, timeout=CONNECT_TIMEOUT_S)
        except PoolTimeout as exc:
            pool.close()
            raise StoreError(f"cannot connect to PostgreSQL at {self.where}: {exc}") from None
        self._connections = pool

    @staticmethod
    def _configure(conn: psycopg.Connection) -> None:
        conn.row_factory = _row_factory

    async def close(self) -> None:
        if self._connections is not None:
            await asyncio.to_thread(self._connections.close)
            self._connections = None
