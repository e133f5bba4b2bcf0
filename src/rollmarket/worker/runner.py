"""A real rollout worker: lease a job, run the agent group_size times, verify, submit with provenance.

    register (manifest: engine, numerics, fingerprint, tokenizer) ─► heartbeat thread
    loop:
        lease ─► reload_required?  load the new checkpoint, check its digest, ack
               ─► a job:           run the agent group_size times (renewing the lease),
                                   verify each run, stitch each into a Trajectory,
                                   submit the SampleGroup ─► or report the failure
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from pydantic import BaseModel, Field

from ..client import Conflict, DigestMismatch, ExchangeError, ExchangeUnavailable, Rejected, WorkerClient
from ..contracts import (
    AgentTrajectory,
    FailureKind,
    LeaseGrant,
    NoLeaseReason,
    PolicyManifest,
    TaskSpec,
    VerifyResult,
    WorkerManifest,
)
from ..contracts.base import ID_MAX_LENGTH, ID_PATTERN
from ..contracts.seeds import job_seed
from ..gate.integrity import load_signing_key, public_key_b64
from .heartbeat import Heartbeater, run_renewing
from .host import EngineIdentity, HostError, ReloadRefused, ReloadUnverified

log = logging.getLogger(__name__)


class WorkerSettings(BaseModel):
    """Settings of `rollmarket worker` (saved with its events)."""

    exchange: str = Field("http://127.0.0.1:8470",
                          description="Exchange base URL; several replicas' URLs separated by commas fail over.")
    exchange_wait_s: float = Field(
        300.0, ge=0, description="How long to wait for an exchange that does not answer (at start or "
                                 "later) before giving up.")
    worker_id: str | None = Field(None, description="Worker id (default: <engine>-<precision>-<random>).")
    registration_token: str | None = Field(None, description="Registration token, if the exchange wants one.")
    signing_key: Path | None = Field(
        None, description="ed25519 private key (`rollmarket keys generate`): register its public key and sign "
                          "every group (docs/security.md).")
    max_steps: int = Field(6, ge=1, description="Agent turns per run.")
    max_tokens: int | None = Field(
        None, ge=1, description="Cap on tokens per turn (default: the job's sampling max_tokens).")
    concurrency: int | None = Field(
        None, ge=1, description="Runs of a group in flight at once (default: the whole group).")
    resources_url: str | None = Field(
        None, description="A resources server (`rollmarket verifier serve`) for tools and /verify; "
                          "default: tools and verifiers in this process.")
    agent_url: str | None = Field(
        None, description="An agent server (`rollmarket agent serve`) that runs each sample (POST /run) instead "
                          "of the loop in this process; it must sample from this worker's model server.")
    lease_wait_s: float = Field(2.0, ge=0, description="Long-poll time of a lease request.")
    heartbeat_s: float = Field(1.0, gt=0, description="Seconds between heartbeats.")
    price: float = Field(1.0, ge=0, description="Relative price per 1M tokens (dispatch preference).")
    reload_lag: int = Field(
        0, ge=0, description="Run up to this many policy versions behind the published one before reloading "
                             "(a slow host that reloads every few versions; its groups carry the lag). "
                             "0: reload every version.")
    max_groups: int | None = Field(None, ge=1, description="Stop after this many submitted groups.")
    pool: str | None = Field(
        None, pattern=ID_PATTERN, max_length=ID_MAX_LENGTH,
        description="The pool this worker belongs to, shown on the marketplace (`rollmarket pool` sets it).")
    events: Path | None = Field(None, description="Append one JSON line per event here.")
    rollouts: Path | None = Field(
        None, description="Append every agent run here as an AgentTrajectory JSON line (for "
                          "`rollmarket profile`).")


def manifest_for(identity: EngineIdentity, worker_id: str, price: float, reload_lag: int = 0,
                 pool: str | None = None, public_key: str | None = None) -> WorkerManifest:
    return WorkerManifest(
        worker_id=worker_id, engine_name=identity.engine_name, engine_version=identity.engine_version,
        engine_fingerprint=identity.engine_fingerprint, device_type=identity.device_type,
        precision_classes=[identity.precision], quantization_classes=[identity.quantization],
        supported_tokenizer_hashes=[identity.tokenizer_hash], max_context_tokens=identity.max_context_tokens,
        max_concurrent_groups=1, returns_routed_experts=identity.returns_routed_experts, price_hint=price,
        max_reload_lag=reload_lag, pool=pool, public_key=public_key,
    )


def task_problem(task: TaskSpec) -> str | None:
    """Why a task cannot be run and verified anywhere (unknown verifier, bad verifier args, unsafe
    file paths), or None."""
    from ..agents.workspace import UnsafeTaskPath, check_task_path
    from ..verifiers import VerifierConfigError, get_verifier

    try:
        get_verifier(task.verifier).check(task)
        for path in task.files:
            check_task_path(path)
    except (VerifierConfigError, UnsafeTaskPath) as exc:
        return str(exc)
    return None


class EventLog:
    """One JSON line per thing that happens; also the worker's tallies for its CLI."""

    def __init__(self, path: Path | None, worker_id: str):
        self._file = open(path, "a", buffering=1) if path else None
        self.worker_id = worker_id
        self.listeners: list[Callable[[str, dict], None]] = []

    def __call__(self, event: str, /, **data) -> None:
        if self._file:
            self._file.write(json.dumps({"t": time.time(), "event": event, "worker_id": self.worker_id, **data},
                                        default=str) + "\n")
        for listener in self.listeners:
            listener(event, data)

    def close(self) -> None:
        if self._file:
            self._file.close()


