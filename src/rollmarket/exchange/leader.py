"""Which exchange replica runs the singletons (the reaper): the leader.

Several replicas may serve one PostgreSQL database. Sweeps that must run once — re-queueing
expired leases, marking silent workers dead — run only in the replica that holds a PostgreSQL
advisory lock, taken with `pg_try_advisory_lock` on a session of its own. PostgreSQL releases the
lock when that session ends, so when the leader dies (kill -9 closes its socket) or PostgreSQL
restarts, another replica's next try takes it: takeover within `retry_s` plus the time the server
needs to notice the closed session.

Leadership is advisory, not a fence: a leader cut off from PostgreSQL may still be mid-sweep when
another replica takes over. That is safe because each sweep is one transaction over rows it locks;
the lock only keeps N replicas from doing the same work N times.

A SQLite exchange is one process on one file: it is always the leader.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from pathlib import Path
from typing import Protocol

from .stores import is_postgres_url

log = logging.getLogger(__name__)

LEADER_LOCK_KEY = int.from_bytes(hashlib.sha256(b"rollmarket.exchange.leader").digest()[:8], "big", signed=True)
"""The advisory lock's 64-bit key; PostgreSQL scopes it to the database, so one leader per database."""


class Leadership(Protocol):
    """Whether this replica leads now; `start` begins contending, `stop` lets go."""

    @property
    def is_leader(self) -> bool: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class SoleLeader:
    """The only process on its store (SQLite): always the leader."""

    is_leader = True

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None


class AdvisoryLockLeader:
    """Leads while its own PostgreSQL session holds the advisory lock `key`.

    A background task connects, tries the lock every `retry_s` until it gets it, then checks the
    session every `retry_s` (a query bounded by `check_timeout_s`). Any failure — PostgreSQL down,
    the session killed, a check that hangs — drops leadership at once and starts over with a new
    session, so a replica never believes it leads on a session PostgreSQL has already closed.
    """

    def __init__(self, url: str, *, key: int = LEADER_LOCK_KEY, retry_s: float = 1.0,
                 check_timeout_s: float = 5.0):
        self.url = url
        self.key = key
        self.retry_s = retry_s
        self.check_timeout_s = check_timeout_s
        self._leader = False
        self._task: asyncio.Task | None = None

    @property
    def is_leader(self) -> bool:
        return self._leader

    async def start(self) -> None:
        self._task = asyncio.create_task(self._contend_forever(), name="rollmarket-leader")

    async def stop(self) -> None:
        """Stop contending; closing the session hands the lock to another replica at once."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._set(False)

    def _set(self, leader: bool) -> None:
        if leader != self._leader:
            # INFO: a lost session is logged as a WARNING where it is caught; a clean stop is no news.
            log.info("this replica %s the exchange leader", "is now" if leader else "is no longer")
        self._leader = leader

    async def _contend_forever(self) -> None:
        import psycopg  # the [postgres] extra; only a PostgreSQL exchange gets here

        while True:
            try:
                await self._contend(psycopg)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a lost session of any kind: let go, then try again
                if self._leader:
                    log.warning("leader session lost (%s: %s)", type(exc).__name__, exc)
                self._set(False)
            await asyncio.sleep(self.retry_s)

    async def _contend(self, psycopg) -> None:
        connect = psycopg.AsyncConnection.connect(
            self.url, autocommit=True, connect_timeout=max(1, round(self.check_timeout_s)),
            application_name="rollmarket-exchange-leader",
            # keepalives: a session whose peer vanished without a FIN still ends within seconds
            keepalives=1, keepalives_idle=5, keepalives_interval=2, keepalives_count=3)
        conn = await asyncio.wait_for(connect, timeout=self.check_timeout_s)
        try:
            while True:
                if self._leader:
                    # Holding the lock: only prove the session is alive (another try would stack
                    # a second hold of the same re-entrant lock).
                    await self._query(conn, "SELECT 1", ())
                else:
                    got = await self._query(conn, "SELECT pg_try_advisory_lock(%s)", (self.key,))
                    self._set(bool(got))
                await asyncio.sleep(self.retry_s)
        finally:
            self._set(False)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(), timeout=self.check_timeout_s)

    async def _query(self, conn, sql: str, params: tuple):
        async def run():
            cursor = await conn.execute(sql, params)
            return (await cursor.fetchone())[0]

        return await asyncio.wait_for(run(), timeout=self.check_timeout_s)


def leadership_for(db: str | Path, *, retry_s: float = 1.0) -> Leadership:
    """The leadership an exchange on `db` needs: a lock for PostgreSQL, none for SQLite."""
    if is_postgres_url(db):
        return AdvisoryLockLeader(str(db), retry_s=retry_s)
    return SoleLeader()
