"""Validators that decide whether a submitted group may enter the exchange at all.

`check_group` needs only the group (shapes, values, content hash); `check_against_lease` needs
the lease it was submitted under. Each returns findings, each with a typed RejectionReason; an
empty list means the group is valid.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from ..contracts import LeaseState, RejectionReason, RolloutLease, SampleGroup, content_hash
from .config import GateConfig
from .integrity import signature_valid


@dataclass(frozen=True)
class Finding:
    reason: RejectionReason
    message: str
    sample_index: int | None = None

    def as_dict(self) -> dict:
        return {"reason": self.reason.value, "message": self.message, "sample_index": self.sample_index}


def reasons_of(findings: list[Finding]) -> list[RejectionReason]:
    """The distinct reasons, in the order they were found."""
    return list(dict.fromkeys(f.reason for f in findings))


def check_group(group: SampleGroup, config: GateConfig = GateConfig()) -> list[Finding]:
    """Checks that need nothing but the group: token ids, logprobs, masks, lengths, hash."""
    findings: list[Finding] = []
    add = findings.append
    for index, t in enumerate(group.trajectories):
        if t.prompt_token_ids is None or t.prompt_token_ids.shape[0] == 0:
            add(Finding(RejectionReason.missing_token_ids, "prompt_token_ids are missing", index))
        n = t.num_response_tokens
        if t.response_token_ids is None or n == 0:
            add(Finding(RejectionReason.missing_token_ids, "response_token_ids are missing", index))
            continue
        lengths = {
            "logprobs": None if t.logprobs is None else t.logprobs.shape[0],
            "action_mask": None if t.action_mask is None else t.action_mask.shape[0],
            "tool_output_mask": None if t.tool_output_mask is None else t.tool_output_mask.shape[0],
            "routed_experts": None if t.routed_experts is None else t.routed_experts.shape[0],
        }
        for name, length in lengths.items():
            if length is not None and length != n:
                add(Finding(RejectionReason.length_mismatch,
                            f"{name} has {length} entries for {n} response tokens", index))
        action_T = None
        if t.action_mask is not None and t.action_mask.shape[0] == n:
            action_T = t.action_mask.astype(bool)
        if t.logprobs is None:
            add(Finding(RejectionReason.missing_logprobs, "logprobs are missing", index))
        elif t.logprobs.shape[0] == n:
            finite_T = np.isfinite(t.logprobs)
            if not finite_T.all():
                bad = int(np.flatnonzero(~finite_T)[0])
                add(Finding(RejectionReason.non_finite_logprobs,
                            f"logprob at position {bad} is {t.logprobs[bad]}", index))
            sampled = t.logprobs if action_T is None else t.logprobs[action_T]
            sampled = sampled[np.isfinite(sampled)]
            if sampled.size and float(sampled.max()) > config.logprob_tolerance:
                add(Finding(RejectionReason.logprob_out_of_range,
                            "a sampled token has a logprob above zero", index))
        if (action_T is not None and t.tool_output_mask is not None
                and t.tool_output_mask.shape[0] == n
                and bool((action_T & t.tool_output_mask.astype(bool)).any())):
            add(Finding(RejectionReason.invalid_mask,
                        "a token is marked both action and tool output", index))
        if t.turn_boundaries and (
            any(b < 0 or b >= n for b in t.turn_boundaries)
            or any(a >= b for a, b in zip(t.turn_boundaries, t.turn_boundaries[1:]))
        ):
            add(Finding(RejectionReason.invalid_mask,
                        "turn_boundaries must be increasing offsets inside the response", index))
    if group.content_hash is None:
        add(Finding(RejectionReason.hash_mismatch, "content_hash is missing"))
    elif group.content_hash != content_hash(group):
        add(Finding(RejectionReason.hash_mismatch,
                    "content_hash does not match the group's canonical bytes"))
    return findings


def check_against_lease(
    group: SampleGroup,
    lease: RolloutLease,
    *,
    now: datetime,
    acked_fingerprint: str | None,
    public_key: Ed25519PublicKey | None,
) -> list[Finding]:
    """Checks that need the lease the group was submitted under."""
    findings: list[Finding] = []
    add = findings.append
    req = lease.requirements
    if group.job_id != lease.job_id or group.worker_id != lease.worker_id:
        add(Finding(RejectionReason.lease_mismatch,
                    f"lease {lease.lease_id} is for job {lease.job_id} and worker {lease.worker_id}"))
    if lease.state is LeaseState.expired or (lease.state is LeaseState.issued and lease.expires_at <= now):
        add(Finding(RejectionReason.expired_lease, f"lease expired at {lease.expires_at.isoformat()}"))
    elif lease.state is not LeaseState.issued:
        add(Finding(RejectionReason.lease_not_active, f"lease is {lease.state.value}"))
    pairs = [
        (RejectionReason.version_mismatch, "policy_version", group.policy_version, req.policy_version),
        (RejectionReason.checkpoint_mismatch, "checkpoint_digest", group.checkpoint_digest, req.checkpoint_digest),
        (RejectionReason.tokenizer_mismatch, "tokenizer_hash", group.tokenizer_hash, req.tokenizer_hash),
        (RejectionReason.precision_mismatch, "precision_class", group.precision_class, req.precision_class),
        (RejectionReason.quantization_mismatch, "quantization_class", group.quantization_class, req.quantization_class),
        (RejectionReason.sampling_config_mismatch, "sampling_config_hash", group.sampling_config_hash, req.sampling_config_hash),
    ]
    for reason, name, got, want in pairs:
        if got != want:
            add(Finding(reason, f"{name} is {got!r}, the lease requires {want!r}"))
    if req.allowed_engines and group.engine_name not in req.allowed_engines:
        add(Finding(RejectionReason.engine_not_allowed,
                    f"engine {group.engine_name!r} is not in {req.allowed_engines}"))
    if acked_fingerprint is not None and group.engine_fingerprint != acked_fingerprint:
        add(Finding(RejectionReason.fingerprint_mismatch,
                    "engine_fingerprint differs from the one acked for this policy version"))
    if len(group.trajectories) != req.group_size:
        add(Finding(RejectionReason.group_size_mismatch,
                    f"{len(group.trajectories)} trajectories, the job asks for {req.group_size}"))
    for index, t in enumerate(group.trajectories):
        if t.prompt_token_ids is None or t.response_token_ids is None:
            continue
        total = t.prompt_token_ids.shape[0] + t.response_token_ids.shape[0]
        if total > req.max_context_tokens:
            add(Finding(RejectionReason.context_overflow,
                        f"{total} tokens exceed the context of {req.max_context_tokens}", index))
        if req.vocab_size is not None:
            top = max(int(t.prompt_token_ids.max(initial=0)), int(t.response_token_ids.max(initial=0)))
            if top >= req.vocab_size:
                add(Finding(RejectionReason.token_out_of_vocab,
                            f"token id {top} is outside a vocabulary of {req.vocab_size}", index))
        if req.requires_routed_experts and t.routed_experts is None:
            add(Finding(RejectionReason.missing_routed_experts, "routed_experts are missing", index))
    if public_key is not None:
        if group.signature is None or group.content_hash is None or not signature_valid(
            group.content_hash, group.signature, public_key
        ):
            add(Finding(RejectionReason.bad_signature, "signature does not verify under the worker's key"))
    elif group.signature is not None:
        add(Finding(RejectionReason.bad_signature, "group is signed but the worker registered no key"))
    return findings
