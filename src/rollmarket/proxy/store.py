"""The capture store: one SQLite file in WAL mode, written by one thread.

The proxy hands each call's draft to `CaptureStore.submit` and goes on. The writer thread drains
whatever drafts are waiting, resolves each one's conversation (header, else the responses table
for a Responses call's `previous_response_id`, else the links table),
builds and validates its `Capture`, stores it as msgpack (token arrays as raw bytes) with the
links its replies open for the next turn, commits the batch once, and only then resolves the
futures. The proxy decides whether a response waits for that future (`ack_after_write`): when
it does, a response the client received is on disk. `close` writes everything submitted before
it returns, so a clean shutdown loses nothing.

Readers (`iter_captures`, `summaries`, the CLI's export) open their own connections; WAL lets them
run beside a live proxy.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import queue
import sqlite3
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..contracts.capture import Capture, ConversationSource
from ..contracts.wire import packb, unpackb
from ..sqlite_commit import batches, commit_each, connect
from .capture import CaptureDraft, build_capture
from .linking import prefix_hash

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
_CHECKPOINT_EVERY_S = 1.0

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS captures (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    capture_id TEXT NOT NULL UNIQUE,
    conversation_id TEXT NOT NULL,
    parent_capture_id TEXT,
    turn_index INTEGER NOT NULL,
    received_at REAL NOT NULL,
    endpoint TEXT NOT NULL,
    stream INTEGER NOT NULL,
    model TEXT,
    status_code INTEGER NOT NULL,
    outcome TEXT NOT NULL,
    n_choices INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    response_tokens INTEGER NOT NULL,
    payload BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS captures_conversation ON captures (conversation_id, seq);
CREATE TABLE IF NOT EXISTS links (
    reply_key TEXT PRIMARY KEY,
    capture_id TEXT NOT NULL,
    choice INTEGER NOT NULL,
    conversation_id TEXT NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS responses (
    response_id TEXT PRIMARY KEY,
    capture_id TEXT NOT NULL,
    choice INTEGER NOT NULL,
    conversation_id TEXT NOT NULL,
    turns TEXT NOT NULL
) WITHOUT ROWID;
"""


def _connect(path: Path, synchronous: str, *, readonly: bool = False) -> sqlite3.Connection:
    return connect(path, synchronous, readonly=readonly)


class _LoopFuture:
    """An asyncio future and its loop, resolved from the writer thread."""

    __slots__ = ("loop", "future")

    def __init__(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future):
        self.loop = loop
        self.future = future


def _resolve(resolved: list) -> None:
    for future, capture, exc in resolved:
        if future.done():
            continue
        if exc is None:
            future.set_result(capture)
        else:
            future.set_exception(exc)


def conversation_of_root(capture_id: str) -> str:
    """A conversation started by this capture is named after it: `cap_ab12..` -> `conv_ab12..`."""
    return "conv_" + capture_id.split("_", 1)[-1]