class AgentWorker:
    """One worker process's life on an exchange. `run(stop)` returns when `stop` is set."""

    def __init__(self, settings: WorkerSettings, host, *, events: EventLog | None = None):
        from ..agents import Agent, AgentSettings, ChatModel, LocalToolbox, RemoteToolbox

        self.settings = settings
        self.host = host
        self.identity = host.identity()
        self.worker_id = settings.worker_id or (
            f"{self.identity.model_name}-{self.identity.precision}-{hashlib.sha256(str(time.time_ns()).encode()).hexdigest()[:6]}")
        self.events = events or EventLog(settings.events, self.worker_id)
        self.toolbox = RemoteToolbox(settings.resources_url) if settings.resources_url else LocalToolbox()
        self._agent_settings = AgentSettings(max_steps=settings.max_steps)
        self._chat_model = ChatModel
        self._agent_cls = Agent
        self.agent = self._make_agent()
        self.signing_key = load_signing_key(settings.signing_key) if settings.signing_key else None
        self.client = WorkerClient(settings.exchange, retries=8, signing_key=self.signing_key)
        self.submitted = 0
        self._rollouts = open(settings.rollouts, "a", buffering=1) if settings.rollouts else None
        self._rollouts_lock = threading.Lock()

    def _make_agent(self):
        if self.settings.agent_url:
            from ..agents.remote import RemoteAgent

            return RemoteAgent(self.settings.agent_url)
        return self._agent_cls(self._chat_model(self.host.url, self.identity.model_name), self.toolbox,
                               self._agent_settings, verify=self._verify)

    def _verify(self, task: TaskSpec, run: AgentTrajectory) -> VerifyResult:
        if self.settings.resources_url:
            from ..verifiers.client import ResourcesClient

            with ResourcesClient(self.settings.resources_url) as client:
                return client.verify_trajectory(task, run)
        from ..verifiers import verify_trajectory

        return verify_trajectory(task, run)

    # -- policy reloads -------------------------------------------------------------------------

    def reload(self, policy: PolicyManifest) -> bool:
        """Load `policy`, check its digest and ack; False (and an event) when it cannot."""
        started = time.perf_counter()
        try:
            identity = self.host.load(policy)
        except ReloadUnverified as exc:  # the server did not really load it: never acked
            check = asdict(exc.check) if exc.check else None
            self.events("reload_unverified", version=policy.policy_version, error=str(exc), canary=check)
            return False
        except (ReloadRefused, HostError) as exc:
            self.events("reload_refused", version=policy.policy_version, error=str(exc))
            return False
        seconds = time.perf_counter() - started
        moved = identity.checkpoint_digest != self.identity.checkpoint_digest
        self.identity = identity
        if moved:
            self.agent = self._make_agent()  # a new loopback server (and model name) for the new weights
        try:
            status = self.client.ack_reload(policy.policy_version, identity.checkpoint_digest,
                                            engine_fingerprint=identity.engine_fingerprint, load_seconds=seconds)
        except DigestMismatch as exc:
            self.events("reload_violation", version=policy.policy_version, error=str(exc))
            return False
        check = getattr(self.host, "last_check", None)
        self.events("reload_acked", version=policy.policy_version, aligned=status.aligned,
                    load_s=round(seconds, 3), fingerprint=identity.engine_fingerprint,
                    canary=asdict(check) if check else None)
        return True

    # -- one lease --------------------------------------------------------------------------------

    def work(self, grant: LeaseGrant, beats: Heartbeater, stop: threading.Event) -> None:
        from ..agents import Sampling, StitchError, to_trajectory

        lease, job = grant.lease, grant.job
        config = job.sampling_config
        max_tokens = min(config.max_tokens, self.settings.max_tokens or config.max_tokens)
        sampling = Sampling(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
                            max_tokens=max_tokens, seed=config.seed if config.seed is not None else job_seed(job.job_id),
                            stop=tuple(config.stop))
        self.events("leased", lease_id=lease.lease_id, job_id=job.job_id, task_id=job.task.task_id,
                    version=lease.policy_version, group_size=job.group_size)
        started = time.perf_counter()
        problem = task_problem(job.task)
        if problem:  # no worker can run this task: fail the job for good instead of bouncing it around
            self._fail(lease.lease_id, FailureKind.other, f"bad task: {problem}", retryable=False)
            return

        def should_stop() -> bool:
            return stop.is_set() or lease.lease_id in beats.cancelled

        try:
            runs = run_renewing(self.client, lease.lease_id, self._lease_ttl, lambda: self.agent.run_group(
                job.task, job.group_size, sampling, concurrency=self.settings.concurrency, should_stop=should_stop))
        except Exception as exc:  # one bad job never takes the worker down
            log.exception("agent group failed")
            self._fail(lease.lease_id, FailureKind.engine_error, f"{type(exc).__name__}: {exc}", retryable=True)
            return
        self._save_runs(runs, lease.lease_id, lease.policy_version)
        foreign = sorted({r.model for r in runs if r.steps and r.model != self.identity.model_name})
        if foreign:  # an agent server on another model server: its tokens are not this worker's policy
            self._fail(lease.lease_id, FailureKind.other, f"runs sampled from {', '.join(foreign)}, not this "
                       f"worker's model {self.identity.model_name}", retryable=True)
            return
        if should_stop():
            self._fail(lease.lease_id, FailureKind.cancelled, "stopped while running", retryable=True)
            return
        try:
            trajectories = [to_trajectory(run) for run in runs]
        except StitchError as exc:
            errors = "; ".join(sorted({r.error for r in runs if r.error})) or str(exc)
            self._fail(lease.lease_id, FailureKind.engine_error, errors[:3900], retryable=True)
            return
        group = self.client.group_for(grant, trajectories, wall_time_s=time.perf_counter() - started)
        try:
            receipt = self.client.submit(group)
        except Rejected as exc:
            self.events("rejected", lease_id=lease.lease_id, reasons=exc.reasons)
            self._fail(lease.lease_id, FailureKind.other, f"rejected: {', '.join(exc.reasons)}", retryable=True)
            return
        except (Conflict, ExchangeError) as exc:
            self.events("submit_error", lease_id=lease.lease_id, error=str(exc))
            return
        self.submitted += 1
        rewards = [t.reward for t in trajectories]
        self.events("submitted", lease_id=lease.lease_id, group_id=receipt.group_id, tier=receipt.tier.value,
                    task_id=job.task.task_id, rewards=rewards, passed=[bool(r.verification and r.verification.passed)
                                                                       for r in runs],
                    terminal=[r.terminal_reason.value for r in runs], tokens=group.num_response_tokens,
                    seconds=round(time.perf_counter() - started, 3))

    def _fail(self, lease_id: str, kind: FailureKind, message: str, *, retryable: bool) -> None:
        try:
            state = self.client.fail(lease_id, kind, message, retryable=retryable)
        except ExchangeError as exc:
            state = f"unreported ({exc})"
        self.events("failed", lease_id=lease_id, kind=kind.value, message=message[:500], job_state=state)

    def _save_runs(self, runs: list[AgentTrajectory], lease_id: str, version: int) -> None:
        if self._rollouts is None:
            return
        with self._rollouts_lock:
            for run in runs:
                self._rollouts.write(run.model_dump_json() + "\n")

    # -- the whole life ---------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> int:
        """Register, then lease and work until `stop` is set. While the exchange does not answer it
        waits with backoff (one log line every few seconds); after `exchange_wait_s` of silence it
        raises ExchangeUnreachable."""
        manifest = manifest_for(self.identity, self.worker_id, self.settings.price, self.settings.reload_lag,
                                self.settings.pool,
                                public_key=public_key_b64(self.signing_key) if self.signing_key else None)
        self.client.http.wait_for_exchange(self.settings.exchange_wait_s, stop=stop)
        if stop.is_set():
            return 0
        registration = self.client.register(manifest, registration_token=self.settings.registration_token)
        self._lease_ttl = registration.lease_ttl_s
        self.events("registered", manifest=manifest.model_dump(mode="json"))
        beat_client = WorkerClient(self.settings.exchange, registration.token, manifest=manifest, retries=0)
        beats = Heartbeater(beat_client, self.settings.heartbeat_s)
        beats.start()
        if registration.policy is not None:
            self.reload(registration.policy)
        try:
            while not stop.is_set():
                if self.settings.max_groups and self.submitted >= self.settings.max_groups:
                    break
                try:
                    grant = self.client.lease(wait_s=self.settings.lease_wait_s)
                except ExchangeUnavailable:
                    self.client.http.wait_for_exchange(self.settings.exchange_wait_s, stop=stop)
                    continue
                if grant.reason is NoLeaseReason.reload_required and grant.policy is not None:
                    if not self.reload(grant.policy):
                        stop.wait(1.0)
                    beats.reload_required.clear()
                    continue
                if grant.lease is None:
                    continue
                beats.active_leases.add(grant.lease.lease_id)
                try:
                    self.work(grant, beats, stop)
                finally:
                    beats.active_leases.discard(grant.lease.lease_id)
        finally:
            beats.stopped.set()
            self.events("stopped", submitted=self.submitted)
            if self._rollouts:
                self._rollouts.close()
        return 0
