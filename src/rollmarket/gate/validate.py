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

from ..contracts import (
    LeaseState,
    RejectionReason,
    RolloutLease,
    SampleGroup,
    Trajectory,
    WorkerManifest,
    content_hash,
)
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
    shaped = [index for index, t in enumerate(group.trajectories) if _check_structure(t, index, findings)]
    # Value checks run once over the whole group; only a group that fails one is walked sample
    # by sample to say where. Most groups are fine, and this keeps numpy calls per group constant.
    if len(shaped) != len(group.trajectories) or not _values_ok(group.trajectories, config):
        for index in shaped:
            t = group.trajectories[index]
            if t.logprobs is not None:  # a shaped sample has them (_check_structure)
                _check_values(t, t.logprobs, index, config, findings)
    if group.content_hash is None:
        findings.append(Finding(RejectionReason.hash_mismatch, "content_hash is missing"))
    elif group.content_hash != content_hash(group):
        findings.append(Finding(RejectionReason.hash_mismatch,
                                "content_hash does not match the group's canonical bytes"))
    return findings


def _check_structure(t: Trajectory, index: int, findings: list[Finding]) -> bool:
    """Presence and lengths; True when the trajectory's arrays are there and agree in length."""
    add = findings.append
    if t.prompt_token_ids is None or t.prompt_token_ids.shape[0] == 0:
        add(Finding(RejectionReason.missing_token_ids, "prompt_token_ids are missing", index))
    n = t.num_response_tokens
    if t.response_token_ids is None or n == 0:
        add(Finding(RejectionReason.missing_token_ids, "response_token_ids are missing", index))
        return False
    shaped = True
    for name in ("logprobs", "action_mask", "tool_output_mask", "routed_experts"):
        array = getattr(t, name)
        if array is not None and array.shape[0] != n:
            add(Finding(RejectionReason.length_mismatch,
                        f"{name} has {array.shape[0]} entries for {n} response tokens", index))
            shaped = False
    if t.logprobs is None:
        add(Finding(RejectionReason.missing_logprobs, "logprobs are missing", index))
        shaped = False
    if t.turn_boundaries and (
        any(b < 0 or b >= n for b in t.turn_boundaries)
        or any(a >= b for a, b in zip(t.turn_boundaries, t.turn_boundaries[1:]))
    ):
        add(Finding(RejectionReason.invalid_mask,
                    "turn_boundaries must be increasing offsets inside the response", index))
    return shaped


def _values_ok(trajectories: list[Trajectory], config: GateConfig) -> bool:
    """True when every logprob is finite and at most the tolerance where sampled, and no token
    is both action and tool output. Expects every trajectory to have passed _check_structure."""
    logprobs_N = np.concatenate([t.logprobs for t in trajectories])
    if not np.isfinite(logprobs_N).all():
        return False
    actions = [t.action_mask for t in trajectories]
    tools = [t.tool_output_mask for t in trajectories]
    if all(a is None for a in actions):
        return float(logprobs_N.max(initial=-np.inf)) <= config.logprob_tolerance
    action_N = np.concatenate([np.ones(t.num_response_tokens, np.uint8) if a is None else a
                               for t, a in zip(trajectories, actions)]).view(bool)
    if float(logprobs_N[action_N].max(initial=-np.inf)) > config.logprob_tolerance:
        return False
    if any(m is not None for m in tools):
        tool_N = np.concatenate([np.zeros(t.num_response_tokens, np.uint8) if m is None else m
                                 for t, m in zip(trajectories, tools)]).view(bool)
        if (action_N & tool_N).any():
            return False
    return True


def _check_values(t: Trajectory, logprobs_T: np.ndarray, index: int, config: GateConfig,
                  findings: list[Finding]) -> None:
    add = findings.append
    action_T = None if t.action_mask is None else t.action_mask.astype(bool)
    finite_T = np.isfinite(logprobs_T)
    if not finite_T.all():
        bad = int(np.flatnonzero(~finite_T)[0])
        add(Finding(RejectionReason.non_finite_logprobs,
                    f"logprob at position {bad} is {logprobs_T[bad]}", index))
    sampled = logprobs_T if action_T is None else logprobs_T[action_T]
    sampled = sampled[np.isfinite(sampled)]
    if sampled.size and float(sampled.max()) > config.logprob_tolerance:
        add(Finding(RejectionReason.logprob_out_of_range,
                    "a sampled token has a logprob above zero", index))
    if (action_T is not None and t.tool_output_mask is not None
            and bool((action_T & t.tool_output_mask.astype(bool)).any())):
        add(Finding(RejectionReason.invalid_mask,
                    "a token is marked both action and tool output", index))


