"""Simulated worker profiles: one honest engine and the ways real ones go wrong.

Each profile turns a lease into a group (or into a crash). The gate and the exchange must sort
them out with nothing but what arrives over HTTP.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import Enum

import numpy as np

from ..contracts import FinishReason, LeaseGrant, SampleGroup, Trajectory
from . import synthetic
from .policy import ModelPolicy


class Profile(str, Enum):
    honest = "honest"
    """An engine whose logprobs sit within rounding of the trainer's."""
    noisy = "noisy"
    """Sometimes fine, sometimes noisy, sometimes one token off by e^35: replay and quarantine."""
    stale = "stale"
    """Sits on its leases while the trainer moves on: groups arrive versions late."""
    toxic_tokenizer = "toxic-tokenizer"
    """Runs another tokenizer: wrong tokenizer hash and ids outside the vocabulary."""
    toxic_precision = "toxic-precision"
    """Claims fp16 but runs broken low-precision numerics: samples tokens the policy forbids,
    and now and then labels its groups with the fp8 it really runs."""
    no_logprobs = "no-logprobs"
    """An OpenAI-compatible host that drops logprobs."""
    version_drift = "version-drift"
    """Acks reloads but keeps serving the previous checkpoint; once acks a wrong digest."""
    crashing = "crashing"
    """Hangs on its first lease until it expires, then dies holding its second."""


DESCRIPTIONS = {p: (p.__doc__ or "").strip() for p in Profile}

SCORING = frozenset(Profile) - {Profile.toxic_tokenizer, Profile.no_logprobs, Profile.crashing}
"""The profiles whose groups carry logprobs of real tokens: they load the policy's weights (policy.py)."""


@dataclass
class GroupPlan:
    """What a profile decided to do with a lease."""

    group: SampleGroup | None = None
    hold_s: float = 0.0
    """Seconds to sit on the lease before submitting."""
    hang_until_expiry: bool = False
    crash: bool = False


def _trajectory(rng: np.random.Generator, grant: LeaseGrant, policy: ModelPolicy, index: int, *, sigma: float,
                forbidden_share: float = 0.0, spike: bool = False, drop_logprobs: bool = False,
                out_of_vocab: bool = False) -> Trajectory:
    job = grant.job
    prompt_P = policy.encode(job.task)
    length = int(rng.integers(24, 96))
    response_T = synthetic.sample_tokens(rng, length, forbidden_share=forbidden_share)
    if out_of_vocab:
        response_T[: max(1, length // 8)] = policy.vocab_size + rng.integers(0, 4096, max(1, length // 8))
    # Ids outside the vocabulary have no logprob, and a group without logprobs needs none.
    reference_T = (np.full(length, -1.0, np.float32) if out_of_vocab or drop_logprobs
                   else policy.logprobs(prompt_P, response_T))
    behaviour_T = reference_T + rng.normal(0.0, sigma, length).astype(np.float32)
    forbidden = response_T % synthetic.FORBIDDEN_MODULUS == 0
    # A broken engine believes forbidden tokens are ordinary ones.
    behaviour_T[forbidden] = -2.0
    if spike:
        at = int(rng.integers(0, length))
        behaviour_T[at] = reference_T[at] - 35.0
    behaviour_T = np.minimum(behaviour_T, 0.0).astype(np.float32)
    return Trajectory(
        sample_index=index,
        prompt_token_ids=prompt_P,
        response_token_ids=response_T,
        logprobs=None if drop_logprobs else behaviour_T,
        action_mask=np.ones(length, np.uint8),
        tool_output_mask=np.zeros(length, np.uint8),
        reward=synthetic.reward(job.task, index, response_T),
        finish_reason=FinishReason.stop,
    )


def plan(profile: Profile, client, grant: LeaseGrant, rng: np.random.Generator, policy: ModelPolicy, *,
         leases_seen: int, lease_ttl_s: float, digests: dict[int, str] | None = None) -> GroupPlan:
    """What `profile` does with its `leases_seen`-th lease (1-based), its logprobs from `policy` (the
    checkpoint the worker runs)."""
    size = grant.job.group_size

    def group(sigma: float = 0.003, **kwargs) -> SampleGroup:
        trajectories = [_trajectory(rng, grant, policy, i, sigma=sigma, **kwargs) for i in range(size)]
        return client.group_for(grant, trajectories, wall_time_s=float(rng.uniform(0.5, 3.0)))

    if profile is Profile.honest:
        return GroupPlan(group())
    if profile is Profile.noisy:
        mode = rng.random()
        if mode < 0.35:
            return GroupPlan(group(sigma=0.05, spike=True))
        if mode < 0.7:
            return GroupPlan(group(sigma=0.9))
        return GroupPlan(group(sigma=0.1))
    if profile is Profile.stale:
        # Renews its lease while it dawdles, so the group arrives many versions late.
        return GroupPlan(group(), hold_s=float(rng.uniform(6.0, 16.0)))
    if profile is Profile.toxic_tokenizer:
        other = hashlib.sha256(b"some-other-tokenizer").hexdigest()
        trajectories = [_trajectory(rng, grant, policy, i, sigma=0.003, out_of_vocab=True) for i in range(size)]
        return GroupPlan(client.group_for(grant, trajectories, tokenizer_hash=other))
    if profile is Profile.toxic_precision:
        if leases_seen % 2 == 0:
            trajectories = [_trajectory(rng, grant, policy, i, sigma=0.02) for i in range(size)]
            return GroupPlan(client.group_for(grant, trajectories, precision_class="fp8"))
        return GroupPlan(group(sigma=0.02, forbidden_share=0.2))
    if profile is Profile.no_logprobs:
        return GroupPlan(group(drop_logprobs=True))
    if profile is Profile.version_drift:
        version = grant.lease.policy_version
        previous = max(version - 1, 0)
        trajectories = [_trajectory(rng, grant, policy, i, sigma=0.003) for i in range(size)]
        drifted = client.group_for(
            grant, trajectories, policy_version=previous,
            checkpoint_digest=(digests or {}).get(previous) if version else synthetic.checkpoint_digest(1000),
        )
        return GroupPlan(drifted)
    if profile is Profile.crashing:
        if leases_seen == 1:
            return GroupPlan(hang_until_expiry=True)
        return GroupPlan(crash=True)
    raise ValueError(f"unknown profile {profile}")


def reload_digest(profile: Profile, policy, digests: dict[int, str], lied_before: bool) -> str:
    """The digest a profile reports when it acks `policy`: version-drift lies once, on its first
    reload after the initial policy (it still holds the old weights). `digests` holds the
    digests of the versions the worker has seen published."""
    version = policy.policy_version
    if profile is Profile.version_drift and version >= 1 and not lied_before and version - 1 in digests:
        return digests[version - 1]
    return policy.checkpoint_digest
