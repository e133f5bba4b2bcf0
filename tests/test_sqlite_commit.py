"""Group commit (sqlite_commit.py), the part the exchange's store and the proxy's capture store share,
on a real SQLite file: what each operation wrote is read back by a second connection."""

from __future__ import annotations

import queue
import sqlite3

import pytest

from rollmarket.sqlite_commit import batches, commit_each, connect


class Kept(Exception):
    """Refuse, yet keep what was written (the exchange's Refusal)."""


def _rows(path) -> list[str]:
    with sqlite3.connect(path) as other:
        return [r[0] for r in other.execute("SELECT v FROM t ORDER BY v")]


def _insert(value: str, fail: BaseException | None = None):
    def operation(conn):
        conn.execute("INSERT INTO t VALUES (?)", (value,))
        if fail is not None:
            raise fail
        return value
    return operation


def test_a_failing_operation_loses_only_its_own_writes(tmp_path):
    path = tmp_path / "db.sqlite"
    conn = connect(path, "FULL")
    conn.execute("CREATE TABLE t (v TEXT PRIMARY KEY)")
    refused = Kept("refused")
    outcomes = commit_each(conn, [_insert("a"), _insert("b", ValueError("bad")), _insert("c", Kept("x")),
                                  _insert("a")], kept=lambda exc: refused if isinstance(exc, Kept) else None)
    assert outcomes[0] == ("a", None)
    assert isinstance(outcomes[1][1], ValueError)
    assert outcomes[2] == (None, refused)  # kept: its row stays, and the answer is what kept() gave
    assert isinstance(outcomes[3][1], sqlite3.IntegrityError)  # "a" twice: only the second is undone
    assert _rows(path) == ["a", "c"]


def test_a_failed_commit_writes_nothing_of_its_batch(tmp_path):
    """A deferred foreign key is checked at COMMIT: the batch's transaction fails as a whole, is
    rolled back, and the error reaches the caller (who answers every operation of the batch with it)."""
    path = tmp_path / "db.sqlite"
    conn = connect(path, "FULL", foreign_keys=True)
    conn.executescript("CREATE TABLE t (v TEXT PRIMARY KEY);"
                       "CREATE TABLE parent (id TEXT PRIMARY KEY);"
                       "CREATE TABLE child (pid TEXT REFERENCES parent (id) DEFERRABLE INITIALLY DEFERRED);")
    commit_each(conn, [_insert("before")])

    def orphan(c):
        c.execute("INSERT INTO child VALUES ('nobody')")

    with pytest.raises(sqlite3.IntegrityError):
        commit_each(conn, [_insert("x"), orphan, _insert("y")])
    assert not conn.in_transaction
    assert _rows(path) == ["before"]
    with sqlite3.connect(path) as other:
        assert other.execute("SELECT count(*) FROM child").fetchone()[0] == 0


def test_batches_take_what_waits_up_to_the_limit_and_end_at_stop():
    stop = object()
    waiting: queue.SimpleQueue = queue.SimpleQueue()
    for item in [1, 2, 3, 4, 5, stop, 6]:
        waiting.put(item)
    assert list(batches(waiting, 2, stop)) == [[1, 2], [3, 4], [5]]
    assert waiting.get_nowait() == 6  # nothing after stop was taken
