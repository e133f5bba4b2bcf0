"""Dispatch rules (exchange/dispatch.py): who may run a job, what its lease requires, who goes first."""

from __future__ import annotations

import pytest
from helpers import TOKENIZER, job, manifest, policy, sha

from rollmarket.exchange.dispatch import job_mismatch, lease_requirements, policy_mismatch, worker_score

# --------------------------------------------------------------------------------------------
# policy_mismatch
# --------------------------------------------------------------------------------------------


def test_a_matching_worker_can_run_the_policy():
    assert policy_mismatch(manifest(), policy()) is None


def test_tokenizer_must_be_supported():
    assert policy_mismatch(manifest(supported_tokenizer_hashes=[sha("other")]), policy()) == "tokenizer not supported"
    assert policy_mismatch(manifest(supported_tokenizer_hashes=[sha("other"), TOKENIZER]), policy()) is None


def test_a_wildcard_tokenizer_loads_whatever_the_policy_names():
    assert policy_mismatch(manifest(supported_tokenizer_hashes=["*"]), policy()) is None


def test_engine_must_be_allowed_by_the_policy():
    reason = policy_mismatch(manifest(engine_name="hf"), policy(allowed_engines=["vllm"]))
    assert reason is not None and "engine hf" in reason
    assert policy_mismatch(manifest(engine_name="vllm"), policy(allowed_engines=["vllm", "sglang"])) is None
    assert policy_mismatch(manifest(engine_name="anything"), policy(allowed_engines=[])) is None


def test_contract_version_must_match():
    reason = policy_mismatch(manifest(contract_version="rollmarket.contracts/0"), policy())
    assert reason is not None and "rollmarket.contracts/0" in reason


@pytest.mark.parametrize("flags", [{"returns_token_ids": False}, {"returns_sampled_logprobs": False}])
def test_worker_must_return_token_ids_and_logprobs(flags):
    assert policy_mismatch(manifest(**flags), policy()) == "worker does not return token ids and sampled logprobs"


def test_policy_mismatch_reports_the_tokenizer_first():
    worker = manifest(supported_tokenizer_hashes=[sha("other")], engine_name="hf", returns_token_ids=False)
    assert policy_mismatch(worker, policy(allowed_engines=["vllm"])) == "tokenizer not supported"


# --------------------------------------------------------------------------------------------
# job_mismatch
# --------------------------------------------------------------------------------------------


def test_a_matching_worker_can_run_the_job():
    assert job_mismatch(manifest(), job(), policy()) is None


def test_job_mismatch_includes_policy_mismatch():
    assert job_mismatch(manifest(supported_tokenizer_hashes=[sha("x")]), job(), policy()) == "tokenizer not supported"


def test_precision_comes_from_the_job_or_else_the_policy():
    bf16_worker = manifest(precision_classes=["bf16"])
    assert job_mismatch(bf16_worker, job(required_precision="fp8"), policy()) == "precision fp8 not offered"
    assert job_mismatch(bf16_worker, job(), policy(precision_class="fp8")) == "precision fp8 not offered"
    # The job's requirement overrides the policy's class.
    assert job_mismatch(bf16_worker, job(required_precision="bf16"), policy(precision_class="fp8")) is None


def test_quantization_comes_from_the_job_or_else_the_policy():
    plain = manifest()  # quantization_classes defaults to ["none"]
    assert job_mismatch(plain, job(required_quantization="fp8-e4m3"), policy()) == "quantization fp8-e4m3 not offered"
    assert job_mismatch(plain, job(), policy(quantization_class="int4")) == "quantization int4 not offered"
    quantized = manifest(quantization_classes=["none", "int4"])
    assert job_mismatch(quantized, job(required_quantization="int4"), policy()) is None


def test_context_must_fit_the_worker():
    worker = manifest(max_context_tokens=4096)
    assert job_mismatch(worker, job(max_context_tokens=4096), policy()) is None
    reason = job_mismatch(worker, job(max_context_tokens=4097), policy())
    assert reason is not None and "4097" in reason and "4096" in reason


def test_engine_must_be_allowed_by_the_job():
    reason = job_mismatch(manifest(engine_name="hf"), job(allowed_engines=["vllm"]), policy())
    assert reason == "engine hf not allowed by the job"
    assert job_mismatch(manifest(engine_name="vllm"), job(allowed_engines=["vllm"]), policy()) is None


