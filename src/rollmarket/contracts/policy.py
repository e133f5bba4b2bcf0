"""What a policy version is, and a worker's proof that it loaded one."""

from __future__ import annotations

from pydantic import Field

from .base import CONTRACT_VERSION, Identifier, Record, Sha256Hex, UtcDatetime, utc_now
from .limits import MAX_NAMES, Count, Name, Url, Version


class PolicyManifest(Record):
    """A published policy version: the weights, tokenizer and numerics workers must run."""

    policy_version: Version = Field(description="Monotonic version; the trainer's step counter.")
    parent_version: Version | None = Field(
        default=None, description="The version this one was trained from; None for the first."
    )
    checkpoint_digest: Sha256Hex = Field(description="sha256 of the checkpoint's weights.")
    checkpoint_uri: Url | None = Field(
        default=None, description="Where workers load the weights from (path or URL)."
    )
    tokenizer_hash: Sha256Hex = Field(description="sha256 of the tokenizer files.")
    model_config_hash: Sha256Hex = Field(description="sha256 of the model config.")
    vocab_size: int | None = Field(
        default=None, ge=1, le=2**31 - 1, description="Token ids must be below this; None skips the check."
    )
    precision_class: Name = Field(description="Numerics rollouts must use, e.g. bf16, fp8.")
    quantization_class: Name = Field(default="none", description="Weight quantization, e.g. none, fp8-e4m3.")
    engine_contract_version: Name = Field(
        default=CONTRACT_VERSION, description="Contract version workers must speak."
    )
    allowed_engines: list[Name] = Field(
        default_factory=list, max_length=MAX_NAMES, description="Engine names allowed to roll out; empty allows any."
    )
    require_signatures: bool = Field(
        default=False,
        description="Every group must be signed with the ed25519 key its worker registered; workers "
                    "without a key are not leased jobs (docs/security.md).",
    )
    created_at: UtcDatetime = Field(default_factory=utc_now)


class ReloadAck(Record):
    """A worker says it has loaded a policy version and what its numerics look like now."""

    worker_id: Identifier
    policy_version: Version
    checkpoint_digest: Sha256Hex = Field(description="Digest of the weights the worker loaded.")
    engine_fingerprint: str = Field(
        min_length=1, max_length=128,
        description="The worker's numerical fingerprint at this checkpoint (see DESIGN.md).",
    )
    load_seconds: float = Field(default=0.0, ge=0, le=1e9)
    loaded_at: UtcDatetime = Field(default_factory=utc_now)


class ReloadStatus(Record):
    """The exchange's answer to a reload ack."""

    worker_id: Identifier
    policy_version: Version
    aligned: bool = Field(description="True when the worker runs the pool's active version.")
    active_version: Version | None
    published_version: Version | None
    acks: Count = Field(description="Acks of the published version from live workers.")
    quorum: Count = Field(description="Acks needed for the published version to become active.")