def check_provenance(group: SampleGroup, manifest: WorkerManifest) -> list[Finding]:
    """The group's engine, device and numerics must be what its worker registered: a worker
    cannot claim another engine (or device, precision, quantization) for one group. The
    fingerprint is checked against the worker's reload ack (see check_against_lease)."""
    findings: list[Finding] = []
    add = findings.append
    if group.engine_name != manifest.engine_name:
        add(Finding(RejectionReason.engine_mismatch,
                    f"engine_name is {group.engine_name!r}, the worker registered {manifest.engine_name!r}"))
    if group.engine_version != manifest.engine_version:
        add(Finding(RejectionReason.engine_version_mismatch,
                    f"engine_version is {group.engine_version!r}, the worker registered {manifest.engine_version!r}"))
    if group.device_type != manifest.device_type:
        add(Finding(RejectionReason.device_mismatch,
                    f"device_type is {group.device_type!r}, the worker registered {manifest.device_type!r}"))
    if group.precision_class not in manifest.precision_classes:
        add(Finding(RejectionReason.precision_mismatch,
                    f"precision_class {group.precision_class!r} is not one the worker registered"))
    if group.quantization_class not in manifest.quantization_classes:
        add(Finding(RejectionReason.quantization_mismatch,
                    f"quantization_class {group.quantization_class!r} is not one the worker registered"))
    return findings


def fingerprint_refused(fingerprint: str, required: list[str], excluded: list[str]) -> str | None:
    """Why a job's fingerprint rules refuse this engine fingerprint, or None. The exchange checks it
    at lease on the fingerprint the worker acked (exchange/dispatch.py), the gate at submit on the
    group's."""
    if fingerprint in excluded:
        return f"engine fingerprint {fingerprint[:12]}… is excluded by the job"
    if required and fingerprint not in required:
        return f"engine fingerprint {fingerprint[:12]}… is not one the job requires"
    return None


def check_against_lease(
    group: SampleGroup,
    lease: RolloutLease,
    *,
    now: datetime,
    acked_fingerprint: str | None,
    public_key: Ed25519PublicKey | None,
    manifest: WorkerManifest | None = None,
) -> list[Finding]:
    """Checks that need the lease the group was submitted under, and the manifest its worker
    registered (the group's provenance must be what the worker declared)."""
    findings: list[Finding] = []
    add = findings.append
    req = lease.requirements
    if group.job_id != lease.job_id or group.worker_id != lease.worker_id:
        add(Finding(RejectionReason.lease_mismatch, "job_id or worker_id differ from the lease's"))
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
    elif acked_fingerprint is None and manifest is not None and group.engine_fingerprint != manifest.engine_fingerprint:
        add(Finding(RejectionReason.fingerprint_mismatch,
                    "engine_fingerprint differs from the one the worker registered"))
    refused = fingerprint_refused(group.engine_fingerprint, req.required_fingerprints, req.excluded_fingerprints)
    if refused:
        add(Finding(RejectionReason.fingerprint_not_allowed, refused))
    if manifest is not None:
        findings.extend(check_provenance(group, manifest))
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
    if group.signature is None and req.require_signature:
        add(Finding(RejectionReason.signature_required, "the policy requires signed groups and this one is unsigned"))
    elif public_key is not None:
        if group.signature is None or group.content_hash is None or not signature_valid(
            group.content_hash, group.signature, public_key
        ):
            add(Finding(RejectionReason.bad_signature, "signature does not verify under the worker's key"))
    elif group.signature is not None:
        add(Finding(RejectionReason.bad_signature, "group is signed but the worker registered no key"))
    return findings
