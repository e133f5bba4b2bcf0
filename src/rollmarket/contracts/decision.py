"""What the gate decides about a group, and every reason it can give."""

from __future__ import annotations

from enum import Enum

from pydantic import Field

from .base import Identifier, Record, UtcDatetime, utc_now
from .budget import BudgetReport
from .limits import MAX_NAMES, Name


class DecisionStatus(str, Enum):
    train = "train"
    train_with_correction = "train_with_correction"
    replay = "replay"
    quarantine = "quarantine"
    reject = "reject"


class DecisionReason(str, Enum):
    """Why the gate put a valid group where it did (DESIGN.md, 'The gate')."""

    within_budget = "within_budget"
    veto_token = "veto_token"
    """A token's |Δ| exceeds the veto threshold (default 30)."""
    policy_lag_quarantine = "policy_lag_quarantine"
    """Older than max_policy_lag versions (default 8)."""
    low_ess_quarantine = "low_ess_quarantine"
    """Token ESS below min_ess (default 0.30)."""
    router_flip = "router_flip"
    """MoE top-1 router flip rate above max_router_flip (default 0.15)."""
    clipped_fraction = "clipped_fraction"
    """More than max_clipped_fraction of tokens have |Δ| above the clamp."""
    policy_lag_replay = "policy_lag_replay"
    """Older than replay_lag versions (default 4)."""
    low_ess_replay = "low_ess_replay"
    """Token ESS below replay_ess (default 0.60)."""


class RejectionReason(str, Enum):
    """Why a submission was refused at the door. A rejected group is never stored or served."""

    unknown_lease = "unknown_lease"
    expired_lease = "expired_lease"
    lease_not_active = "lease_not_active"
    """The lease was already submitted, failed or abandoned."""
    lease_mismatch = "lease_mismatch"
    """job_id or worker_id differ from the lease's."""
    version_mismatch = "version_mismatch"
    checkpoint_mismatch = "checkpoint_mismatch"
    tokenizer_mismatch = "tokenizer_mismatch"
    precision_mismatch = "precision_mismatch"
    """The group's precision class differs from the lease's, or is not one its worker registered."""
    quantization_mismatch = "quantization_mismatch"
    """The same for the quantization class."""
    sampling_config_mismatch = "sampling_config_mismatch"
    engine_not_allowed = "engine_not_allowed"
    engine_mismatch = "engine_mismatch"
    """The group's engine_name differs from the one its worker registered."""
    engine_version_mismatch = "engine_version_mismatch"
    """The group's engine_version differs from the one its worker registered."""
    device_mismatch = "device_mismatch"
    """The group's device_type differs from the one its worker registered."""
    fingerprint_mismatch = "fingerprint_mismatch"
    """The group's engine fingerprint differs from the one the worker acked for this version
    (or, before any ack, from the one in its manifest)."""
    group_size_mismatch = "group_size_mismatch"
    missing_token_ids = "missing_token_ids"
    missing_logprobs = "missing_logprobs"
    non_finite_logprobs = "non_finite_logprobs"
    logprob_out_of_range = "logprob_out_of_range"
    """A sampled token's logprob is above zero."""
    length_mismatch = "length_mismatch"
    """ids, logprobs, masks and routed experts disagree on the number of tokens."""
    invalid_mask = "invalid_mask"
    """A token is marked both action and tool output, or a turn boundary is out of range."""
    missing_routed_experts = "missing_routed_experts"
    token_out_of_vocab = "token_out_of_vocab"
    context_overflow = "context_overflow"
    bad_signature = "bad_signature"
    signature_required = "signature_required"
    """The policy requires signatures and the group carries none."""
    fingerprint_not_allowed = "fingerprint_not_allowed"
    """The group's engine fingerprint is excluded by its job, or not among those the job requires."""
    hash_mismatch = "hash_mismatch"


class GroupDecision(Record):
    """The gate's verdict on one group, with every reason that fired."""

    group_id: Identifier
    status: DecisionStatus
    recommended_action: Name = Field(description="What the trainer should do, in words.")
    reasons: list[DecisionReason] = Field(default_factory=list, max_length=MAX_NAMES)
    rejection_reasons: list[RejectionReason] = Field(default_factory=list, max_length=MAX_NAMES)
    report: BudgetReport | None = None
    decided_by: Name = Field(default="gate", description="Who decided: gate, a trainer id, an operator.")
    decided_at: UtcDatetime = Field(default_factory=utc_now)


RECOMMENDED_ACTION = {
    DecisionStatus.train: "use as on-policy data",
    DecisionStatus.train_with_correction: "use with importance-sampling correction",
    DecisionStatus.replay: "hold in the replay tier; use only when replay is enabled",
    DecisionStatus.quarantine: "hold for inspection; do not train",
    DecisionStatus.reject: "drop",
}
