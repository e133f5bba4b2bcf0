"""Which worker may run which job, and which worker the exchange would rather give it to.

Pure functions over contracts, shared by every store backend.
"""

from __future__ import annotations

from ..contracts import LeaseRequirements, PolicyManifest, RolloutJob, WorkerManifest
from ..gate import fingerprint_refused

ANY_TOKENIZER = "*"


def policy_mismatch(worker: WorkerManifest, policy: PolicyManifest) -> str | None:
    """Why a worker cannot run this policy at all, or None when it can."""
    if (policy.tokenizer_hash not in worker.supported_tokenizer_hashes
            and ANY_TOKENIZER not in worker.supported_tokenizer_hashes):
        return "tokenizer not supported"
    if policy.allowed_engines and worker.engine_name not in policy.allowed_engines:
        return f"engine {worker.engine_name} not allowed by the policy"
    if worker.contract_version != policy.engine_contract_version:
        return f"contract {worker.contract_version} != {policy.engine_contract_version}"
    if not (worker.returns_token_ids and worker.returns_sampled_logprobs):
        return "worker does not return token ids and sampled logprobs"
    if policy.require_signatures and worker.public_key is None:
        return "the policy requires signed groups and the worker registered no public key"
    return None


def job_mismatch(worker: WorkerManifest, job: RolloutJob, policy: PolicyManifest,
                 fingerprint: str | None = None) -> str | None:
    """Why a worker cannot run this job under this policy, or None when it can. `fingerprint` is the
    one the worker acked for the version it runs; None means its manifest's (before any ack)."""
    reason = policy_mismatch(worker, policy)
    if reason:
        return reason
    precision = job.required_precision or policy.precision_class
    if precision not in worker.precision_classes:
        return f"precision {precision} not offered"
    quantization = job.required_quantization or policy.quantization_class
    if quantization not in worker.quantization_classes:
        return f"quantization {quantization} not offered"
    if job.max_context_tokens > worker.max_context_tokens:
        return f"context {job.max_context_tokens} exceeds the worker's {worker.max_context_tokens}"
    if job.allowed_engines and worker.engine_name not in job.allowed_engines:
        return f"engine {worker.engine_name} not allowed by the job"
    if job.requires_routed_experts and not worker.returns_routed_experts:
        return "job needs routed experts"
    return fingerprint_refused(fingerprint or worker.engine_fingerprint, job.required_fingerprints,
                               job.excluded_fingerprints)


def lease_requirements(job: RolloutJob, policy: PolicyManifest) -> LeaseRequirements:
    """What a submission under a lease on `job` at `policy` must match."""
    engines = sorted(set(job.allowed_engines) & set(policy.allowed_engines)) if (
        job.allowed_engines and policy.allowed_engines) else (job.allowed_engines or policy.allowed_engines)
    return LeaseRequirements(
        policy_version=policy.policy_version,
        checkpoint_digest=policy.checkpoint_digest,
        tokenizer_hash=policy.tokenizer_hash,
        precision_class=job.required_precision or policy.precision_class,
        quantization_class=job.required_quantization or policy.quantization_class,
        group_size=job.group_size,
        max_context_tokens=job.max_context_tokens,
        sampling_config_hash=job.sampling_config_hash,
        allowed_engines=list(engines),
        requires_routed_experts=job.requires_routed_experts,
        vocab_size=policy.vocab_size,
        require_signature=policy.require_signatures,
        required_fingerprints=list(job.required_fingerprints),
        excluded_fingerprints=list(job.excluded_fingerprints),
    )


def worker_score(quality: float, price: float, max_price: float, price_weight: float) -> float:
    """Higher is better: trainer-feedback quality minus a price penalty relative to the pool."""
    relative_price = price / max_price if max_price > 0 else 0.0
    return quality - price_weight * relative_price

