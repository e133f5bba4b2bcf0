"""A throwaway PostgreSQL cluster for the tests: Debian's server binaries, a temporary data
directory, loopback only.

`make postgres` installs Debian's `postgresql` package; nothing here downloads. PostgreSQL refuses
to run as root, so as root the cluster belongs to the `postgres` user (runuser), as anyone else it
belongs to the caller. Each test that only needs a database takes a fresh one from the session's
cluster (`postgres_url` in conftest.py); a test that restarts or kills PostgreSQL starts its own
`Cluster`.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL server binaries on this machine: run `make postgres`."""


def server_bin() -> Path:
    """The directory of Debian's PostgreSQL server binaries (initdb, pg_ctl, postgres)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if found:
        return Path(found[-1]).parent
    on_path = shutil.which("initdb")
    if on_path:
        return Path(on_path).parent
    raise PostgresUnavailable("PostgreSQL's initdb was not found: run `make postgres` (Debian's postgresql)")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Cluster:
    """One PostgreSQL cluster in a temporary directory, listening on 127.0.0.1:`port`."""

    def __init__(self, root: Path | None = None):
        self.bin = server_bin()
        self.root = Path(root or tempfile.mkdtemp(prefix="rollmarket-pg-"))
        self.data = self.root / "data"
        self.sockets = self.root / "sockets"
        self.log = self.root / "postgres.log"
        self.port = _free_port()
        self._as_postgres = os.geteuid() == 0

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        command = [str(self.bin / args[0]), *args[1:]]
        if self._as_postgres:
            command = ["runuser", "-u", "postgres", "--", *command]
        return subprocess.run(command, check=check, capture_output=True, text=True)

    def init(self) -> Cluster:
        self.sockets.mkdir(parents=True, exist_ok=True)
        self.log.touch()
        if self._as_postgres:
            shutil.chown(self.root, "postgres")
            shutil.chown(self.sockets, "postgres")
            shutil.chown(self.log, "postgres")
        # trust on loopback: the cluster lives for one test session and listens on 127.0.0.1 only.
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                  "--no-sync")
        return self

    def start(self) -> Cluster:
        # fsync stays on: the durability tests kill PostgreSQL and count on what it acknowledged.
        options = (f"-k {self.sockets} -p {self.port} -c listen_addresses=127.0.0.1 "
                   "-c max_connections=300 -c shared_buffers=64MB")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "-t", "120", "start")
        return self

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "120", "stop", check=False)

    def restart(self) -> None:
        self.stop()
        self.start()

    def kill(self) -> None:
        """kill -9 the postmaster (a crash: what was not committed is gone, what was is kept)."""
        pid_file = self.data / "postmaster.pid"
        pid = int(pid_file.read_text().splitlines()[0])
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def create_database(self, name: str | None = None) -> str:
        """A new empty database; its URL."""
        name = name or f"t_{uuid.uuid4().hex[:12]}"
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", name)
        return self.url(name)

    def destroy(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self.init().start()

    def __exit__(self, *exc) -> None:
        self.destroy()
