"""Shared test helpers: a real exchange process on loopback, and factories for contracts."""

from __future__ import annotations

import hashlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from rollmarket import TrainerClient, WorkerClient
from rollmarket.localhost import free_port, wait_healthy
from rollmarket.contracts import (
    LeaseGrant,
    PolicyManifest,
    RolloutJob,
    SamplingConfig,
    TaskSpec,
    Trajectory,
    WorkerManifest,
)

TRAINER_TOKEN = "test-trainer-token"


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


TOKENIZER = sha("tokenizer")


class ServiceProcess:
    """A service as a child process on a loopback port, started once `GET health` answers 200.

    The one helper every test uses to run a server process: the exchange, `serve-model`, the
    proxy, the resources server and the fake upstream. Its output goes to `log`, whose tail is
    in the error when the process dies or never becomes healthy. `spawn` and `wait` are apart so
    that slow starters (model servers) can load side by side.
    """

    def __init__(self, cmd: list[str], log: Path, port: int, *, health: str = "/healthz",
                 env: dict[str, str] | None = None, cwd: Path | None = None):
        self.cmd, self.log, self.port, self.health = cmd, log, port, health
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None
        self._log_file = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spawn(self) -> "ServiceProcess":
        if self._log_file is not None:
            self._log_file.close()
        self._log_file = open(self.log, "ab")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log_file, stderr=subprocess.STDOUT, env=self.env,
                                     cwd=self.cwd)
        return self

    def wait(self, timeout: float = 30.0) -> "ServiceProcess":
        try:
            wait_healthy(self.url, self.proc, log=self.log, timeout=timeout, path=self.health)
        except BaseException:
            self.kill()  # a server that never became healthy must not outlive the test
            raise
        return self

    def start(self, timeout: float = 30.0) -> "ServiceProcess":
        return self.spawn().wait(timeout)

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


def rollmarket_command(*args: str) -> list[str]:
    """`rollmarket ARGS` run by this interpreter."""
    return [sys.executable, "-m", "rollmarket", *args]


def model_server(model: Path, log: Path, *, precision: str = "bf16", args: tuple[str, ...] = ()) -> ServiceProcess:
    """`rollmarket serve-model` on a free loopback port with one torch thread (not started).

    One thread: on shared CPUs a 2-thread pool collapses under contention (~30x)."""
    port = free_port()
    cmd = rollmarket_command("serve-model", str(model), "--precision", precision, "--device", "cpu",
                             "--port", str(port), "--threads", "1", *args)
    return ServiceProcess(cmd, log, port, env={"OMP_NUM_THREADS": "1"})


@dataclass
class ExchangeProcess:
    """`rollmarket exchange serve` as a child process on a free loopback port."""

    db: Path
    log: Path
    args: list[str] = field(default_factory=list)
    port: int = 0
    proc: subprocess.Popen | None = None
    _service: ServiceProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> "ExchangeProcess":
        self.port = self.port or free_port()
        cmd = rollmarket_command("exchange", "serve", "--db", str(self.db), "--port", str(self.port),
                                 "--trainer-token", TRAINER_TOKEN, "--log-level", "warning", *self.args)
        if self._service is not None:
            self._service.stop()
        self._service = ServiceProcess(cmd, self.log, self.port)
        self._service.spawn()
        self.proc = self._service.proc
        self._service.wait(timeout)
        return self

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs."""
        if self._service is not None:
            self._service.kill()

    def stop(self) -> None:
        if self._service is not None:
            self._service.stop(15)

    def trainer(self, **kwargs) -> TrainerClient:
        return TrainerClient(self.url, TRAINER_TOKEN, **kwargs)


def manifest(worker_id: str = "w1", **overrides) -> WorkerManifest:
    fields = dict(worker_id=worker_id, engine_name="hf", engine_version="1.0",
                  engine_fingerprint=sha(f"fp-{worker_id}"), precision_classes=["bf16"],
                  supported_tokenizer_hashes=[TOKENIZER], max_context_tokens=8192)
    fields.update(overrides)
    return WorkerManifest(**fields)


def policy(version: int = 0, **overrides) -> PolicyManifest:
    fields = dict(policy_version=version, parent_version=None if version == 0 else version - 1,
                  checkpoint_digest=sha(f"ckpt-{version}"), tokenizer_hash=TOKENIZER,
                  model_config_hash=sha("config"), vocab_size=1000, precision_class="bf16")
    fields.update(overrides)
    return PolicyManifest(**fields)


def job(index: int = 0, version: int = 0, group_size: int = 2, **overrides) -> RolloutJob:
    fields = dict(task=TaskSpec(task_id=f"task-{index}", prompt=f"what is {index}+{index}?",
                                verifier="exact_match", answer=str(2 * index)),
                  policy_version=version, group_size=group_size,
                  sampling_config=SamplingConfig(temperature=1.0, max_tokens=64, seed=index))
    fields.update(overrides)
    return RolloutJob(**fields)


def trajectories(n: int, tokens: int = 16, *, seed: int = 0, prompt: int = 8) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    return [
        Trajectory(
            sample_index=i,
            prompt_token_ids=rng.integers(0, 1000, prompt, dtype=np.int32),
            response_token_ids=rng.integers(0, 1000, tokens, dtype=np.int32),
            logprobs=-rng.random(tokens, dtype=np.float32) * 3,
            action_mask=np.ones(tokens, np.uint8),
            tool_output_mask=np.zeros(tokens, np.uint8),
            reward=float(i % 2),
        )
        for i in range(n)
    ]


def ready_worker(url: str, worker_id: str = "w1", version: int = 0, **manifest_overrides) -> WorkerClient:
    """A registered worker that has acked `version` (which must be published)."""
    client = WorkerClient(url)
    client.register(manifest(worker_id, **manifest_overrides))
    client.ack_reload(version, sha(f"ckpt-{version}"))
    return client


def lease_one(client: WorkerClient, wait_s: float = 5.0) -> LeaseGrant:
    grant = client.lease(wait_s=wait_s)
    assert grant.lease is not None, grant
    return grant


@contextmanager
def served_model(model: Path, log: Path, *, precision: str = "bf16") -> Iterator[str]:
    """`rollmarket serve-model` on a free loopback port with one torch thread; yields its /v1 URL."""
    server = model_server(model, log, precision=precision)
    try:
        server.start(timeout=120)
        yield server.url + "/v1"
    finally:
        server.stop()


# -- database snapshots: bad input changes nothing -------------------------------------------

STATE_TABLES = ("groups", "leases", "jobs", "workers", "policies", "reload_acks", "served",
                "decisions", "feedback", "pool", "fingerprints")
"""Every table that holds exchange state; the audit log is compared separately."""


@dataclass(frozen=True)
class Snapshot:
    tables: dict[str, list[dict]]
    audit: list[tuple]


def snapshot(db: Path) -> Snapshot:
    """Every row of every state table and of the audit log, read from outside the server."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    try:
        tables = {name: [dict(r) for r in conn.execute(f"SELECT * FROM {name} ORDER BY rowid")]
                  for name in STATE_TABLES}
        audit = [tuple(r) for r in conn.execute("SELECT seq, kind, actor, subject, data FROM audit ORDER BY seq")]
    finally:
        conn.close()
    return Snapshot(tables, audit)


