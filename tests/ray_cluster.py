"""A throwaway Ray head on loopback for tests: `ray start --head --block` in its own session.

Ray binds every interface and advertises the machine's address unless told otherwise; the node IP,
the variable RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (set here for this process and the head, and so for
every child) and ports chosen here keep it on 127.0.0.1. `stop()` ends only the processes of this
head: everything in its session (the raylet's workers and actors included), never `ray stop`,
which would end every Ray on the machine.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rollmarket.localhost import free_port

LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def distinct_free_ports(n: int) -> list[int]:
    """`n` different free loopback ports (free_port alone may hand out one twice: nothing holds it)."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


class RayHead:
    def __init__(self, log: Path, *, num_cpus: int = 2):
        self.log, self.num_cpus = log, num_cpus
        self.port, *self._other_ports = distinct_free_ports(5)
        # Short: Ray's unix sockets live under it and socket paths are limited to ~107 bytes.
        self.temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> "RayHead":
        os.environ.update(LOOPBACK_ENV)
        ray_bin = Path(sys.executable).with_name("ray")
        cmd = [str(ray_bin), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
               "--port", str(self.port), "--num-cpus", str(self.num_cpus), "--include-dashboard", "false",
               "--disable-usage-stats", "--temp-dir", self.temp_dir,
               *(arg for flag, port in zip(("--ray-client-server-port", "--dashboard-agent-listen-port",
                                            "--dashboard-agent-grpc-port", "--metrics-export-port"),
                                           self._other_ports) for arg in (flag, str(port)))]
        offset = self.log.stat().st_size if self.log.exists() else 0  # a reused log's old lines don't count
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, **LOOPBACK_ENV})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"ray start exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            if b"Ray runtime started" in self.log.read_bytes()[offset:]:
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the Ray head did not start in {timeout}s:\n{self.log.read_text()[-3000:]}")

    def session_pids(self) -> list[int]:
        """Every live process of this head's session (the head, GCS, raylet, workers, actors)."""
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == self.proc.pid and fields[0] != "Z":  # field 6 of stat: the session id
                pids.append(int(entry.name))
        return pids

    def stop(self) -> None:
        if self.proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 10.0)):  # `ray start --block` may ignore TERM
            for pid in self.session_pids():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait_s
            while self.session_pids() and time.monotonic() < deadline:
                time.sleep(0.2)
            if not self.session_pids():
                break
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)
