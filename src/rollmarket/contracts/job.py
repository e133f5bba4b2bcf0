"""Jobs the trainer enqueues and the leases workers hold on them."""

from __future__ import annotations

import hashlib
from enum import Enum
from typing import Any

from pydantic import Field, model_validator

from .base import Identifier, Record, Sha256Hex, UtcDatetime, canonical_json, new_id
from .limits import (
    MAX_GROUP_SIZE,
    MAX_ITEMS,
    MAX_NAMES,
    MAX_PRIORITY,
    MAX_TOKENS,
    Count,
    Int64,
    JsonData,
    JsonObject,
    Key,
    Message,
    Name,
    Text,
    TokenCount,
    Version,
)
from .policy import PolicyManifest


class TaskSpec(Record):
    """One task: what the agent is asked and how its answer is checked."""

    task_id: Identifier
    prompt: Text | None = Field(default=None, description="A plain prompt; or give messages.")
    messages: list[JsonObject] | None = Field(
        default=None, max_length=MAX_ITEMS, description="OpenAI-style chat messages."
    )
    tools: list[Name] = Field(default_factory=list, max_length=MAX_NAMES,
                              description="Tool names the agent may call.")
    verifier: Name = Field(min_length=1, description="Name of the verifier that scores answers.")
    answer: JsonData = Field(default=None, description="Expected answer, as the verifier reads it.")
    verifier_args: JsonObject = Field(
        default_factory=dict,
        description="Options of the verifier: a tolerance, a JSON Schema, expected tool calls, "
        "the components of a compound reward.",
    )
    files: dict[Key, Text] = Field(
        default_factory=dict, max_length=MAX_ITEMS,
        description="The task's directory, relative path -> text; read_file and python_eval see "
        "only these files.",
    )
    metadata: JsonObject = Field(default_factory=dict)

    @model_validator(mode="after")
    def _has_input(self) -> "TaskSpec":
        if self.prompt is None and not self.messages:
            raise ValueError("a task needs a prompt or messages")
        return self


class SamplingConfig(Record):
    """Sampling settings; its hash ties every group to the settings that produced it."""

    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=-1, ge=-1, le=2**31 - 1, description="-1 disables top-k.")
    max_tokens: int = Field(default=512, ge=1, le=MAX_TOKENS)
    seed: Int64 | None = None
    stop: list[Name] = Field(default_factory=list, max_length=MAX_NAMES)

    def digest(self) -> str:
        return hashlib.sha256(canonical_json(self.model_dump(mode="json"))).hexdigest()


