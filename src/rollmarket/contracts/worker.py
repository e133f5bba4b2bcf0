"""Who a rollout worker is, what it can run, and how it says it is alive."""

from __future__ import annotations

from pydantic import Field

from .base import CONTRACT_VERSION, Identifier, Record, UtcDatetime, utc_now
from .limits import MAX_DEVICES, MAX_GROUP_SIZE, MAX_NAMES, MAX_TOKENS, Count, Key, Name, Version
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
    contract_version: Name = Field(default=CONTRACT_VERSION)
    device_type: str = Field(default="cpu", max_length=64, description="e.g. cpu, h100, mi300x.")
    device_count: int = Field(default=1, ge=0, le=MAX_DEVICES)
    precision_classes: list[Name] = Field(min_length=1, max_length=MAX_NAMES, description="Numerics it can run.")
    quantization_classes: list[Name] = Field(default_factory=lambda: ["none"], min_length=1, max_length=MAX_NAMES)
    supported_tokenizer_hashes: list[Key] = Field(
        min_length=1, max_length=MAX_NAMES,
        description="Tokenizers it has; '*' means it loads whatever the policy names.",
    )
    max_context_tokens: int = Field(ge=1, le=MAX_TOKENS)
    max_concurrent_groups: int = Field(default=1, ge=1, le=MAX_GROUP_SIZE)
    returns_token_ids: bool = True
    returns_sampled_logprobs: bool = True
    returns_routed_experts: bool = False
    region: str = Field(default="local", max_length=64)
    price_hint: float = Field(default=0.0, ge=0, le=1e12, description="Relative price per 1M tokens.")
    public_key: Key | None = Field(
        default=None,
        description="Base64 raw ed25519 public key; when set every submission must be signed.",
    )
    max_reload_lag: Version = Field(
        default=0,
        description="Versions this worker may run behind the published policy before it must reload (a "
                    "slow host that reloads every few versions); it leases at the version it runs, so its "
                    "groups carry their real lag. 0: it always runs the newest.",
    )
    pool: Identifier | None = Field(
        default=None,
        description="The worker pool it belongs to (`rollmarket pool`, e.g. Ray actors under one supervisor); "
                    "None for a worker on its own.",
    )


class WorkerRegistration(Record):
    """What registration hands back. The token is shown once and stored only hashed."""

    worker_id: Identifier
    token: Key
    heartbeat_ttl_s: float
    lease_ttl_s: float
    policy: PolicyManifest | None = Field(description="The latest published policy, if any.")


class WorkerHeartbeat(Record):
    """Sent every few seconds; silence past the heartbeat TTL marks a worker dead."""

    worker_id: Identifier
    loaded_policy_version: Version | None = None
    active_lease_ids: list[Identifier] = Field(default_factory=list, max_length=MAX_GROUP_SIZE)
    queue_depth: Count = 0
    tokens_per_s: float | None = Field(default=None, ge=0)
    sent_at: UtcDatetime = Field(default_factory=utc_now)


class HeartbeatReply(Record):
    """Tells the worker what to load and which of its leases no longer stand."""

    worker_id: Identifier
    status: Name = Field(description="alive (a dead worker that beats again is revived).")
    active_version: Version | None
    policy: PolicyManifest | None = Field(description="The latest published policy.")
    reload_required: bool = Field(
        description="True when the worker has not acked the latest published version."
    )
    cancelled_lease_ids: list[Identifier] = Field(
        default_factory=list, max_length=MAX_GROUP_SIZE, description="Leases it reported that the exchange no longer honours."
    )
    server_time: UtcDatetime = Field(default_factory=utc_now)
