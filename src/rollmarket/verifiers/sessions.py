"""Sessions of a resources server: one task's workspace, tool state and recorded calls per cookie.

A session owns a `task_workspace` (a private copy of its task's files) and the ToolContext its
tools run in, and records every tool call made through it, so that /verify can score the calls a
run made without the client sending them back. Sessions expire after an idle TTL, and the least
recently used one is closed when seeding would pass `max_sessions`. A session closed while a call
is still running keeps its workspace until that call returns.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from ..contracts import TaskSpec, ToolCallRecord

log = logging.getLogger(__name__)

SESSION_COOKIE = "rollmarket_session"
SESSION_HEADER = "x-rollmarket-session"
"""Clients without a cookie jar send the session id here; it wins over the cookie."""
CALL_ID_HEADER = "x-rollmarket-call-id"
"""Optional on a tool call: the model's call id, kept in the recorded ToolCallRecord."""


@dataclass(eq=False)
class Session:
    """One client's session. `context` is the agents' ToolContext (workdir + state)."""

    id: str
    task: TaskSpec | None
    context: Any
    workspace: AbstractContextManager | None
    max_calls: int
    created: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    calls: list[ToolCallRecord] = field(default_factory=list)
    unrecorded_calls: int = 0
    closed: bool = False
    _active: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def tools(self) -> list[str] | None:
        """The tools this session may call; None means every tool the server has."""
        return list(self.task.tools) if self.task is not None and self.task.tools else None

    def record(self, call: ToolCallRecord) -> None:
        with self._lock:
            if len(self.calls) < self.max_calls:
                self.calls.append(call)
            else:
                self.unrecorded_calls += 1

    def recorded(self) -> list[ToolCallRecord]:
        with self._lock:
            return list(self.calls)

    def enter(self) -> bool:
        """Mark a call in flight; False if the session is already closed."""
        with self._lock:
            if self.closed:
                return False
            self._active += 1
            self.last_used = time.monotonic()
            return True

    def leave(self) -> None:
        with self._lock:
            self._active -= 1
            self.last_used = time.monotonic()
            done = self.closed and self._active == 0
        if done:
            self._cleanup()

    def close(self) -> None:
        """Close now, or when the last call in flight returns; idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            idle = self._active == 0
        if idle:
            self._cleanup()

    def _cleanup(self) -> None:
        workspace, self.workspace = self.workspace, None
        if workspace is not None:
            try:
                workspace.__exit__(None, None, None)
            except Exception:  # a workspace that cannot be removed must not take the server down
                log.exception("could not remove the workspace of session %s", self.id)


class SessionStore:
    """Every open session by id. Thread-safe: routes run on the event loop and in worker threads."""

    def __init__(self, *, ttl_s: float, max_sessions: int, max_calls: int, open_workspace):
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.max_calls = max_calls
        self._open_workspace = open_workspace
        """files -> a context manager yielding a ToolContext (agents.workspace.task_workspace)."""
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def open(self, task: TaskSpec | None) -> Session:
        """A new session with its own workspace (blocking: it writes the task's files)."""
        workspace = self._open_workspace(dict(task.files) if task is not None else {})
        context = workspace.__enter__()
        session = Session(id=secrets.token_urlsafe(24), task=task, context=context, workspace=workspace,
                          max_calls=self.max_calls)
        evicted: list[Session] = []
        with self._lock:
            evicted += self._expired_locked()
            while len(self._sessions) >= self.max_sessions:
                oldest = min(self._sessions.values(), key=lambda s: s.last_used)
                evicted.append(self._sessions.pop(oldest.id))
            self._sessions[session.id] = session
        for old in evicted:
            old.close()
        return session

    def get(self, session_id: str) -> Session | None:
        """The open session with this id, or None (unknown, closed or expired)."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                return None
            now = time.monotonic()
            if now - session.last_used > self.ttl_s and not session._active:
                del self._sessions[session_id]
            else:
                session.last_used = now
                return session
        session.close()
        return None

    def close(self, session_id: str) -> bool:
        with self._lock:
            session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        session.close()
        return True

    def reap(self) -> int:
        """Close every expired session; how many were closed."""
        with self._lock:
            expired = self._expired_locked()
        for session in expired:
            session.close()
        return len(expired)

    def close_all(self) -> None:
        with self._lock:
            sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            session.close()

    def _expired_locked(self) -> list[Session]:
        now = time.monotonic()
        expired = [s for s in self._sessions.values() if now - s.last_used > self.ttl_s and not s._active]
        for session in expired:
            del self._sessions[session.id]
        return expired
