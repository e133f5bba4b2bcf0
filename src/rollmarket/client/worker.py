"""WorkerClient: what a rollout worker on any host uses to talk to the exchange."""

from __future__ import annotations

from collections.abc import Sequence

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ..contracts import (
    FailureKind,
    FailureReport,
    HeartbeatReply,
    LeaseGrant,
    ReloadAck,
    ReloadStatus,
    RolloutLease,
    SampleGroup,
    SubmissionReceipt,
    Trajectory,
    WorkerHeartbeat,
    WorkerManifest,
    WorkerRegistration,
)
from ..gate.integrity import sign_hash
from .errors import ExchangeError
from .http import HttpClient, Wire


class WorkerClient:
    """One worker's session with an exchange (`url`: one base URL, or several replicas' — a list or
    one string separated by commas — among which it fails over).

    >>> client = WorkerClient("http://127.0.0.1:8470")
    >>> client.register(manifest)          # keeps the returned token
    >>> grant = client.lease(wait_s=5)
    >>> client.submit(client.group_for(grant, trajectories))
    """

    def __init__(self, url: str | Sequence[str], token: str | None = None, *, manifest: WorkerManifest | None = None,
                 signing_key: Ed25519PrivateKey | None = None, timeout: float = 60.0, retries: int = 4,
                 wire: Wire = "msgpack", transport: httpx.BaseTransport | None = None):
        self.http = HttpClient(url, token, timeout=timeout, retries=retries, wire=wire, transport=transport)
        self.manifest = manifest
        self.signing_key = signing_key
        self.loaded_version: int | None = None
        self.loaded_fingerprint: str | None = None

    @property
    def worker_id(self) -> str:
        return self.registered().worker_id

    def registered(self) -> WorkerManifest:
        """This worker's manifest; an ExchangeError before `register` (or `manifest=`)."""
        if self.manifest is None:
            raise ExchangeError("register first (or pass manifest=) so the client knows its worker id")
        return self.manifest

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "WorkerClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def register(self, manifest: WorkerManifest, *, registration_token: str | None = None) -> WorkerRegistration:
        """Register and keep the bearer token the exchange hands back."""
        headers = {"authorization": f"Bearer {registration_token}"} if registration_token else None
        registration = self.http.call("POST", "/v1/workers/register", body=manifest,
                                      answer=WorkerRegistration, headers=headers)
        self.manifest = manifest
        self.http.token = registration.token
        self.loaded_fingerprint = manifest.engine_fingerprint
        return registration

    def heartbeat(self, *, active_lease_ids: Sequence[str] = (), queue_depth: int = 0,
                  tokens_per_s: float | None = None) -> HeartbeatReply:
        beat = WorkerHeartbeat(worker_id=self.worker_id, loaded_policy_version=self.loaded_version,
                               active_lease_ids=list(active_lease_ids), queue_depth=queue_depth,
                               tokens_per_s=tokens_per_s)
        return self.http.call("POST", "/v1/workers/heartbeat", body=beat, answer=HeartbeatReply, idempotent=True)

    def lease(self, *, wait_s: float = 0.0) -> LeaseGrant:
        """A lease with its job and policy, or `grant.reason` saying why there is none."""
        return self.http.call("POST", "/v1/leases", params={"wait_s": wait_s}, answer=LeaseGrant)

    def group_for(self, grant: LeaseGrant, trajectories: Sequence[Trajectory], *, wall_time_s: float = 0.0,
                  **overrides) -> SampleGroup:
        """A group for `grant` with provenance filled in from the lease and this worker's manifest."""
        if grant.lease is None or grant.job is None or grant.policy is None:
            raise ExchangeError("the grant holds no lease")
        manifest = self.registered()
        req = grant.lease.requirements
        fields = dict(
            job_id=grant.lease.job_id, lease_id=grant.lease.lease_id, worker_id=self.worker_id,
            task_id=grant.job.task.task_id, policy_version=req.policy_version,
            checkpoint_digest=req.checkpoint_digest, tokenizer_hash=req.tokenizer_hash,
            sampling_config_hash=req.sampling_config_hash, engine_name=manifest.engine_name,
            engine_version=manifest.engine_version,
            engine_fingerprint=self.loaded_fingerprint or manifest.engine_fingerprint,
            device_type=manifest.device_type, precision_class=req.precision_class,
            quantization_class=req.quantization_class, trajectories=list(trajectories),
            wall_time_s=wall_time_s,
        )
        fields.update(overrides)
        return SampleGroup(**fields)

    def seal(self, group: SampleGroup) -> SampleGroup:
        """Fill in the content hash (and the signature, when the client holds a key)."""
        if group.content_hash is None:
            group = group.sealed()
        if self.signing_key is not None and group.signature is None:
            digest = group.content_hash
            assert digest is not None  # sealed() fills it in
            group = group.model_copy(update={"signature": sign_hash(digest, self.signing_key)})
        return group

    def submit(self, group: SampleGroup) -> SubmissionReceipt:
        """Submit a group; safe to retry (the exchange answers a resubmission with the same receipt)."""
        return self.http.call("POST", "/v1/groups", body=self.seal(group), answer=SubmissionReceipt,
                              idempotent=True)

    def renew(self, lease_id: str) -> RolloutLease:
        """Extend a lease by another TTL; raises Conflict once it has expired or ended."""
        return self.http.call("POST", f"/v1/leases/{lease_id}/renew", answer=RolloutLease, idempotent=True)

    def fail(self, lease_id: str, kind: FailureKind | str = FailureKind.engine_error, message: str = "",
             *, retryable: bool = True) -> str:
        """Give a lease back; returns the job's new state (queued, failed or expired)."""
        report = FailureReport(kind=FailureKind(kind), message=message, retryable=retryable)
        answer = self.http.call("POST", f"/v1/leases/{lease_id}/fail", body=report)
        return answer["job_state"]

    def ack_reload(self, policy_version: int, checkpoint_digest: str, *, engine_fingerprint: str | None = None,
                   load_seconds: float = 0.0) -> ReloadStatus:
        """Tell the exchange this worker now runs `policy_version`."""
        fingerprint = engine_fingerprint or self.loaded_fingerprint or self.registered().engine_fingerprint
        ack = ReloadAck(worker_id=self.worker_id, policy_version=policy_version,
                        checkpoint_digest=checkpoint_digest, engine_fingerprint=fingerprint,
                        load_seconds=load_seconds)
        status = self.http.call("POST", "/v1/reload-acks", body=ack, answer=ReloadStatus, idempotent=True)
        self.loaded_version = policy_version
        self.loaded_fingerprint = fingerprint
        return status
