"""Shared test helpers: a real exchange process on loopback, and factories for contracts."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

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
        wait_healthy(self.url, self.proc, log=self.log, timeout=timeout, path=self.health)
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

    def start(self, timeout: float = 30.0) -> "ExchangeProcess":
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
