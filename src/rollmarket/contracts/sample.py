"""Rollout samples as they travel from a worker to a trainer, and their content hash."""

from __future__ import annotations

import hashlib
from enum import Enum
from typing import Annotated

import numpy as np
from pydantic import Field

from .arrays import Logprobs, Mask, RoutedExperts, TokenIds
from .base import Identifier, Record, Sha256Hex, UtcDatetime, canonical_json, new_id, utc_now
from .decision import DecisionReason
from .limits import MAX_GROUP_SIZE, MAX_ITEMS, MAX_NAMES, MAX_TOKENS, Count, Key, Name, Version


class FinishReason(str, Enum):
    stop = "stop"
    length = "length"
    tool_calls = "tool_calls"
    max_steps = "max_steps"
    error = "error"
    abort = "abort"


class Trajectory(Record):
    """One sample of a group: the exact token ids the engine produced, with their provenance.

    All per-token arrays cover the response tokens (T of them, in order); the prompt is separate.
    Tool output spliced into a multi-turn response counts as response tokens with
    ``tool_output_mask = 1`` and ``action_mask = 0``; its logprob slot is ignored (send 0).
    """

    sample_index: int = Field(ge=0, lt=MAX_GROUP_SIZE, description="Position within the group.")
    prompt_token_ids: TokenIds | None = Field(description="int32 [P]: the prompt as the engine saw it.")
    response_token_ids: TokenIds | None = Field(description="int32 [T].")
    logprobs: Logprobs | None = Field(
        default=None,
        description="float32 [T]: behaviour logprob of each sampled token under the "
        "distribution actually sampled from (after temperature/top-p, as vLLM reports).",
    )
    action_mask: Mask | None = Field(
        default=None, description="uint8 [T]: 1 = token the policy produced. None means all 1."
    )
    tool_output_mask: Mask | None = Field(
        default=None, description="uint8 [T]: 1 = token inserted from a tool. None means all 0."
    )
    routed_experts: RoutedExperts | None = Field(
        default=None, description="int16 [T, L, K]: top-k expert ids per MoE layer, for MoE models."
    )
    reward: float = 0.0
    reward_components: dict[Name, float] = Field(default_factory=dict, max_length=MAX_NAMES)
    turn_boundaries: list[Annotated[int, Field(ge=-MAX_TOKENS, le=MAX_TOKENS)]] = Field(
        default_factory=list, max_length=MAX_ITEMS,
        description="Response offsets where each turn starts (the gate refuses one outside the response).",
    )
    finish_reason: FinishReason = FinishReason.stop

    @property
    def num_response_tokens(self) -> int:
        return 0 if self.response_token_ids is None else int(self.response_token_ids.shape[0])


_TRAJECTORY_ARRAYS = ("prompt_token_ids", "response_token_ids", "logprobs", "action_mask",
                      "tool_output_mask", "routed_experts")
_TRAJECTORY_SCALARS = ("sample_index", "reward", "reward_components", "turn_boundaries",
                       "finish_reason")
_GROUP_UNHASHED = ("trajectories", "content_hash", "signature", "policy_lag_steps")


class SampleGroup(Record):
    """All samples of one job, with the provenance a trainer needs to trust them."""

    group_id: Identifier = Field(default_factory=lambda: new_id("grp"))
    job_id: Identifier
    lease_id: Identifier
    worker_id: Identifier
    task_id: Identifier
    policy_version: Version
    checkpoint_digest: Sha256Hex
    tokenizer_hash: Sha256Hex
    sampling_config_hash: Sha256Hex
    engine_name: Name
    engine_version: Name
    engine_fingerprint: Key
    device_type: Name
    precision_class: Name
    quantization_class: Name
    trajectories: list[Trajectory] = Field(min_length=1, max_length=MAX_GROUP_SIZE)
    policy_lag_steps: Version = Field(
        default=0,
        description="Stamped by the exchange: active version minus policy_version. Not hashed.",
    )
    wall_time_s: float = Field(default=0.0, ge=0)
    created_at: UtcDatetime = Field(default_factory=utc_now)
    content_hash: Sha256Hex | None = Field(
        default=None, description="sha256 over canonical bytes; see content_hash()."
    )
    signature: Key | None = Field(
        default=None, description="Base64 ed25519 signature of the content hash."
    )

    @property
    def num_response_tokens(self) -> int:
        return sum(t.num_response_tokens for t in self.trajectories)

    def compute_content_hash(self) -> str:
        return content_hash(self)

    def sealed(self) -> "SampleGroup":
        """A copy with its content hash filled in."""
        return self.model_copy(update={"content_hash": content_hash(self)})


def content_hash(group: SampleGroup) -> str:
    """sha256 over the canonical bytes of a group.

    The bytes are: a domain tag; the canonical JSON of the group's scalar fields; then per
    trajectory the canonical JSON of its scalar fields and, per array field in a fixed order, a
    ``name:dtype:shape`` line and the array's raw little-endian bytes (``none`` when absent).
    Fields the exchange stamps (policy_lag_steps), the hash itself and the signature are excluded.
    """
    digest = hashlib.sha256(b"rollmarket.sample_group.v1\n")
    header = {
        name: getattr(group, name) for name in SampleGroup.model_fields if name not in _GROUP_UNHASHED
    }
    header["created_at"] = group.created_at.isoformat()
    digest.update(canonical_json(header))
    for trajectory in group.trajectories:
        scalars = {name: getattr(trajectory, name) for name in _TRAJECTORY_SCALARS}
        scalars["finish_reason"] = trajectory.finish_reason.value
        digest.update(b"\n")
        digest.update(canonical_json(scalars))
        for name in _TRAJECTORY_ARRAYS:
            array: np.ndarray | None = getattr(trajectory, name)
            if array is None:
                digest.update(f"\n{name}:none".encode())
            else:
                digest.update(f"\n{name}:{array.dtype.str}:{array.shape}\n".encode())
                digest.update(array.data)
    return digest.hexdigest()


class Tier(str, Enum):
    """Where a stored group sits. Replay and quarantine are served only when asked for."""

    fresh = "fresh"
    replay = "replay"
    quarantine = "quarantine"


class GroupStatus(str, Enum):
    available = "available"
    consumed = "consumed"
    """A trainer decided train or train_with_correction on it."""
    dropped = "dropped"
    """A trainer rejected it after the fact."""


class SubmissionReceipt(Record):
    """The exchange's answer to an accepted submission. Resubmitting yields the same receipt."""

    group_id: Identifier
    lease_id: Identifier
    content_hash: Sha256Hex
    tier: Tier
    policy_lag_steps: Version
    reasons: list[DecisionReason] = Field(
        default_factory=list, max_length=MAX_NAMES, description="Why it landed outside the fresh tier, if it did."
    )
    duplicate: bool = Field(default=False, description="True when this exact group was already stored.")
    received_at: UtcDatetime


class FetchedGroup(Record):
    """A stored group as a trainer receives it."""

    group: SampleGroup
    tier: Tier
    status: GroupStatus
    received_at: UtcDatetime
    lag_at_arrival: Version
    current_lag: Version = Field(description="Active version now minus the group's policy version.")
    served_count: Count = Field(description="Times served to this trainer, this time included.")


class FetchResult(Record):
    groups: list[FetchedGroup] = Field(max_length=MAX_ITEMS)
    active_version: Version | None
    remaining: Count = Field(description="Groups still matching the filters after this batch.")
