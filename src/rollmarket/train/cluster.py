"""`rollmarket train --local`: an exchange and real workers inside the trainer's process.

The exchange is the real app (SQLite file in the run directory) on a loopback port; each worker
is the real `AgentWorker` with an `EmbeddedHost` engine at its precision, running in a thread. The
trainer talks to them over HTTP exactly as it would to remote ones, so a local run exercises the
whole path (leases, reload quorums, digests, feedback) at the cost of sharing the CPU.
"""

from __future__ import annotations

import secrets
import threading
from pathlib import Path

from ..exchange.app import create_app
from ..exchange.settings import ExchangeSettings
from ..gate import GateConfig
from ..localhost import ThreadedServer, free_port
from .config import WorkerSpec


def arrival_gate(max_lag: int) -> GateConfig:
    """The exchange's arrival triage for a run whose own trainer judges every group it fetches.

    The triage sorts groups into tiers by lag alone, before any trainer scored them; groups it sends
    to the replay or quarantine tier are never fetched as fresh, so the trainer's gate would not see
    them at all. With its lag thresholds at `max_lag` (no lag in the run can pass it) every group
    reaches the trainer's gate, and its decision is the one recorded.
    """
    return GateConfig(replay_lag=max_lag, max_policy_lag=max_lag)


class LocalCluster:
    """Start with `with LocalCluster(...) as cluster:`; `cluster.url` and `cluster.token` for the trainer.

    `workers` holds one entry per worker: a precision, or a WorkerSpec (``bf16@lag3``: a worker that
    runs up to 3 versions behind the published policy before it reloads).
    """

    def __init__(self, run_dir: Path, model: str | Path, workers: list[str | WorkerSpec], *, max_turns: int = 4,
                 lease_ttl_s: float = 60.0, heartbeat_ttl_s: float = 10.0, gate: GateConfig | None = None):
        self.run_dir = run_dir
        self.model = Path(model)
        self.specs = [w if isinstance(w, WorkerSpec) else WorkerSpec.parse(w) for w in workers]
        self.max_turns = max_turns
        self.token = secrets.token_urlsafe(24)
        self.settings = ExchangeSettings(db=run_dir / "exchange.db", port=free_port(), trainer_token=self.token,
                                         lease_ttl_s=lease_ttl_s, heartbeat_ttl_s=heartbeat_ttl_s,
                                         reaper_interval_s=0.5, max_lease_wait_s=2.0, gate=gate or GateConfig())
        self.url = f"http://127.0.0.1:{self.settings.port}"
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._server: ThreadedServer | None = None
        self.workers = []

    def __enter__(self) -> "LocalCluster":
        self._server = ThreadedServer(create_app(self.settings), self.settings.port, name="local exchange").start()
        try:
            for spec in self.specs:
                self._start_worker(spec)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start_worker(self, spec: WorkerSpec) -> None:
        from ..worker.host import EmbeddedHost
        from ..worker.runner import AgentWorker, WorkerSettings

        (self.run_dir / "workers").mkdir(exist_ok=True)
        # A fresh id per start: after a crash the dead worker's registration still stands until its
        # heartbeat runs out, and an id can be registered once.
        lag = f"-lag{spec.reload_lag}" if spec.reload_lag else ""
        worker_id = f"local-{spec.precision}{lag}-{len(self.workers)}-{secrets.token_hex(2)}"
        settings = WorkerSettings(
            exchange=self.url, worker_id=worker_id, max_steps=self.max_turns, lease_wait_s=1.0, heartbeat_s=1.0,
            reload_lag=spec.reload_lag, events=self.run_dir / "workers" / f"{worker_id}.jsonl",
            rollouts=self.run_dir / "workers" / f"{worker_id}.rollouts.jsonl")
        worker = AgentWorker(settings, EmbeddedHost(self.model, spec.precision))
        self.workers.append(worker)
        thread = threading.Thread(target=worker.run, args=(self._stop,), daemon=True, name=worker_id)
        thread.start()
        self._threads.append(thread)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:  # the workers' threads
            thread.join(timeout=30)
        for worker in self.workers:
            worker.host.close()
        if self._server is not None:
            self._server.stop()