class RolloutJob(Record):
    """A request for one group of `group_size` samples of one task."""

    job_id: Identifier = Field(default_factory=lambda: new_id("job"))
    task: TaskSpec
    policy_version: Version = Field(description="Oldest policy version that may serve this job.")
    group_size: int = Field(ge=1, le=MAX_GROUP_SIZE)
    sampling_config: SamplingConfig = Field(default_factory=SamplingConfig)
    sampling_config_hash: Sha256Hex = Field(
        default=None, description="sha256 of the canonical sampling config; filled in if absent."
    )  # type: ignore[assignment]
    required_precision: Name | None = Field(
        default=None, description="Precision class; None means the policy's."
    )
    required_quantization: Name | None = Field(
        default=None, description="Quantization class; None means the policy's."
    )
    allowed_engines: list[Name] = Field(default_factory=list, max_length=MAX_NAMES,
                                        description="Empty allows any.")
    max_context_tokens: int = Field(default=4096, ge=1, le=MAX_TOKENS)
    requires_routed_experts: bool = False
    required_fingerprints: list[Name] = Field(
        default_factory=list, max_length=MAX_NAMES,
        description="Engine fingerprints allowed to run this job (docs/security.md); empty allows any.",
    )
    excluded_fingerprints: list[Name] = Field(
        default_factory=list, max_length=MAX_NAMES,
        description="Engine fingerprints never leased this job, and whose groups for it are rejected.",
    )
    idempotency_key: str = Field(
        default=None, min_length=1, max_length=256,
        description="Enqueueing the same key twice yields one job; defaults to job_id.",
    )  # type: ignore[assignment]
    priority: int = Field(default=0, ge=-MAX_PRIORITY, le=MAX_PRIORITY, description="Higher is leased first.")
    deadline: UtcDatetime | None = Field(
        default=None, description="After this the job is dropped instead of re-queued."
    )

    @model_validator(mode="before")
    @classmethod
    def _fill_derived(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("job_id") is None:
            data["job_id"] = new_id("job")
        if data.get("idempotency_key") is None:
            data["idempotency_key"] = data["job_id"]
        if data.get("sampling_config_hash") is None:
            config = SamplingConfig.model_validate(data.get("sampling_config") or {})
            data["sampling_config"] = config
            data["sampling_config_hash"] = config.digest()
        return data

    @model_validator(mode="after")
    def _check_hash(self) -> "RolloutJob":
        if self.sampling_config_hash != self.sampling_config.digest():
            raise ValueError("sampling_config_hash does not match sampling_config")
        both = sorted(set(self.required_fingerprints) & set(self.excluded_fingerprints))
        if both:
            raise ValueError(f"fingerprints both required and excluded: {both}")
        return self

    def digest(self) -> str:
        """Hash of the job's content, used to tell a retry from a conflicting enqueue. Fields added
        after a job was stored count only when set, so its retry still matches its stored digest."""
        data = self.model_dump(mode="json")
        for name in _ADDED_FIELDS:
            if not data[name]:
                del data[name]
        return hashlib.sha256(canonical_json(data)).hexdigest()


_ADDED_FIELDS = ("required_fingerprints", "excluded_fingerprints")
"""RolloutJob fields younger than the digests of jobs already stored."""


class LeaseState(str, Enum):
    issued = "issued"
    submitted = "submitted"
    expired = "expired"
    abandoned = "abandoned"
    failed = "failed"


class LeaseRequirements(Record):
    """What a submission under this lease must match; fixed when the lease is issued."""

    policy_version: Version
    checkpoint_digest: Sha256Hex
    tokenizer_hash: Sha256Hex
    precision_class: Name
    quantization_class: Name
    group_size: int = Field(ge=1, le=MAX_GROUP_SIZE)
    max_context_tokens: TokenCount
    sampling_config_hash: Sha256Hex
    allowed_engines: list[Name] = Field(max_length=MAX_NAMES)
    requires_routed_experts: bool
    vocab_size: int | None = Field(ge=1, le=2**31 - 1)
    # Defaults keep leases issued before these fields existed readable.
    require_signature: bool = Field(
        default=False, description="The policy requires every group to carry a valid signature.")
    required_fingerprints: list[Name] = Field(
        default_factory=list, max_length=MAX_NAMES, description="The job's allowed engine fingerprints; empty allows any.")
    excluded_fingerprints: list[Name] = Field(
        default_factory=list, max_length=MAX_NAMES, description="The job's excluded engine fingerprints.")


class RolloutLease(Record):
    """A worker's time-limited claim on one job."""

    lease_id: Identifier
    job_id: Identifier
    worker_id: Identifier
    policy_version: Version
    requirements: LeaseRequirements
    issued_at: UtcDatetime
    expires_at: UtcDatetime
    state: LeaseState = LeaseState.issued


class NoLeaseReason(str, Enum):
    no_policy = "no_policy"
    reload_required = "reload_required"
    """A newer policy is published: load it and ack before leasing (see `policy`)."""
    awaiting_quorum = "awaiting_quorum"
    """The worker runs the newest version, which has not reached its reload quorum yet."""
    at_capacity = "at_capacity"
    queue_empty = "queue_empty"
    no_matching_jobs = "no_matching_jobs"
    deferred = "deferred"
    """Jobs exist but workers with better feedback or lower price are asking for them."""


class LeaseGrant(Record):
    """The answer to a lease request: a lease with its job and policy, or a reason for none."""

    lease: RolloutLease | None = None
    job: RolloutJob | None = None
    policy: PolicyManifest | None = None
    reason: NoLeaseReason | None = None
    detail: Message | None = None
    retry_after_s: float | None = Field(default=None, ge=0)


class FailureKind(str, Enum):
    engine_error = "engine_error"
    timeout = "timeout"
    out_of_memory = "out_of_memory"
    tool_error = "tool_error"
    cancelled = "cancelled"
    other = "other"


class FailureReport(Record):
    """A worker gives a lease back because it could not finish the job."""

    kind: FailureKind
    message: str = Field(default="", max_length=4000)
    retryable: bool = Field(default=True, description="False marks the job failed for good.")


class EnqueueReceipt(Record):
    """Per job: its id and whether this call created it or found it already there."""

    job_id: Identifier
    created: bool


class JobView(Record):
    """A job as the exchange tracks it."""

    job: RolloutJob
    state: Name = Field(description="queued, leased, done, failed or expired.")
    attempts: Count
    queued_at: UtcDatetime
    group_id: Identifier | None = None

