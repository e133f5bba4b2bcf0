"""Validators at the exchange's door (gate/validate.py) and signatures (gate/integrity.py).

Every RejectionReason that check_group or check_against_lease can produce is provoked here by a
minimal group built for it, directly from contracts (no client, no server). A valid group and
lease must give no findings at all.
"""

from __future__ import annotations

import base64
import math
from datetime import datetime, timedelta, timezone

import numpy as np
import pytest
from helpers import TOKENIZER, sha

from rollmarket.contracts import (
    LeaseRequirements,
    LeaseState,
    RejectionReason as RR,
    RolloutLease,
    SampleGroup,
    SamplingConfig,
    Trajectory,
    WorkerManifest,
)
from rollmarket.gate import (
    GateConfig,
    check_against_lease,
    check_group,
    check_provenance,
    generate_signing_key,
    hash_matches,
    load_public_key,
    public_key_b64,
    reasons_of,
    sign_group,
    signature_valid,
)
from rollmarket.gate.validate import Finding

NOW = datetime(2024, 5, 1, 12, 0, tzinfo=timezone.utc)
CKPT = sha("ckpt-3")
SAMPLING = SamplingConfig().digest()
FINGERPRINT = sha("fp")


def traj(index: int = 0, **overrides) -> Trajectory:
    """3 prompt tokens, 4 response tokens; token 2 is tool output."""
    fields = dict(sample_index=index, prompt_token_ids=[1, 2, 3], response_token_ids=[10, 11, 12, 13],
                  logprobs=[-0.5, -1.0, 0.0, -0.25], action_mask=[1, 1, 0, 1],
                  tool_output_mask=[0, 0, 1, 0], routed_experts=np.zeros((4, 2, 2), np.int16),
                  turn_boundaries=[0, 2])
    fields.update(overrides)
    return Trajectory(**fields)


def group(trajectories: list[Trajectory] | None = None, *, seal: bool = True, **overrides) -> SampleGroup:
    fields = dict(group_id="grp-1", job_id="job-1", lease_id="lease-1", worker_id="w1", task_id="t1",
                  policy_version=3, checkpoint_digest=CKPT, tokenizer_hash=TOKENIZER,
                  sampling_config_hash=SAMPLING, engine_name="hf", engine_version="1.0",
                  engine_fingerprint=FINGERPRINT, device_type="cpu", precision_class="bf16",
                  quantization_class="none", created_at=NOW - timedelta(seconds=1),
                  trajectories=trajectories if trajectories is not None else [traj(0), traj(1)])
    fields.update(overrides)
    built = SampleGroup(**fields)
    return built.sealed() if seal else built


def lease(state: LeaseState = LeaseState.issued, expires_at: datetime = NOW + timedelta(seconds=60),
          **requirements) -> RolloutLease:
    req = dict(policy_version=3, checkpoint_digest=CKPT, tokenizer_hash=TOKENIZER, precision_class="bf16",
               quantization_class="none", group_size=2, max_context_tokens=7, sampling_config_hash=SAMPLING,
               allowed_engines=["hf", "vllm"], requires_routed_experts=True, vocab_size=14)
    req.update(requirements)
    return RolloutLease(lease_id="lease-1", job_id="job-1", worker_id="w1", policy_version=3,
                        requirements=LeaseRequirements(**req), issued_at=NOW - timedelta(seconds=1),
                        expires_at=expires_at, state=state)


def lease_reasons(g: SampleGroup, l: RolloutLease | None = None, *, now: datetime = NOW,
                  acked: str | None = FINGERPRINT, public_key=None) -> list[RR]:
    return reasons_of(check_against_lease(g, l or lease(), now=now, acked_fingerprint=acked,
                                          public_key=public_key))


def group_reasons(g: SampleGroup, config: GateConfig = GateConfig()) -> list[RR]:
    return reasons_of(check_group(g, config))


def test_a_valid_group_under_its_lease_has_no_findings():
    g = group()
    assert check_group(g) == []
    assert check_against_lease(g, lease(), now=NOW, acked_fingerprint=FINGERPRINT, public_key=None) == []


