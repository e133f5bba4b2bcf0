"""Helpers for starting services on loopback: a free port, claiming a port before a slow start,
waiting for `/healthz`, and serving an app from a thread of this process."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PortUnavailable(OSError):
    """A server cannot listen on (host, port): the address is not this machine's, or the port is
    privileged. `PortInUse` when another process listens there."""

    def __init__(self, host: str, port: int, reason: str):
        super().__init__(f"cannot listen on {host}:{port}: {reason}")
        self.host, self.port, self.reason = host, port, reason


class PortInUse(PortUnavailable):
    """Another process already listens on (host, port)."""


def claim_port(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) with uvicorn's options (SO_REUSEADDR), not yet listening.

    Bind before a slow start (loading a model) so that a taken port fails at once, then hand the
    socket to the server (`uvicorn.Server.run(sockets=[sock])`) or close it just before it binds.
    Raises PortInUse or PortUnavailable."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise PortUnavailable(host, port, f"unknown host ({exc.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUse(host, port, "another process is listening there") from None
        raise PortUnavailable(host, port, exc.strerror or str(exc)) from None
    sock.set_inheritable(True)
    return sock


def check_port(host: str, port: int) -> None:
    """Raise PortInUse / PortUnavailable now if a server could not listen on (host, port).

    For servers that bind their own socket: there is a moment between this check and their bind."""
    claim_port(host, port).close()


def wait_healthy(url: str, proc: subprocess.Popen, *, log: Path | None = None, timeout: float = 30.0,
                 path: str = "/healthz") -> None:
    """Return once `url` + `path` (default `/healthz`) answers 200; raise RuntimeError (with the
    log's tail) if the process exits first or the time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text()[-4000:] if log and log.exists() else ""
            raise RuntimeError(f"the process exited with {proc.returncode} before it was healthy:\n{tail}")
        try:
            if httpx.get(url + path, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    tail = log.read_text()[-4000:] if log and log.exists() else ""
    raise RuntimeError(f"{url} did not become healthy in {timeout:g}s:\n{tail}")


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A `preexec_fn`: the child gets `sig` when the process that starts it dies (Linux
    PR_SET_PDEATHSIG), even by kill -9, so no child outlives its owner. Start the child from a thread
    that lives as long as the owner: the signal follows the forking thread."""
    parent = os.getpid()

    def set_up() -> None:
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:  # the owner died before prctl
            os._exit(1)
    return set_up


class ServerDidNotStart(RuntimeError):
    """An in-thread server's thread ended, or its time ran out, before it was listening."""


class ThreadedServer:
    """An ASGI app served by uvicorn from a thread of this process, on loopback.

    For servers that live inside another command (the local exchange of `train --local`, a
    worker's embedded model server, the reference trainer's sampler): ``start()`` returns once
    uvicorn listens and raises ServerDidNotStart otherwise; ``stop()`` asks it to exit and joins."""

    def __init__(self, app, port: int, *, name: str, host: str = "127.0.0.1"):
        import uvicorn  # the servers' dependency, not this module's other callers'

        self.name, self.port = name, port
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                    access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True, name=name)

    def start(self, timeout: float = 60.0) -> "ThreadedServer":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise ServerDidNotStart(f"the {self.name} did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=timeout)
