"""`rollmarket train --local`: an exchange and real workers inside the trainer's process.

The exchange is the real app (SQLite file in the run directory) on a loopback port; each worker
is the real `AgentWorker` with an `EmbeddedHost` engine at its precision, running in a thread. The
trainer talks to them over HTTP exactly as it would to remote ones, so a local run exercises the
whole path (leases, reload quorums, digests, feedback) at the cost of sharing the CPU.
"""

from __future__ import annotations

import secrets
import threading
import time
from pathlib import Path

import uvicorn

from ..exchange.app import create_app
from ..exchange.settings import ExchangeSettings
from ..localhost import free_port


class LocalCluster:
    """Start with `with LocalCluster(...) as cluster:`; `cluster.url` and `cluster.token` for the trainer."""

    def __init__(self, run_dir: Path, model: str | Path, precisions: list[str], *, max_turns: int = 4,
                 lease_ttl_s: float = 60.0, heartbeat_ttl_s: float = 10.0):
        self.run_dir = run_dir
        self.model = Path(model)
        self.precisions = list(precisions)
        self.max_turns = max_turns
        self.token = secrets.token_urlsafe(24)
        self.settings = ExchangeSettings(db=run_dir / "exchange.db", port=free_port(), trainer_token=self.token,
                                         lease_ttl_s=lease_ttl_s, heartbeat_ttl_s=heartbeat_ttl_s,
                                         reaper_interval_s=0.5, max_lease_wait_s=2.0)
        self.url = f"http://127.0.0.1:{self.settings.port}"
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._server: uvicorn.Server | None = None
        self.workers = []

    def __enter__(self) -> "LocalCluster":
        self._server = uvicorn.Server(uvicorn.Config(create_app(self.settings), host="127.0.0.1",
                                                     port=self.settings.port, log_level="warning",
                                                     access_log=False))
        thread = threading.Thread(target=self._server.run, daemon=True, name="local-exchange")
        thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the in-process exchange did not start")
            time.sleep(0.02)
        self._threads.append(thread)
        try:
            for precision in self.precisions:
                self._start_worker(precision)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start_worker(self, precision: str) -> None:
        from ..worker.host import EmbeddedHost
        from ..worker.runner import AgentWorker, WorkerSettings

        (self.run_dir / "workers").mkdir(exist_ok=True)
        # A fresh id per start: after a crash the dead worker's registration still stands until its
        # heartbeat runs out, and an id can be registered once.
        worker_id = f"local-{precision}-{len(self.workers)}-{secrets.token_hex(2)}"
        settings = WorkerSettings(
            exchange=self.url, worker_id=worker_id, max_steps=self.max_turns, lease_wait_s=1.0, heartbeat_s=1.0,
            events=self.run_dir / "workers" / f"{worker_id}.jsonl",
            rollouts=self.run_dir / "workers" / f"{worker_id}.rollouts.jsonl")
        worker = AgentWorker(settings, EmbeddedHost(self.model, precision))
        self.workers.append(worker)
        thread = threading.Thread(target=worker.run, args=(self._stop,), daemon=True, name=worker_id)
        thread.start()
        self._threads.append(thread)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads[1:]:
            thread.join(timeout=30)
        for worker in self.workers:
            worker.host.close()
        if self._server is not None:
            self._server.should_exit = True
        if self._threads:
            self._threads[0].join(timeout=15)