# --------------------------------------------------------------------------------------------
# check_group
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides", [
    {"prompt_token_ids": None}, {"prompt_token_ids": []},
    {"response_token_ids": None}, {"response_token_ids": []},
], ids=["prompt-none", "prompt-empty", "response-none", "response-empty"])
def test_missing_token_ids(overrides):
    findings = check_group(group([traj(0), traj(1, **overrides)]))
    assert reasons_of(findings) == [RR.missing_token_ids]
    assert findings[0].sample_index == 1


@pytest.mark.parametrize("overrides", [
    {"logprobs": [-0.5, -1.0, 0.0]},
    {"action_mask": [1, 1, 0]},
    {"tool_output_mask": [0, 0, 1, 0, 0]},
    {"routed_experts": np.zeros((3, 2, 2), np.int16)},
], ids=["logprobs", "action_mask", "tool_output_mask", "routed_experts"])
def test_length_mismatch(overrides):
    findings = check_group(group([traj(0, **overrides), traj(1)]))
    assert reasons_of(findings) == [RR.length_mismatch]
    assert findings[0].sample_index == 0
    assert next(iter(overrides)) in findings[0].message


def test_missing_logprobs():
    assert group_reasons(group([traj(0), traj(1, logprobs=None)])) == [RR.missing_logprobs]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_logprobs(bad):
    findings = check_group(group([traj(0, logprobs=[-0.5, bad, 0.0, -0.25]), traj(1)]))
    assert reasons_of(findings) == [RR.non_finite_logprobs]
    assert "position 1" in findings[0].message


def test_logprob_out_of_range_only_for_sampled_tokens():
    """A logprob above 0 (plus a float tolerance) is impossible for a sampled token.

    The tool-output slot (token 2, action 0) is ignored, as the Trajectory docstring promises.
    """
    assert group_reasons(group([traj(0, logprobs=[-0.5, 0.5, 0.0, -0.25]), traj(1)])) == [RR.logprob_out_of_range]
    assert group_reasons(group([traj(0, logprobs=[-0.5, -1.0, 7.0, -0.25]), traj(1)])) == []
    assert group_reasons(group([traj(0, logprobs=[-0.5, 0.0009, 0.0, -0.25]), traj(1)])) == []
    assert group_reasons(group([traj(0, logprobs=[-0.5, 0.0011, 0.0, -0.25]), traj(1)])) == [RR.logprob_out_of_range]
    loose = GateConfig(logprob_tolerance=0.01)
    assert group_reasons(group([traj(0, logprobs=[-0.5, 0.005, 0.0, -0.25]), traj(1)]), loose) == []


def test_logprob_out_of_range_without_an_action_mask_checks_every_token():
    g = group([traj(0, action_mask=None, tool_output_mask=None, logprobs=[-0.5, -1.0, 0.5, -0.25]), traj(1)])
    assert group_reasons(g) == [RR.logprob_out_of_range]


@pytest.mark.parametrize("overrides", [
    {"action_mask": [1, 1, 1, 1]},          # token 2 is both action and tool output
    {"turn_boundaries": [0, 4]},            # 4 is past the last response token
    {"turn_boundaries": [-1, 2]},
    {"turn_boundaries": [2, 1]},            # not increasing
    {"turn_boundaries": [1, 1]},
], ids=["action-and-tool", "boundary-past-end", "boundary-negative", "boundaries-decreasing",
        "boundaries-repeated"])
def test_invalid_mask(overrides):
    assert group_reasons(group([traj(0, **overrides), traj(1)])) == [RR.invalid_mask]


def test_hash_missing_or_wrong():
    unsealed = group(seal=False)
    assert group_reasons(unsealed) == [RR.hash_mismatch]
    sealed = group()
    changed = SampleGroup.model_validate({**sealed.model_dump(), "engine_version": "1.1"})
    assert group_reasons(changed) == [RR.hash_mismatch]
    reward_changed = group([traj(0), traj(1, reward=1.0)], seal=False).model_copy(
        update={"content_hash": sealed.content_hash})
    assert group_reasons(reward_changed) == [RR.hash_mismatch]
    assert hash_matches(sealed) and not hash_matches(changed) and not hash_matches(unsealed)


