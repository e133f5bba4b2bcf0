"""Helpers for starting services on loopback: a free port, and waiting for `/healthz`."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