def test_routed_experts_need_a_worker_that_returns_them():
    assert job_mismatch(manifest(), job(requires_routed_experts=True), policy()) == "job needs routed experts"
    assert job_mismatch(manifest(returns_routed_experts=True), job(requires_routed_experts=True), policy()) is None
    assert job_mismatch(manifest(returns_routed_experts=True), job(), policy()) is None


def test_a_signing_policy_leaves_out_workers_without_a_key():
    reason = policy_mismatch(manifest(), policy(require_signatures=True))
    assert reason == "the policy requires signed groups and the worker registered no public key"
    assert policy_mismatch(manifest(public_key="A" * 44), policy(require_signatures=True)) is None
    assert policy_mismatch(manifest(), policy()) is None


def test_fingerprint_rules_judge_the_acked_fingerprint_else_the_registered_one():
    registered, acked = sha("build-a"), sha("build-a at v3")
    worker = manifest(engine_fingerprint=registered)
    only_acked = job(required_fingerprints=[acked])
    assert "not one the job requires" in job_mismatch(worker, only_acked, policy())
    assert job_mismatch(worker, only_acked, policy(), fingerprint=acked) is None
    not_acked = job(excluded_fingerprints=[acked])
    assert job_mismatch(worker, not_acked, policy()) is None
    assert "excluded by the job" in job_mismatch(worker, not_acked, policy(), fingerprint=acked)


# --------------------------------------------------------------------------------------------
# lease_requirements
# --------------------------------------------------------------------------------------------


def test_lease_requirements_copy_the_policy_and_the_job():
    j = job(2, group_size=4, max_context_tokens=2048, requires_routed_experts=True)
    p = policy(5, vocab_size=321, precision_class="fp8", quantization_class="int4")
    req = lease_requirements(j, p)
    assert req.policy_version == 5
    assert req.checkpoint_digest == sha("ckpt-5")
    assert req.tokenizer_hash == TOKENIZER
    assert req.precision_class == "fp8"
    assert req.quantization_class == "int4"
    assert req.group_size == 4
    assert req.max_context_tokens == 2048
    assert req.sampling_config_hash == j.sampling_config.digest()
    assert req.requires_routed_experts is True
    assert req.vocab_size == 321
    assert req.allowed_engines == []


def test_lease_requirements_prefer_the_jobs_numerics():
    req = lease_requirements(job(required_precision="bf16", required_quantization="none"),
                             policy(precision_class="fp8", quantization_class="int4"))
    assert (req.precision_class, req.quantization_class) == ("bf16", "none")


@pytest.mark.parametrize("job_engines,policy_engines,expected", [
    ([], [], []),
    (["vllm", "hf"], [], ["vllm", "hf"]),
    ([], ["sglang"], ["sglang"]),
    (["vllm", "hf", "sglang"], ["sglang", "hf"], ["hf", "sglang"]),
])
def test_lease_engines_are_what_both_job_and_policy_allow(job_engines, policy_engines, expected):
    req = lease_requirements(job(allowed_engines=job_engines), policy(allowed_engines=policy_engines))
    assert req.allowed_engines == expected


def test_vocab_size_none_skips_the_check():
    assert lease_requirements(job(), policy(vocab_size=None)).vocab_size is None


def test_lease_requirements_carry_the_trust_rules():
    req = lease_requirements(job(required_fingerprints=[sha("a")], excluded_fingerprints=[sha("b")]),
                             policy(require_signatures=True))
    assert (req.require_signature, req.required_fingerprints, req.excluded_fingerprints) == (
        True, [sha("a")], [sha("b")])
    plain = lease_requirements(job(), policy())
    assert (plain.require_signature, plain.required_fingerprints, plain.excluded_fingerprints) == (False, [], [])


# --------------------------------------------------------------------------------------------
# worker_score
# --------------------------------------------------------------------------------------------


def test_worker_score_is_quality_minus_a_relative_price_penalty():
    # 0.8 − 0.5 · (2 / 4) = 0.55
    assert worker_score(0.8, 2.0, 4.0, 0.5) == pytest.approx(0.55)
    # the most expensive worker pays the full weight: 0.8 − 0.5 · 1 = 0.3
    assert worker_score(0.8, 4.0, 4.0, 0.5) == pytest.approx(0.3)
    # free, or price ignored
    assert worker_score(0.8, 0.0, 4.0, 0.5) == pytest.approx(0.8)
    assert worker_score(0.8, 4.0, 4.0, 0.0) == pytest.approx(0.8)


def test_worker_score_without_prices_is_the_quality():
    """A pool where nobody states a price (max 0) must not divide by zero."""
    assert worker_score(0.6, 0.0, 0.0, 1.0) == 0.6