def test_findings_name_the_sample_and_collect_every_problem():
    g = group([traj(0, logprobs=None), traj(1, action_mask=[1, 1, 1, 1], prompt_token_ids=[])], seal=False)
    findings = check_group(g)
    assert reasons_of(findings) == [RR.missing_logprobs, RR.missing_token_ids, RR.invalid_mask,
                                    RR.hash_mismatch]
    assert [f.sample_index for f in findings] == [0, 1, 1, None]
    assert findings[0].as_dict() == {"reason": "missing_logprobs", "message": findings[0].message,
                                     "sample_index": 0}


def test_reasons_of_keeps_first_occurrence_order():
    findings = [Finding(RR.length_mismatch, "a", 0), Finding(RR.hash_mismatch, "b"),
                Finding(RR.length_mismatch, "c", 1)]
    assert reasons_of(findings) == [RR.length_mismatch, RR.hash_mismatch]


# --------------------------------------------------------------------------------------------
# check_against_lease
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides", [{"job_id": "job-2"}, {"worker_id": "w2"}])
def test_lease_mismatch(overrides):
    assert lease_reasons(group(**overrides)) == [RR.lease_mismatch]


def test_expired_lease():
    assert lease_reasons(group(), lease(expires_at=NOW)) == [RR.expired_lease]  # expiry is exclusive
    assert lease_reasons(group(), lease(expires_at=NOW - timedelta(seconds=1))) == [RR.expired_lease]
    assert lease_reasons(group(), lease(expires_at=NOW + timedelta(microseconds=1))) == []
    assert lease_reasons(group(), lease(state=LeaseState.expired, expires_at=NOW + timedelta(hours=1))) == [
        RR.expired_lease]


@pytest.mark.parametrize("state", [LeaseState.submitted, LeaseState.abandoned, LeaseState.failed])
def test_lease_not_active(state):
    assert lease_reasons(group(), lease(state=state)) == [RR.lease_not_active]
    # A finished lease past its expiry is reported by its state, not as expired.
    assert lease_reasons(group(), lease(state=state, expires_at=NOW - timedelta(1))) == [RR.lease_not_active]


@pytest.mark.parametrize("field,value,reason", [
    ("policy_version", 4, RR.version_mismatch),
    ("checkpoint_digest", sha("ckpt-4"), RR.checkpoint_mismatch),
    ("tokenizer_hash", sha("other-tokenizer"), RR.tokenizer_mismatch),
    ("precision_class", "fp8", RR.precision_mismatch),
    ("quantization_class", "fp8-e4m3", RR.quantization_mismatch),
    ("sampling_config_hash", SamplingConfig(temperature=0.5).digest(), RR.sampling_config_mismatch),
])
def test_provenance_must_match_the_lease(field, value, reason):
    findings = check_against_lease(group(**{field: value}), lease(), now=NOW, acked_fingerprint=FINGERPRINT,
                                   public_key=None)
    assert reasons_of(findings) == [reason]
    assert field in findings[0].message


def test_engine_not_allowed():
    assert lease_reasons(group(engine_name="sglang")) == [RR.engine_not_allowed]
    assert lease_reasons(group(engine_name="sglang"), lease(allowed_engines=[])) == []  # empty allows any


def test_fingerprint_mismatch():
    assert lease_reasons(group(), acked=sha("fp-other")) == [RR.fingerprint_mismatch]
    assert lease_reasons(group(), acked=None) == []  # no ack on record: nothing to compare


def test_group_size_mismatch():
    assert lease_reasons(group([traj(0)])) == [RR.group_size_mismatch]
    assert lease_reasons(group([traj(0), traj(1), traj(2)])) == [RR.group_size_mismatch]


def test_context_overflow():
    """3 prompt + 4 response = 7 tokens: fits a context of 7, overflows one of 6."""
    assert lease_reasons(group(), lease(max_context_tokens=7)) == []
    findings = check_against_lease(group(), lease(max_context_tokens=6), now=NOW,
                                   acked_fingerprint=FINGERPRINT, public_key=None)
    assert reasons_of(findings) == [RR.context_overflow]
    assert [f.sample_index for f in findings] == [0, 1]


def test_token_out_of_vocab():
    """Largest id is 13: a vocabulary of 14 holds it, one of 13 does not; prompt ids count too."""
    assert lease_reasons(group(), lease(vocab_size=14)) == []
    assert lease_reasons(group(), lease(vocab_size=13)) == [RR.token_out_of_vocab]
    high_prompt = group([traj(0, prompt_token_ids=[1, 2, 20]), traj(1)])
    assert lease_reasons(high_prompt, lease(vocab_size=14)) == [RR.token_out_of_vocab]
    assert lease_reasons(high_prompt, lease(vocab_size=None)) == []