FEEDBACK_ALPHA = 0.2
"""The exchange's default --feedback-alpha."""


def _without_rejection_accounting(before: list[dict], after: list[dict], worker_id: str) -> list[dict]:
    """`after`'s worker rows with one gate rejection of `worker_id` undone, after checking that the
    rejection cost that worker exactly one feedback score of 0 (quality *= 1 - alpha)."""
    old = next(row for row in before if row["worker_id"] == worker_id)
    undone = []
    for row in after:
        if row["worker_id"] == worker_id:
            assert row["rejected_count"] == old["rejected_count"] + 1, "a rejection is counted once"
            assert row["quality"] == pytest.approx((1 - FEEDBACK_ALPHA) * old["quality"], rel=1e-12)
            row = {**row, "rejected_count": old["rejected_count"], "quality": old["quality"]}
        undone.append(row)
    return undone


def _without_fingerprint_rejection(before: list[dict], after: list[dict]) -> list[dict]:
    """`after`'s fingerprint rows with one rejection undone: exactly one fingerprint (the
    rejected worker's) took one score of 0, or was first seen with it (from the neutral 0.5)."""
    old = {row["fingerprint"]: row for row in before}
    undone, charged = [], 0
    for row in after:
        was = old.get(row["fingerprint"], {**row, "quality": 0.5, "feedback_count": 0, "rejected_count": 0})
        if row != was:
            charged += 1
            assert row["rejected_count"] == was["rejected_count"] + 1, "a rejection is counted once"
            assert row["quality"] == pytest.approx((1 - FEEDBACK_ALPHA) * was["quality"], rel=1e-12)
            if row["fingerprint"] not in old:
                continue
            row = was
        undone.append(row)
    assert charged == 1, "a rejection is charged to one engine fingerprint"
    return undone


def assert_unchanged(before: Snapshot, after: Snapshot, *, audit: tuple[str, ...] = (),
                     rejected_by: str | None = None) -> list[tuple]:
    """No state table changed and the audit log gained exactly the events of kinds `audit`.

    A gate rejection (`rejected_by`) is allowed one deliberate trace beyond its audit event: it
    counts against the submitting worker's quality and its engine fingerprint's, so that dispatch
    stops preferring a worker that sends bad groups. Nothing else about any worker may change. Returns the new audit rows.
    """
    for name in STATE_TABLES:
        rows = after.tables[name]
        if name == "workers" and rejected_by is not None:
            rows = _without_rejection_accounting(before.tables[name], rows, rejected_by)
        if name == "fingerprints" and rejected_by is not None:
            rows = _without_fingerprint_rejection(before.tables[name], rows)
        assert rows == before.tables[name], f"table {name} changed"
    assert after.audit[:len(before.audit)] == before.audit, "existing audit events changed"
    new = after.audit[len(before.audit):]
    assert [row[1] for row in new] == list(audit), f"unexpected audit events: {new}"
    return new


def last_seen(db: Path, worker_id: str) -> float:
    """When the exchange last handled a call from `worker_id` (its liveness stamp, which every
    heartbeat, lease attempt and renewal moves), read from outside the server."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return conn.execute("SELECT last_heartbeat_at FROM workers WHERE worker_id=?", (worker_id,)).fetchone()[0]
    finally:
        conn.close()


def wait_until(what: str, condition, *, timeout: float = 60.0, every: float = 0.05, tick=None):
    """Poll `condition()` until it is truthy and return its value; call `tick()` between polls.
    Fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        if tick is not None:
            tick()
        time.sleep(every)