class CaptureStore:
    """Captures in one SQLite file; `open` before submitting, `close` to flush and stop."""

    _STOP = object()

    def __init__(self, path: Path | str, *, synchronous: str = "NORMAL", batch_max: int = 256,
                 experts_shape: tuple[int, int] | None = None):
        self.path = Path(path)
        self.synchronous = synchronous
        self.batch_max = batch_max
        self.experts_shape = experts_shape
        self.written = 0
        self.failed = 0
        self.batches = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._checkpointer: threading.Thread | None = None
        self._stopping = threading.Event()

    # -- writing ------------------------------------------------------------------------------
    def open(self, settings: dict[str, Any] | None = None) -> None:
        """Create the schema if needed, record the settings, start the writer thread."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = _connect(self.path, self.synchronous)
        try:
            conn.executescript(SCHEMA)
            found = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if found is not None and int(found[0]) != SCHEMA_VERSION:
                raise RuntimeError(f"capture store schema {found[0]} != supported {SCHEMA_VERSION}")
            conn.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            if settings is not None:
                conn.execute("INSERT OR REPLACE INTO meta VALUES ('settings', ?)",
                             (json.dumps(settings, sort_keys=True),))
        finally:
            conn.close()
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="rollmarket-capture-writer", daemon=True)
        self._thread.start()
        self._checkpointer = threading.Thread(target=self._checkpoint_loop, name="rollmarket-capture-checkpoint",
                                              daemon=True)
        self._checkpointer.start()

    def submit(self, draft: CaptureDraft) -> concurrent.futures.Future:
        """Queue a draft; the future resolves to its `Capture` once committed."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((draft, future))
        return future

    def submit_async(self, draft: CaptureDraft) -> asyncio.Future:
        """Queue a draft from the event loop; the asyncio future resolves once committed. The
        futures of one committed batch are resolved together, with one wake-up of the loop."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put((draft, _LoopFuture(loop, future)))
        return future

    def close(self) -> None:
        """Write everything submitted so far, then stop the writer."""
        if self._thread is not None:
            self._queue.put(self._STOP)
            self._thread.join()
            self._thread = None
        if self._checkpointer is not None:
            self._stopping.set()
            self._checkpointer.join()
            self._checkpointer = None

    def _checkpoint_loop(self) -> None:
        """Fold the WAL into the database off the commit path. SQLite would otherwise checkpoint
        inside a commit every ~1000 pages, and an answer waiting for that commit would wait for
        the checkpoint's fsyncs too. PASSIVE never blocks the writer."""
        conn = _connect(self.path, self.synchronous)
        try:
            while not self._stopping.wait(_CHECKPOINT_EVERY_S):
                conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error:
            log.exception("WAL checkpoint failed")
        finally:
            conn.close()

    @property
    def pending(self) -> int:
        return self._queue.qsize()

    def _run(self) -> None:
        conn = _connect(self.path, self.synchronous)
        conn.execute("PRAGMA wal_autocheckpoint = 0")  # the checkpointer thread does it
        try:
            for batch in batches(self._queue, self.batch_max, self._STOP):
                self._write_batch(conn, batch)
        finally:
            conn.close()

    def _insert_logged(self, draft: CaptureDraft):
        def insert(conn: sqlite3.Connection) -> Capture:
            try:
                return self._insert(conn, draft)
            except Exception:
                log.exception("capture of %s could not be stored", draft.endpoint)
                raise
        return insert

    def _write_batch(self, conn: sqlite3.Connection, batch: list) -> None:
        try:
            results = commit_each(conn, [self._insert_logged(draft) for draft, _ in batch])
        except Exception as exc:
            log.exception("capture batch of %d failed; rolled back", len(batch))
            self.failed += len(batch)
            for _, future in batch:
                if isinstance(future, _LoopFuture):
                    future.loop.call_soon_threadsafe(_resolve, [(future.future, None, exc)])
                else:
                    future.set_exception(exc)
            return
        outcomes = [(future, capture, error) for (_, future), (capture, error) in zip(batch, results)]
        self.batches += 1
        # Resolve only after COMMIT: a resolved future means the capture is in the file.
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for future, capture, error in outcomes:
            if error is None:
                self.written += 1
            else:
                self.failed += 1
            if isinstance(future, _LoopFuture):
                by_loop.setdefault(future.loop, []).append((future.future, capture, error))
            elif error is None:
                future.set_result(capture)
            else:
                future.set_exception(error)
        for loop, resolved in by_loop.items():
            try:
                loop.call_soon_threadsafe(_resolve, resolved)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass

    def _insert(self, conn: sqlite3.Connection, draft: CaptureDraft) -> Capture:
        parent = None
        parent_conversation = None
        linked = ConversationSource.prefix
        previous = draft.previous_response_id
        if previous is not None:
            row = conn.execute("SELECT capture_id, choice, conversation_id, turns FROM responses WHERE response_id=?",
                               (previous,)).fetchone()
            if row is not None:
                parent, parent_conversation = (row[0], row[1]), row[2]
                linked = ConversationSource.previous_response
                draft = replace(draft, earlier=json.loads(row[3]))
            else:
                draft = replace(draft, notes=[*draft.notes, f"previous_response_id {previous!r} was not captured "
                                              "here: the earlier turns are not in this capture's messages"])
        messages = draft.messages
        if messages is not None and parent is None:
            key = prefix_hash(messages)
            if key is not None:
                row = conn.execute("SELECT capture_id, choice, conversation_id FROM links WHERE reply_key=?",
                                   (key,)).fetchone()
                if row is not None:
                    parent = (row[0], row[1])
                    parent_conversation = row[2]
        if draft.header_conversation:
            conversation, source = draft.header_conversation, ConversationSource.header
        elif parent_conversation is not None:
            conversation, source = parent_conversation, linked
        else:
            conversation, source = None, ConversationSource.root
        try:
            capture = build_capture(draft, conversation_id=conversation or "pending", source=source, parent=parent,
                                    experts_shape=self.experts_shape)
            if conversation is None:
                capture = capture.model_copy(update={"conversation_id": conversation_of_root(capture.capture_id)})
            payload = packb(capture)
        except Exception as exc:
            # A request the record cannot hold (integers beyond 64 bits, a conversation header
            # longer than an id, ...) must not lose the call: it is recorded without the request.
            reason = str(exc).splitlines()[0][:200]
            log.warning("capture of %s stored without its request: %s", draft.endpoint, reason)
            draft = replace(draft, request=None, header_conversation=None,
                            notes=[*draft.notes, f"request not recorded: {reason}"])
            capture = build_capture(draft, conversation_id="pending", source=ConversationSource.root, parent=None,
                                    experts_shape=self.experts_shape)
            capture = capture.model_copy(update={"conversation_id": conversation_of_root(capture.capture_id)})
            payload = packb(capture)
        conn.execute(
            "INSERT INTO captures (capture_id, conversation_id, parent_capture_id, turn_index, received_at,"
            " endpoint, stream, model, status_code, outcome, n_choices, prompt_tokens, response_tokens, payload)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (capture.capture_id, capture.conversation_id, capture.parent_capture_id, capture.turn_index,
             capture.timings.received_at.timestamp(), capture.endpoint, int(capture.stream),
             capture.upstream_model or capture.model, capture.status_code, capture.outcome.value,
             len(capture.choices), 0 if capture.prompt_token_ids is None else len(capture.prompt_token_ids),
             capture.num_response_tokens, payload),
        )
        for choice, key in draft.reply_keys():
            conn.execute("INSERT OR REPLACE INTO links VALUES (?, ?, ?, ?)",
                         (key, capture.capture_id, choice, capture.conversation_id))
        turns = draft.responses_turns()
        if turns is not None:
            conn.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)",
                         (draft.response_id, capture.capture_id, 0, capture.conversation_id,
                          json.dumps(turns)))
        return capture

    # -- reading ------------------------------------------------------------------------------
    def _reader(self) -> sqlite3.Connection:
        if not self.path.exists():
            raise FileNotFoundError(f"no capture store at {self.path}")
        return _connect(self.path, self.synchronous, readonly=True)

    def iter_captures(self, *, conversation: str | None = None, since_seq: int = 0,
                      limit: int | None = None) -> Iterator[tuple[int, Capture]]:
        """(seq, capture) in the order they were written."""
        sql = "SELECT seq, payload FROM captures WHERE seq > ?"
        args: list[Any] = [since_seq]
        if conversation is not None:
            sql += " AND conversation_id = ?"
            args.append(conversation)
        sql += " ORDER BY seq"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(limit)
        conn = self._reader()
        try:
            for seq, payload in conn.execute(sql, args):
                yield seq, Capture.model_validate(unpackb(payload))
        finally:
            conn.close()

    def get(self, capture_id: str) -> Capture | None:
        conn = self._reader()
        try:
            row = conn.execute("SELECT payload FROM captures WHERE capture_id=?", (capture_id,)).fetchone()
        finally:
            conn.close()
        return None if row is None else Capture.model_validate(unpackb(row[0]))

    def summaries(self, *, limit: int = 50) -> list[dict[str, Any]]:
        """The newest captures, without their payloads (for `rollmarket captures ls`)."""
        conn = self._reader()
        try:
            rows = conn.execute(
                "SELECT seq, capture_id, conversation_id, parent_capture_id, turn_index, received_at, endpoint,"
                " stream, model, status_code, outcome, n_choices, prompt_tokens, response_tokens"
                " FROM captures ORDER BY seq DESC LIMIT ?", (limit,)).fetchall()
        finally:
            conn.close()
        return [dict(row) for row in reversed(rows)]

    def count(self) -> int:
        conn = self._reader()
        try:
            return conn.execute("SELECT count(*) FROM captures").fetchone()[0]
        finally:
            conn.close()