def test_missing_routed_experts():
    g = group([traj(0), traj(1, routed_experts=None)])
    assert lease_reasons(g) == [RR.missing_routed_experts]
    assert lease_reasons(g, lease(requires_routed_experts=False)) == []


def test_every_lease_problem_is_reported_together():
    g = group([traj(0)], job_id="job-2", policy_version=4, engine_name="sglang")
    l = lease(expires_at=NOW, max_context_tokens=6, vocab_size=5)
    assert lease_reasons(g, l, acked=sha("x")) == [
        RR.lease_mismatch, RR.expired_lease, RR.version_mismatch, RR.engine_not_allowed,
        RR.fingerprint_mismatch, RR.group_size_mismatch, RR.context_overflow, RR.token_out_of_vocab]


# --------------------------------------------------------------------------------------------
# check_provenance: the group's engine must be the one its worker registered
# --------------------------------------------------------------------------------------------

def registered(**overrides) -> WorkerManifest:
    """The manifest of the worker that sends `group()`: hf 1.0 on cpu at bf16, no quantization."""
    fields = dict(worker_id="w1", engine_name="hf", engine_version="1.0", engine_fingerprint=FINGERPRINT,
                  device_type="cpu", precision_classes=["bf16"], supported_tokenizer_hashes=[TOKENIZER],
                  max_context_tokens=64)
    return WorkerManifest(**{**fields, **overrides})


def test_provenance_that_agrees_with_the_manifest_passes():
    assert check_provenance(group(), registered()) == []
    assert check_provenance(group(precision_class="fp8"), registered(precision_classes=["bf16", "fp8"])) == []


@pytest.mark.parametrize("field,claimed,reason", [
    ("engine_name", "vllm", RR.engine_mismatch),
    ("engine_version", "0.9.2", RR.engine_version_mismatch),
    ("device_type", "h100", RR.device_mismatch),
    ("precision_class", "fp8", RR.precision_mismatch),
    ("quantization_class", "fp8-e4m3", RR.quantization_mismatch),
])
def test_a_group_cannot_claim_what_its_worker_did_not_register(field, claimed, reason):
    """The lease allows it (its requirements are met or silent), the manifest does not."""
    findings = check_provenance(group(**{field: claimed}), registered())
    assert reasons_of(findings) == [reason]
    assert claimed in findings[0].message


def test_check_against_lease_runs_the_provenance_check_when_given_the_manifest():
    claims_vllm = group(engine_name="vllm")
    assert lease_reasons(claims_vllm, lease(allowed_engines=[])) == []
    findings = check_against_lease(claims_vllm, lease(allowed_engines=[]), now=NOW, acked_fingerprint=FINGERPRINT,
                                   public_key=None, manifest=registered())
    assert reasons_of(findings) == [RR.engine_mismatch]


def test_fingerprint_before_any_ack_is_the_registered_one():
    findings = check_against_lease(group(), lease(), now=NOW, acked_fingerprint=None, public_key=None,
                                   manifest=registered(engine_fingerprint=sha("another build")))
    assert reasons_of(findings) == [RR.fingerprint_mismatch]


def test_lease_checks_and_group_checks_together_cover_the_reasons():
    """Every RejectionReason is produced by a test above, except unknown_lease (the store's)."""
    produced_here = {
        RR.missing_token_ids, RR.length_mismatch, RR.missing_logprobs, RR.non_finite_logprobs,
        RR.logprob_out_of_range, RR.invalid_mask, RR.hash_mismatch, RR.lease_mismatch,
        RR.expired_lease, RR.lease_not_active, RR.version_mismatch, RR.checkpoint_mismatch,
        RR.tokenizer_mismatch, RR.precision_mismatch, RR.quantization_mismatch,
        RR.sampling_config_mismatch, RR.engine_not_allowed, RR.fingerprint_mismatch,
        RR.group_size_mismatch, RR.context_overflow, RR.token_out_of_vocab,
        RR.missing_routed_experts, RR.bad_signature, RR.engine_mismatch, RR.engine_version_mismatch,
        RR.device_mismatch, RR.signature_required, RR.fingerprint_not_allowed,
    }
    assert set(RR) - produced_here == {RR.unknown_lease}


