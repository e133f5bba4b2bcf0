"""A hard time limit for work that may not finish (sympy's simplify): run it in a child process
and kill the child when the time is up.

A thread cannot be stopped, and a runaway simplify would hold the GIL of a resources server; a
process can be killed. Children are spawned (never forked from a threaded server), started once
and reused; a child that timed out is killed and replaced on the next call.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

MAX_IDLE_CHILDREN = 2
"""Children kept warm between calls; more are started while calls overlap and stopped after."""
START_TIMEOUT_S = 120.0
"""How long a new child may take to import its modules (not counted against a call's limit)."""


class CallTimeout(TimeoutError):
    """The call ran past its limit; its child process was killed."""


class ChildError(RuntimeError):
    """The function raised in the child, or the child died; the message says what."""


def _child_main(conn, preload: tuple[str, ...]) -> None:
    import importlib

    for name in preload:
        importlib.import_module(name)
    conn.send(("ready", None))
    while True:
        try:
            fn, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            conn.send(("ok", fn(*args)))
        except BaseException as exc:  # everything goes back to the parent as data
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class _Child:
    def __init__(self, preload: tuple[str, ...]):
        ctx = multiprocessing.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_child_main, args=(theirs, preload), daemon=True,
                                name="rollmarket-verifier-child")
        self.proc.start()
        theirs.close()
        if not self.conn.poll(START_TIMEOUT_S):
            self.kill()
            raise ChildError(f"the child did not start in {START_TIMEOUT_S:g}s")
        self.conn.recv()

    def call(self, fn: Callable[..., Any], args: tuple, timeout_s: float) -> Any:
        self.conn.send((fn, args))
        if not self.conn.poll(timeout_s):
            self.kill()
            raise CallTimeout(f"{getattr(fn, '__name__', fn)} ran past {timeout_s:g}s")
        status, value = self.conn.recv()
        if status != "ok":
            raise ChildError(value)
        return value

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


_idle: list[_Child] = []
_lock = threading.Lock()


def call_in_child(fn: Callable[..., Any], args: tuple, *, timeout_s: float) -> Any:
    """`fn(*args)` in a child process, killed after `timeout_s` seconds (CallTimeout).

    `fn` must be a module-level function and `args` picklable. Raises ChildError if `fn` raised
    or the child died.
    """
    with _lock:
        child = _idle.pop() if _idle else None
    if child is not None and not child.proc.is_alive():
        child.kill()
        child = None
    if child is None:
        child = _Child((fn.__module__,))
    try:
        value = child.call(fn, args, timeout_s)
    except CallTimeout:
        raise
    except (EOFError, OSError, BrokenPipeError) as exc:
        child.kill()
        raise ChildError(f"the child process died: {type(exc).__name__}") from None
    except ChildError:
        _release(child)
        raise
    _release(child)
    return value


def _release(child: _Child) -> None:
    with _lock:
        if len(_idle) < MAX_IDLE_CHILDREN:
            _idle.append(child)
            return
    child.kill()
