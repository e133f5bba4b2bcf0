"""Group commit on SQLite: one writer thread turns many small writes into few transactions.

The exchange's store and the proxy's capture store both keep their state in one SQLite file written
by a single thread: requests queue operations, the thread takes every operation waiting (up to a
batch limit) and runs them in one transaction, each inside its own savepoint so one failing
operation rolls back only its own writes. Callers are answered after COMMIT, so an answered write is
durable. This module holds the parts both share: the connection settings, the batching of the
queue, and the transaction with its savepoints.
"""

from __future__ import annotations

import queue
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any


def connect(path: Path, synchronous: str, *, readonly: bool = False, foreign_keys: bool = False) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are explicit) usable from any thread, rows as
    `sqlite3.Row`; writers get WAL and the given `synchronous` level, readers `query_only`."""
    conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=30)
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA busy_timeout = 30000")
    if readonly:
        conn.execute("PRAGMA query_only = 1")
    else:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute(f"PRAGMA synchronous = {synchronous}")
        if foreign_keys:
            conn.execute("PRAGMA foreign_keys = ON")
    return conn


def batches(waiting: queue.SimpleQueue, batch_max: int, stop: object) -> Iterator[list]:
    """What `waiting` holds, a batch at a time: block for the first item, then take what else is
    already waiting, up to `batch_max`. Ends at `stop`, after yielding the items queued before it."""
    while True:
        item = waiting.get()
        if item is stop:
            return
        batch = [item]
        while len(batch) < batch_max:
            try:
                item = waiting.get_nowait()
            except queue.Empty:
                break
            if item is stop:
                yield batch
                return
            batch.append(item)
        yield batch


def commit_each(conn: sqlite3.Connection, operations: Sequence[Callable[[sqlite3.Connection], Any]], *,
                kept: Callable[[BaseException], BaseException | None] = lambda exc: None,
                ) -> list[tuple[Any, BaseException | None]]:
    """Run `operations` in one transaction, each in its own savepoint; (result, error) per operation.

    An operation that raises has its own writes rolled back, unless `kept(error)` returns the error
    to answer with, in which case its writes stay (the exchange refuses a request yet keeps its
    audit record). If the transaction itself fails, it is rolled back whole and the error raised:
    nothing of the batch was written."""
    outcomes: list[tuple[Any, BaseException | None]] = []
    try:
        conn.execute("BEGIN IMMEDIATE")
        for operation in operations:
            conn.execute("SAVEPOINT op")
            try:
                result = operation(conn)
            except BaseException as exc:  # noqa: BLE001 - every error is the operation's answer
                answer = kept(exc)
                if answer is None:
                    conn.execute("ROLLBACK TO op")
                conn.execute("RELEASE op")
                outcomes.append((None, answer if answer is not None else exc))
            else:
                conn.execute("RELEASE op")
                outcomes.append((result, None))
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return outcomes
