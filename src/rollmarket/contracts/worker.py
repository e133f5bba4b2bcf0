"""Who a rollout worker is, what it can run, and how it says it is alive."""

from __future__ import annotations

from pydantic import Field

from .base import CONTRACT_VERSION, Identifier, Record, UtcDatetime, utc_now
from .policy import PolicyManifest


class WorkerManifest(Record):
    """Declared once at registration; dispatch matches jobs against it."""

    worker_id: Identifier
    engine_name: str = Field(min_length=1, max_length=64, description="e.g. vllm, sglang, hf.")
    engine_version: str = Field(min_length=1, max_length=64)
    engine_fingerprint: str = Field(
        min_length=1, max_length=128,
        description="sha256 of rounded logprobs on the canonical prompt set (see DESIGN.md).",
    )
    contract_version: str = Field(default=CONTRACT_VERSION)
    device_type: str = Field(default="cpu", max_length=64, description="e.g. cpu, h100, mi300x.")
    device_count: int = Field(default=1, ge=0)
    precision_classes: list[str] = Field(min_length=1, description="Numerics it can run.")
    quantization_classes: list[str] = Field(default_factory=lambda: ["none"], min_length=1)
    supported_tokenizer_hashes: list[str] = Field(
        min_length=1, description="Tokenizers it has; '*' means it loads whatever the policy names."
    )
    max_context_tokens: int = Field(ge=1)
    max_concurrent_groups: int = Field(default=1, ge=1, le=1024)
    returns_token_ids: bool = True
    returns_sampled_logprobs: bool = True
    returns_routed_experts: bool = False
    region: str = Field(default="local", max_length=64)
    price_hint: float = Field(default=0.0, ge=0, description="Relative price per 1M tokens.")
    public_key: str | None = Field(
        default=None,
        description="Base64 raw ed25519 public key; when set every submission must be signed.",
    )


class WorkerRegistration(Record):
    """What registration hands back. The token is shown once and stored only hashed."""

    worker_id: str
    token: str
    heartbeat_ttl_s: float
    lease_ttl_s: float
    policy: PolicyManifest | None = Field(description="The latest published policy, if any.")


class WorkerHeartbeat(Record):
    """Sent every few seconds; silence past the heartbeat TTL marks a worker dead."""

    worker_id: Identifier
    loaded_policy_version: int | None = None
    active_lease_ids: list[str] = Field(default_factory=list)
    queue_depth: int = Field(default=0, ge=0)
    tokens_per_s: float | None = Field(default=None, ge=0)
    sent_at: UtcDatetime = Field(default_factory=utc_now)


class HeartbeatReply(Record):
    """Tells the worker what to load and which of its leases no longer stand."""

    worker_id: str
    status: str = Field(description="alive (a dead worker that beats again is revived).")
    active_version: int | None
    policy: PolicyManifest | None = Field(description="The latest published policy.")
    reload_required: bool = Field(
        description="True when the worker has not acked the latest published version."
    )
    cancelled_lease_ids: list[str] = Field(
        default_factory=list, description="Leases it reported that the exchange no longer honours."
    )
    server_time: UtcDatetime = Field(default_factory=utc_now)