# --------------------------------------------------------------------------------------------
# Signatures
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def key():
    return generate_signing_key()


def test_a_signed_group_from_a_worker_with_that_key_is_accepted(key):
    signed = sign_group(group(seal=False), key)
    assert signed.content_hash == group().content_hash
    assert signed.signature is not None
    assert check_group(signed) == []
    assert lease_reasons(signed, public_key=load_public_key(public_key_b64(key))) == []


def test_a_tampered_group_is_caught(key):
    public = load_public_key(public_key_b64(key))
    signed = sign_group(group(seal=False), key)
    # Changed after signing, hash left alone: the hash no longer matches the bytes.
    tampered = SampleGroup.model_validate({**signed.model_dump(), "trajectories": [traj(0), traj(1, reward=9.0)]})
    assert group_reasons(tampered) == [RR.hash_mismatch]
    # Changed and resealed: the hash matches, but the worker never signed it.
    resealed = tampered.sealed()
    assert group_reasons(resealed) == []
    assert lease_reasons(resealed, public_key=public) == [RR.bad_signature]


def test_a_group_signed_with_another_key_is_refused(key):
    other = generate_signing_key()
    signed = sign_group(group(seal=False), other)
    assert lease_reasons(signed, public_key=load_public_key(public_key_b64(key))) == [RR.bad_signature]


def test_a_worker_with_a_key_must_sign(key):
    assert lease_reasons(group(), public_key=load_public_key(public_key_b64(key))) == [RR.bad_signature]


@pytest.mark.parametrize("signature", ["", "not base64!", base64.b64encode(b"x" * 64).decode(),
                                       base64.b64encode(b"short").decode()])
def test_malformed_signatures_are_refused(key, signature):
    g = group().model_copy(update={"signature": signature})
    assert lease_reasons(g, public_key=load_public_key(public_key_b64(key))) == [RR.bad_signature]


def test_a_signed_group_from_a_worker_without_a_key_is_refused(key):
    """A signature nobody can check is a worker claiming a trust it did not register."""
    signed = sign_group(group(seal=False), key)
    assert lease_reasons(signed, public_key=None) == [RR.bad_signature]


def test_the_signature_covers_the_content_hash_only(key):
    """The exchange stamps policy_lag_steps after signing; that must not break the signature."""
    public = load_public_key(public_key_b64(key))
    signed = sign_group(group(seal=False), key)
    stamped = signed.model_copy(update={"policy_lag_steps": 6})
    assert check_group(stamped) == []
    assert lease_reasons(stamped, public_key=public) == []
    assert signature_valid(signed.content_hash, signed.signature, public)
    assert not signature_valid(sha("other"), signed.signature, public)


def test_a_signing_policy_refuses_an_unsigned_group_and_takes_a_signed_one(key):
    public = load_public_key(public_key_b64(key))
    strict = lease(require_signature=True)
    assert lease_reasons(group(), strict) == [RR.signature_required]
    assert lease_reasons(group(), strict, public_key=public) == [RR.signature_required]
    assert lease_reasons(sign_group(group(seal=False), key), strict, public_key=public) == []
    assert lease_reasons(group(), lease()) == []  # off by default


@pytest.mark.parametrize("rules,allowed", [
    ({}, True),
    ({"required_fingerprints": [FINGERPRINT]}, True),
    ({"required_fingerprints": [sha("another build")]}, False),
    ({"excluded_fingerprints": [FINGERPRINT]}, False),
    ({"excluded_fingerprints": [sha("another build")]}, True),
])
def test_a_jobs_fingerprint_rules_hold_at_submit(rules, allowed):
    assert lease_reasons(group(), lease(**rules)) == ([] if allowed else [RR.fingerprint_not_allowed])


@pytest.mark.parametrize("text", ["", "not base64!", base64.b64encode(b"x" * 31).decode()])
def test_load_public_key_refuses_what_is_not_a_key(text):
    with pytest.raises(ValueError):
        load_public_key(text)


def test_public_key_is_base64_of_32_raw_bytes(key):
    assert len(base64.b64decode(public_key_b64(key), validate=True)) == 32
