"""Contracts: every record validates, refuses bad input with a ValidationError, and round-trips.

Covers the pydantic records of `rollmarket.contracts` (unknown fields, non-finite floats, sha256
and id strings, TaskSpec and RolloutJob rules), the token arrays of `contracts/arrays.py`, the
content hash of `contracts/sample.py`, and `rollmarket schema --out DIR`.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import subprocess
import sys
import typing
from datetime import datetime, timedelta, timezone

import numpy as np
import pytest
from helpers import TOKENIZER, job, manifest, policy, sha
from pydantic import ValidationError

import rollmarket.contracts as contracts
from rollmarket.contracts import (
    AuditEvent,
    AuditPage,
    BudgetReport,
    DecisionReason,
    DecisionStatus,
    EnqueueReceipt,
    ErrorBody,
    ErrorCode,
    ErrorDetail,
    FailureKind,
    FailureReport,
    FetchedGroup,
    FetchResult,
    FinishReason,
    GroupDecision,
    GroupStatus,
    HeartbeatReply,
    JobView,
    LeaseGrant,
    LeaseRequirements,
    PolicyManifest,
    PoolStatus,
    Record,
    ReloadAck,
    ReloadStatus,
    ReportReceipt,
    RolloutJob,
    RolloutLease,
    SampleGroup,
    SamplingConfig,
    SubmissionReceipt,
    TaskSpec,
    Tier,
    TrainerFeedback,
    Trajectory,
    WorkerDetail,
    WorkerHeartbeat,
    WorkerManifest,
    WorkerRegistration,
    WorkerSummary,
    content_hash,
)
from rollmarket.contracts import sample as sample_module
from rollmarket.contracts.schema import EXPORTED
from rollmarket.contracts.wire import packb, unpackb

T0 = datetime(2024, 5, 1, 12, 30, 15, 123456, tzinfo=timezone.utc)


# --------------------------------------------------------------------------------------------
# One valid instance of every contract
# --------------------------------------------------------------------------------------------


def make_trajectory(index: int = 0, **overrides) -> Trajectory:
    fields = dict(
        sample_index=index,
        prompt_token_ids=[11, 12, 13],
        response_token_ids=[21, 22, 23, 24],
        logprobs=[-0.5, -1.25, 0.0, -2.0],
        action_mask=[1, 1, 0, 1],
        tool_output_mask=[0, 0, 1, 0],
        routed_experts=[[[1, 2]], [[3, 4]], [[5, 6]], [[7, 0]]],
        reward=1.5,
        reward_components={"correct": 1.0, "format": 0.5},
        turn_boundaries=[0, 2],
        finish_reason=FinishReason.tool_calls,
    )
    fields.update(overrides)
    return Trajectory(**fields)


def make_group(**overrides) -> SampleGroup:
    fields = dict(
        group_id="grp-1", job_id="job-1", lease_id="lease-1", worker_id="w1", task_id="task-1",
        policy_version=3, checkpoint_digest=sha("ckpt-3"), tokenizer_hash=TOKENIZER,
        sampling_config_hash=SamplingConfig().digest(), engine_name="hf", engine_version="1.0",
        engine_fingerprint=sha("fp"), device_type="cpu", precision_class="bf16",
        quantization_class="none", trajectories=[make_trajectory(0), make_trajectory(1, reward=0.0)],
        wall_time_s=1.25, created_at=T0,
    )
    fields.update(overrides)
    return SampleGroup(**fields)


def make_requirements() -> LeaseRequirements:
    return LeaseRequirements(
        policy_version=3, checkpoint_digest=sha("ckpt-3"), tokenizer_hash=TOKENIZER,
        precision_class="bf16", quantization_class="none", group_size=2, max_context_tokens=64,
        sampling_config_hash=SamplingConfig().digest(), allowed_engines=["hf"],
        requires_routed_experts=False, vocab_size=1000,
    )


def make_lease() -> RolloutLease:
    return RolloutLease(lease_id="lease-1", job_id="job-1", worker_id="w1", policy_version=3,
                        requirements=make_requirements(), issued_at=T0,
                        expires_at=T0 + timedelta(seconds=60))


def make_report() -> BudgetReport:
    return BudgetReport(
        group_id="grp-1", n_tokens=10, n_sequences=2, clamp=20.0, token_ess=0.9, sequence_ess=0.8,
        mean_delta=0.1, mean_abs_delta=0.2, max_abs_delta=0.7, clipped_fraction=0.0,
        veto_fraction=0.0, second_moment=1.1, top1pct_mass=0.2, kl_k1=-0.1, kl_k3=0.01, chi2=0.1,
        mean_prob_diff=0.003, router_flip_rate=0.05, policy_lag_steps=1, rollout_corr=make_rollout_corr(),
    )


def make_position_profile() -> contracts.PositionProfile:
    return contracts.PositionProfile(
        rollout_engine="fp8", trainer_engine="fp32", n_trajectories=3, tokens_after_eos=5,
        buckets=[contracts.PositionBucket(start=0, stop=16, n_tokens=48, n_trajectories=3, mean_abs_delta=0.05,
                                          kl_k3=0.001)])


def make_rollout_corr() -> contracts.RolloutCorrFigures:
    return contracts.RolloutCorrFigures(
        is_threshold=2.0, is_level="token", rollout_is_eff_sample_size=0.95, rollout_is_ratio_fraction_high=0.01,
        rollout_is_ratio_fraction_low=0.0, kl=-0.1, k3_kl=0.01, chi2_token=0.1, chi2_seq=None)


def make_summary() -> WorkerSummary:
    return WorkerSummary(
        worker_id="w1", status="alive", engine_name="hf", engine_fingerprint=sha("fp"),
        precision_classes=["bf16"], loaded_version=3, aligned=True, active_leases=1, quality=0.5,
        feedback_count=0, rejected_count=0, price_hint=0.0, last_heartbeat_at=T0, registered_at=T0,
    )


def make_fetched() -> FetchedGroup:
    return FetchedGroup(group=make_group().sealed(), tier=Tier.fresh, status=GroupStatus.available,
                        received_at=T0, lag_at_arrival=0, current_lag=1, served_count=1)


def make_worst_token() -> contracts.WorstToken:
    return contracts.WorstToken(position=7, token_id=391, token_text=" 391", delta=-2.5,
                                rollout_logprob=-0.1, trainer_logprob=-2.6, context_before="17 * 23 =",
                                context_after=".", turn=1)


def make_dense_report() -> contracts.DenseMismatchReport:
    return contracts.DenseMismatchReport(
        trajectory_id="calc-1#0", rollout_engine="fp8", trainer_engine="fp32", n_tokens=12,
        token_ess=0.97, sequence_log_ratio=-0.4, mean_delta=-0.03, mean_abs_delta=0.05,
        max_abs_delta=2.5, clipped_fraction=0.0, veto_fraction=0.0, second_moment=1.03,
        top1pct_gradient_mass=0.09, kl_k1=0.03, kl_k3=0.002, chi2=0.03, log_ppl_rollout=0.8,
        log_ppl_trainer=0.83, log_ppl_diff=0.03, mean_prob_diff=0.004, response_length=15,
        worst_token=make_worst_token())


def make_interval() -> contracts.Interval:
    return contracts.Interval(mean=0.97, lo=0.95, hi=0.99, n=40)


def make_divergence() -> contracts.AgentDivergenceReport:
    return contracts.AgentDivergenceReport(
        task_id="calc-1", sample_index=0, engine_a="fp32", engine_b="fp8", first_divergent_step=1,
        kind=contracts.DivergenceKind.tool_args, tool_choice_disagreement_rate=0.0, tool_call_jaccard=0.5,
        final_answer_match_strict=False, final_answer_match_soft=True, steps_a=2, steps_b=2,
        split_turn=make_dense_report(),
        top_delta_tokens=[contracts.DeltaToken(position=3, token_text="2", delta=-1.5, rollout_logprob=-0.2,
                                               trainer_logprob=-1.7)])


def make_cell() -> contracts.MatrixCell:
    return contracts.MatrixCell(
        rollout_engine="fp8", trainer_engine="fp32", n=40, tokens=4000, token_ess=make_interval(),
        sequence_ess=0.8, mean_abs_delta=make_interval(), max_abs_delta=2.5, kl_k3=make_interval(),
        mean_prob_diff=make_interval(), router_flip_rate=make_interval(),
        token_expert_disagreement_rate=make_interval(), worst_layer=1, worst_layer_flip_rate=0.2,
        worst_token=make_worst_token(), worst_trajectory_id="calc-1#0", low_n=False)


def market_worker():
    return contracts.MarketWorker(
        worker_id="w1", status="alive", engine_name="hf", engine_version="0.1.0", device_type="cpu", device_count=1,
        region="local", precision_classes=["bf16"], engine_fingerprint=sha("fp"), quality=0.9, price_hint=1.5,
        leases=4, active_leases=1, accepted=3, rejected=1, accepted_tokens=120, decisions={"train": 3})


def market_fingerprint():
    return contracts.MarketFingerprint(engine_fingerprint=sha("fp"), quality=0.7, feedback_count=3, rejected_count=1,
                                       accepted=3, workers=["w1"])


FACTORIES: dict[type[Record], typing.Callable[[], Record]] = {
    PolicyManifest: lambda: policy(3, created_at=T0, allowed_engines=["hf"]),
    ReloadAck: lambda: ReloadAck(worker_id="w1", policy_version=3, checkpoint_digest=sha("ckpt-3"),
                                 engine_fingerprint=sha("fp"), load_seconds=0.5, loaded_at=T0),
    ReloadStatus: lambda: ReloadStatus(worker_id="w1", policy_version=3, aligned=True,
                                       active_version=3, published_version=3, acks=1, quorum=1),
    WorkerManifest: lambda: manifest("w1", price_hint=1.5, public_key="AAAA"),
    WorkerRegistration: lambda: WorkerRegistration(worker_id="w1", token="tok", heartbeat_ttl_s=10.0,
                                                   lease_ttl_s=60.0, policy=policy(3, created_at=T0)),
    WorkerHeartbeat: lambda: WorkerHeartbeat(worker_id="w1", loaded_policy_version=3,
                                             active_lease_ids=["lease-1"], tokens_per_s=12.5, sent_at=T0),
    HeartbeatReply: lambda: HeartbeatReply(worker_id="w1", status="alive", active_version=3,
                                           policy=None, reload_required=False, server_time=T0),
    TaskSpec: lambda: TaskSpec(task_id="task-1", prompt="2+2?", verifier="exact_match", answer="4"),
    SamplingConfig: lambda: SamplingConfig(temperature=0.7, top_p=0.9, top_k=50, max_tokens=16,
                                           seed=1, stop=["\n"]),
    RolloutJob: lambda: job(1, deadline=T0),
    LeaseRequirements: make_requirements,
    RolloutLease: make_lease,
    LeaseGrant: lambda: LeaseGrant(lease=make_lease(), job=job(1, job_id="job-1"),
                                   policy=policy(3, created_at=T0)),
    FailureReport: lambda: FailureReport(kind=FailureKind.timeout, message="slow", retryable=True),
    EnqueueReceipt: lambda: EnqueueReceipt(job_id="job-1", created=True),
    JobView: lambda: JobView(job=job(1, job_id="job-1"), state="queued", attempts=0, queued_at=T0),
    Trajectory: make_trajectory,
    SampleGroup: lambda: make_group().sealed(),
    SubmissionReceipt: lambda: SubmissionReceipt(
        group_id="grp-1", lease_id="lease-1", content_hash=sha("x"), tier=Tier.replay,
        policy_lag_steps=5, reasons=[DecisionReason.policy_lag_replay], received_at=T0),
    FetchedGroup: make_fetched,
    FetchResult: lambda: FetchResult(groups=[make_fetched()], active_version=3, remaining=0),
    BudgetReport: make_report,
    GroupDecision: lambda: GroupDecision(group_id="grp-1", status=DecisionStatus.train,
                                         recommended_action="use", reasons=[DecisionReason.within_budget],
                                         report=make_report(), decided_at=T0),
    TrainerFeedback: lambda: TrainerFeedback(group_id="grp-1", status=DecisionStatus.train, score=1.0,
                                             used_for_training=True, token_ess=0.9, sent_at=T0),
    ReportReceipt: lambda: ReportReceipt(group_id="grp-1", tier="fresh", status="consumed",
                                         worker_id="w1", worker_quality=0.75),
    WorkerSummary: make_summary,
    WorkerDetail: lambda: WorkerDetail(summary=make_summary(), manifest=manifest("w1")),
    PoolStatus: lambda: PoolStatus(
        active_version=3, published_version=3, policy=policy(3, created_at=T0), quorum=1, acks=1,
        alive_workers=1, dead_workers=0, jobs={"queued": 1}, leases={"issued": 1},
        groups={"fresh": 2}, workers=[make_summary()]),
    AuditEvent: lambda: AuditEvent(seq=1, at=T0, kind="submit", actor="w1", subject="grp-1",
                                   data={"tier": "fresh"}),
    AuditPage: lambda: AuditPage(events=[AuditEvent(seq=1, at=T0, kind="k", actor="a", subject="s",
                                                    data={})], next_seq=2),
    ErrorDetail: lambda: ErrorDetail(code=ErrorCode.rejected, message="no", reasons=["hash_mismatch"]),
    ErrorBody: lambda: ErrorBody(error=ErrorDetail(code=ErrorCode.not_found, message="gone")),
    contracts.MarketWorker: lambda: market_worker(),
    contracts.MarketBucket: lambda: contracts.MarketBucket(
        start=T0, by_worker={"w1": 3}, by_tier={"fresh": 2, "replay": 1}, by_status={"train": 3},
        accepted_groups=3, accepted_tokens=120),
    contracts.LagBin: lambda: contracts.LagBin(lag=1, groups=4),
    contracts.MarketFingerprint: lambda: market_fingerprint(),
    contracts.ReloadLatency: lambda: contracts.ReloadLatency(worker_id="w1", policy_version=3, seconds=0.4),
    contracts.TrainerIdle: lambda: contracts.TrainerIdle(trainer_id="t1", groups=5, span_s=10.0, busy_s=7.5,
                                                         idle_fraction=0.25),
    contracts.MarketReport: lambda: contracts.MarketReport(
        generated_at=T0, active_version=3, published_version=3, workers=[market_worker()],
        decisions={"train": 3}, bucket_s=5.0,
        timeline=[contracts.MarketBucket(start=T0, by_worker={"w1": 3}, by_tier={"fresh": 3},
                                         by_status={"train": 3}, accepted_groups=3, accepted_tokens=120)],
        submission_rejections={"hash_mismatch": 1}, gate_rejections={}, lag_histogram=[contracts.LagBin(lag=0, groups=3)],
        reload_acks=[contracts.ReloadLatency(worker_id="w1", policy_version=3, seconds=0.4)],
        reload_latency_mean_s=0.4, reload_latency_max_s=0.4, accepted_groups=3, accepted_tokens=120,
        accepted_span_s=9.0, accepted_tokens_per_s=120 / 9.0,
        trainers=[contracts.TrainerIdle(trainer_id="t1", groups=3, span_s=10.0, busy_s=7.5, idle_fraction=0.25)],
        fingerprints=[market_fingerprint()]),
    contracts.CapturedToolCall: lambda: contracts.CapturedToolCall(
        id="call_1", name="calculator", arguments='{"expression": "2 + 2"}'),
    contracts.CapturedChoice: lambda: contracts.CapturedChoice(
        index=0, content=None, finish_reason="tool_calls",
        tool_calls=[contracts.CapturedToolCall(name="calculator", arguments="{}")],
        response_token_ids=np.array([5, 6, 2], np.int32), logprobs=np.array([-0.1, -0.2, -0.3], np.float32),
        routed_experts=np.zeros((3, 4, 2), np.int16)),
    contracts.ToolResult: lambda: contracts.ToolResult(name="calculator", content="391", elapsed_s=0.001),
    contracts.ToolCallRecord: lambda: contracts.ToolCallRecord(
        id="call_0", name="calculator", raw_arguments='{"expression": "17 * 23"}',
        arguments={"expression": "17 * 23"}, result=contracts.ToolResult(name="calculator", content="391")),
    contracts.AgentStep: lambda: contracts.AgentStep(
        index=0, prompt_token_ids=np.array([1, 2, 3], np.int32), response_token_ids=np.array([5, 6, 2], np.int32),
        logprobs=np.array([-0.1, -0.2, -0.3], np.float32), routed_experts=np.zeros((3, 4, 2), np.int16),
        content="", finish_reason="tool_calls"),
    contracts.VerifyResult: lambda: contracts.VerifyResult(reward=0.9, passed=False, components={"answer": 1.0, "format": 0.5},
                                                           info={"expected": "391"}),
    contracts.AgentTrajectory: lambda: contracts.AgentTrajectory(
        task_id="calc-1", sample_index=1, seed=7, model="tiny-moe",
        messages=[{"role": "user", "content": "What is 17 * 23?"}, {"role": "assistant", "content": "391"}],
        steps=[contracts.AgentStep(index=0, prompt_token_ids=np.array([1, 2], np.int32),
                                   response_token_ids=np.array([9, 2], np.int32),
                                   logprobs=np.array([-0.5, -0.1], np.float32), content="391",
                                   finish_reason="stop")],
        final_answer="391", terminal_reason=contracts.TerminalReason.final_answer,
        verification=contracts.VerifyResult(reward=1.0, passed=True), wall_time_s=0.2),
    contracts.CaptureTimings: lambda: contracts.CaptureTimings(received_at=T0, total_s=0.2, proxy_s=0.001,
                                                               upstream_s=0.199),
    contracts.Capture: lambda: contracts.Capture(
        conversation_id="conv_1", conversation_source=contracts.ConversationSource("header"), turn_index=0,
        endpoint="/v1/chat/completions", upstream="http://127.0.0.1:8000", model="tiny-moe",
        messages=[{"role": "user", "content": "What is 2 + 2?"}], prompt_token_ids=np.array([1, 2, 3], np.int32),
        choices=[contracts.CapturedChoice(index=0, content="4", finish_reason="stop")], status_code=200,
        timings=contracts.CaptureTimings(received_at=T0, total_s=0.2, proxy_s=0.001)),
    contracts.RolloutCorrFigures: make_rollout_corr,
    contracts.WorstToken: make_worst_token,
    contracts.DenseMismatchReport: make_dense_report,
    contracts.RouterMismatchReport: lambda: contracts.RouterMismatchReport(
        trajectory_id="calc-1#0", rollout_engine="fp8", trainer_engine="fp32", n_tokens=12, num_layers=2,
        top_k=2, router_flip_rate=0.25, token_expert_disagreement_rate=0.5, per_layer_flip_rate=[0.0, 0.5],
        worst_layer=1, worst_layer_flip_rate=0.5, topk_overlap=0.875),
    contracts.DeltaToken: lambda: contracts.DeltaToken(position=3, token_text="2", delta=-1.5,
                                                       rollout_logprob=-0.2, trainer_logprob=-1.7),
    contracts.AgentDivergenceReport: make_divergence,
    contracts.Interval: make_interval,
    contracts.MatrixCell: make_cell,
    contracts.LengthPoint: lambda: contracts.LengthPoint(
        rollout_engine="fp8", trainer_engine="fp32", max_tokens=256, mean_response_tokens=201.5,
        token_ess=make_interval(), mean_abs_delta=make_interval(), mean_valid_tokens=190.0, tokens_after_eos=23),
    contracts.PositionBucket: lambda: make_position_profile().buckets[0],
    contracts.PositionProfile: make_position_profile,
    contracts.ObservatoryMatrix: lambda: contracts.ObservatoryMatrix(
        model="tiny-moe", suite="arithmetic", rollout_engines=["fp8"], trainer_engines=["fp32"],
        cells=[make_cell()], length_scaling=[], position_scaling=[make_position_profile()],
        divergence=[make_divergence()],
        created_at="2026-11-26T12:00:00Z"),
}

CONTRACTS = sorted(FACTORIES, key=lambda cls: cls.__name__)


def test_every_contract_has_a_test_instance():
    """A contract added to rollmarket.contracts without an instance here escapes every test below."""
    public = {obj for name in contracts.__all__
              if isinstance(obj := getattr(contracts, name), type) and issubclass(obj, Record)
              and obj is not Record}
    missing = sorted(cls.__name__ for cls in public - set(FACTORIES))
    assert not missing, f"add a valid instance of {missing} to FACTORIES"


@pytest.mark.parametrize("cls", CONTRACTS, ids=lambda c: c.__name__)
def test_contract_validates_and_round_trips(cls):
    instance = FACTORIES[cls]()
    assert isinstance(instance, cls)
    again = cls.model_validate(instance.model_dump())
    assert again == instance
    from_json = cls.model_validate_json(instance.model_dump_json())
    assert from_json == instance
    assert json.loads(instance.model_dump_json()) == instance.model_dump(mode="json")


@pytest.mark.parametrize("cls", CONTRACTS, ids=lambda c: c.__name__)
def test_contract_forbids_unknown_fields(cls):
    data = FACTORIES[cls]().model_dump()
    with pytest.raises(ValidationError) as info:
        cls.model_validate({**data, "surprise": 1})
    assert [e["type"] for e in info.value.errors()] == ["extra_forbidden"]


@pytest.mark.parametrize("cls", CONTRACTS, ids=lambda c: c.__name__)
def test_contract_is_frozen(cls):
    instance = FACTORIES[cls]()
    name = next(iter(cls.model_fields))
    with pytest.raises(ValidationError):
        setattr(instance, name, getattr(instance, name))


def _float_fields(cls: type[Record]) -> list[str]:
    return [name for name, field in cls.model_fields.items()
            if field.annotation in (float, typing.Optional[float])]


FLOAT_FIELDS = [(cls, name) for cls in CONTRACTS for name in _float_fields(cls)]


def test_float_field_discovery_finds_the_obvious_ones():
    """Guards the parametrisation below against silently covering nothing."""
    found = {(cls.__name__, name) for cls, name in FLOAT_FIELDS}
    assert {("BudgetReport", "token_ess"), ("Trajectory", "reward"), ("WorkerManifest", "price_hint"),
            ("TrainerFeedback", "token_ess"), ("SamplingConfig", "temperature")} <= found
    assert len(FLOAT_FIELDS) >= 30


@pytest.mark.parametrize("cls,name", FLOAT_FIELDS, ids=lambda v: getattr(v, "__name__", v))
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_scalar_floats_must_be_finite(cls, name, bad):
    data = FACTORIES[cls]().model_dump()
    with pytest.raises(ValidationError) as info:
        cls.model_validate({**data, name: bad})
    assert {e["loc"][0] for e in info.value.errors()} == {name}


def test_floats_inside_containers_must_be_finite():
    with pytest.raises(ValidationError):
        make_trajectory(reward_components={"correct": math.nan})


def test_nested_records_forbid_unknown_fields_too():
    data = make_group().model_dump()
    data["trajectories"][0]["surprise"] = 1
    with pytest.raises(ValidationError) as info:
        SampleGroup.model_validate(data)
    assert info.value.errors()[0]["loc"] == ("trajectories", 0, "surprise")


@pytest.mark.parametrize("bad", [
    sha("x").upper(), sha("x")[:63], sha("x") + "0", sha("x")[:63] + "g", sha("x") + "\n",
    "sha256:" + sha("x"), "", " " + sha("x")[1:],
], ids=["upper", "short", "long", "non-hex", "newline", "prefixed", "empty", "space"])
def test_sha256_fields_refuse_malformed_digests(bad):
    with pytest.raises(ValidationError):
        policy(3, checkpoint_digest=bad)
    with pytest.raises(ValidationError):
        make_group(tokenizer_hash=bad)
    with pytest.raises(ValidationError):
        make_group(content_hash=bad)


@pytest.mark.parametrize("bad", ["", "a b", "a/b", "x" * 129, "w1\n", "ü"])
def test_identifiers_refuse_what_cannot_travel_in_urls(bad):
    with pytest.raises(ValidationError):
        manifest(bad)
    with pytest.raises(ValidationError):
        make_group(group_id=bad)


def test_identifiers_accept_their_documented_alphabet():
    assert manifest("A-z_0.9:x").worker_id == "A-z_0.9:x"
    assert manifest("x" * 128).worker_id == "x" * 128


def test_datetimes_are_stored_in_utc():
    """Naive timestamps are taken as UTC; aware ones are converted, so hashes agree across hosts."""
    naive = ReloadAck(worker_id="w1", policy_version=0, checkpoint_digest=sha("c"),
                      engine_fingerprint="fp", loaded_at=datetime(2024, 1, 1, 8, 0))
    assert naive.loaded_at == datetime(2024, 1, 1, 8, 0, tzinfo=timezone.utc)
    assert naive.loaded_at.utcoffset() == timedelta(0)
    plus2 = timezone(timedelta(hours=2))
    aware = ReloadAck(worker_id="w1", policy_version=0, checkpoint_digest=sha("c"),
                      engine_fingerprint="fp", loaded_at=datetime(2024, 1, 1, 10, 0, tzinfo=plus2))
    assert aware.loaded_at.utcoffset() == timedelta(0)
    assert (aware.loaded_at.hour, aware.loaded_at.minute) == (8, 0)


# --------------------------------------------------------------------------------------------
# TaskSpec and RolloutJob
# --------------------------------------------------------------------------------------------


def test_task_needs_a_prompt_or_messages():
    with pytest.raises(ValidationError, match="prompt or messages"):
        TaskSpec(task_id="t", verifier="exact_match")
    with pytest.raises(ValidationError, match="prompt or messages"):
        TaskSpec(task_id="t", verifier="exact_match", messages=[])
    chat = TaskSpec(task_id="t", verifier="exact_match", messages=[{"role": "user", "content": "hi"}])
    assert chat.prompt is None and chat.messages == [{"role": "user", "content": "hi"}]
    assert TaskSpec(task_id="t", verifier="exact_match", prompt="hi").messages is None


def test_task_needs_a_verifier():
    with pytest.raises(ValidationError):
        TaskSpec(task_id="t", prompt="hi", verifier="")


def _expected_sampling_hash(config: dict) -> str:
    # The documented rule: sha256 of the sorted, whitespace-free JSON of the sampling config.
    return hashlib.sha256(json.dumps(config, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def test_rollout_job_fills_its_derived_fields():
    task = TaskSpec(task_id="t", prompt="hi", verifier="v")
    first = RolloutJob(task=task, policy_version=0, group_size=2)
    second = RolloutJob(task=task, policy_version=0, group_size=2)
    assert re.fullmatch(r"job_[0-9a-f]{24}", first.job_id)
    assert first.job_id != second.job_id
    assert first.idempotency_key == first.job_id
    defaults = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 512, "seed": None,
                "stop": []}
    assert first.sampling_config_hash == _expected_sampling_hash(defaults)


def test_rollout_job_keeps_what_it_is_given():
    task = TaskSpec(task_id="t", prompt="hi", verifier="v")
    config = {"temperature": 0.5, "top_p": 0.9, "top_k": 10, "max_tokens": 8, "seed": 3, "stop": ["x"]}
    given = RolloutJob(task=task, policy_version=0, group_size=2, job_id="job-7",
                       idempotency_key="key-7", sampling_config=config,
                       sampling_config_hash=_expected_sampling_hash(config))
    assert (given.job_id, given.idempotency_key) == ("job-7", "key-7")
    assert RolloutJob(task=task, policy_version=0, group_size=2, job_id="job-8").idempotency_key == "job-8"
    other = RolloutJob(task=task, policy_version=0, group_size=2, sampling_config={**config, "seed": 4})
    assert other.sampling_config_hash != given.sampling_config_hash


def test_rollout_job_refuses_a_wrong_sampling_config_hash():
    task = TaskSpec(task_id="t", prompt="hi", verifier="v")
    with pytest.raises(ValidationError, match="sampling_config_hash does not match"):
        RolloutJob(task=task, policy_version=0, group_size=2, sampling_config={"temperature": 0.5},
                   sampling_config_hash=SamplingConfig().digest())
    with pytest.raises(ValidationError):
        RolloutJob(task=task, policy_version=0, group_size=2, sampling_config_hash="not-a-hash")


def test_rollout_job_round_trips_with_its_derived_fields():
    original = job(3)
    for again in (RolloutJob.model_validate_json(original.model_dump_json()),
                  RolloutJob.model_validate(unpackb(packb(original)))):
        assert again == original
        assert again.digest() == original.digest()


@pytest.mark.parametrize("field,value", [("group_size", 0), ("group_size", 1025), ("policy_version", -1),
                                         ("max_context_tokens", 0), ("idempotency_key", "")])
def test_rollout_job_refuses_out_of_range_values(field, value):
    with pytest.raises(ValidationError):
        job(0, **{field: value})


# --------------------------------------------------------------------------------------------
# Token arrays (contracts/arrays.py)
# --------------------------------------------------------------------------------------------


def _traj(**arrays) -> Trajectory:
    fields = dict(sample_index=0, prompt_token_ids=[1, 2], response_token_ids=[3, 4])
    fields.update(arrays)
    return Trajectory(**fields)


@pytest.mark.parametrize("value", [
    [5, 6, 7], (5, 6, 7), np.array([5, 6, 7], np.int64), np.array([5, 6, 7], np.uint16),
    np.array([5, 6, 7], np.int8), np.array([5, 6, 7], ">i4"), np.array([5, 0, 6, 0, 7], np.int32)[::2],
], ids=["list", "tuple", "int64", "uint16", "int8", "big-endian", "strided"])
def test_token_ids_are_cast_to_int32(value):
    ids = _traj(response_token_ids=value).response_token_ids
    assert ids.dtype == np.dtype("int32") and ids.dtype.isnative
    assert ids.flags.c_contiguous
    assert ids.tolist() == [5, 6, 7]


@pytest.mark.parametrize("value", [
    [-0.5, -1, 0], np.array([-0.5, -1.0, 0.0], np.float64), np.array([-0.5, -1.0, 0.0], np.float16),
    np.array([-0.5, -1.0, 0.0], ">f8"),
], ids=["list", "float64", "float16", "big-endian"])
def test_logprobs_are_cast_to_float32(value):
    logprobs = _traj(logprobs=value).logprobs
    assert logprobs.dtype == np.dtype("float32")
    assert logprobs.tolist() == [-0.5, -1.0, 0.0]


def test_integer_logprobs_are_accepted_as_floats():
    assert _traj(logprobs=np.array([0, -1], np.int64)).logprobs.tolist() == [0.0, -1.0]


@pytest.mark.parametrize("value", [[1, 0, 1], [True, False, True], np.array([1, 0, 1], np.int64),
                                   np.array([True, False, True])], ids=["list", "bools", "int64", "bool"])
def test_masks_are_cast_to_uint8(value):
    mask = _traj(action_mask=value).action_mask
    assert mask.dtype == np.dtype("uint8")
    assert mask.tolist() == [1, 0, 1]


def test_routed_experts_are_cast_to_int16_of_rank_3():
    nested = [[[1, 2], [3, 4]], [[5, 6], [7, 8]], [[9, 10], [11, 12]]]  # [T=3, L=2, K=2]
    for value in (nested, np.array(nested, np.int64), np.array(nested, np.uint8)):
        experts = _traj(routed_experts=value).routed_experts
        assert experts.dtype == np.dtype("int16")
        assert experts.shape == (3, 2, 2)
        assert experts.tolist() == nested


def test_empty_lists_become_empty_arrays_of_the_right_rank_and_dtype():
    t = _traj(response_token_ids=[], logprobs=[], action_mask=[], routed_experts=[])
    assert (t.response_token_ids.dtype, t.response_token_ids.shape) == (np.dtype("int32"), (0,))
    assert (t.logprobs.dtype, t.logprobs.shape) == (np.dtype("float32"), (0,))
    assert (t.action_mask.dtype, t.action_mask.shape) == (np.dtype("uint8"), (0,))
    assert (t.routed_experts.dtype, t.routed_experts.shape) == (np.dtype("int16"), (0, 0, 0))


@pytest.mark.parametrize("field,value,error", [
    ("response_token_ids", [[1, 2], [3]], "array_ragged"),
    ("routed_experts", [[[1, 2]], [[3]]], "array_ragged"),
    ("response_token_ids", [[1, 2]], "array_rank"),
    ("response_token_ids", [[]], "array_rank"),
    ("response_token_ids", np.int32(5), "array_type"),
    ("response_token_ids", 5, "array_type"),
    ("response_token_ids", "1 2", "array_type"),
    ("response_token_ids", {"a": 1}, "array_type"),
    ("routed_experts", [[1, 2], [3, 4]], "array_rank"),
    ("routed_experts", np.zeros((2, 2, 2, 2), np.int16), "array_rank"),
    ("logprobs", np.zeros((2, 1), np.float32), "array_rank"),
    ("response_token_ids", [1.0, 2.0], "array_dtype"),
    ("response_token_ids", np.array([1, 2], np.float32), "array_dtype"),
    ("response_token_ids", [True, False], "array_dtype"),
    ("response_token_ids", ["1", "2"], "array_dtype"),
    ("response_token_ids", [None, None], "array_dtype"),
    ("response_token_ids", [2**64, 1], "array_dtype"),
    ("response_token_ids", [2**40], "array_range"),
    ("response_token_ids", np.array([2**40], np.int64), "array_range"),
    ("response_token_ids", [2**31], "array_range"),
    ("response_token_ids", np.array([2**63], np.uint64), "array_range"),
    ("prompt_token_ids", [-1], "array_range"),
    ("action_mask", [0, 2], "array_range"),
    ("tool_output_mask", [-1, 0], "array_range"),
    ("action_mask", [0.0, 1.0], "array_dtype"),
    ("routed_experts", [[[2**15]]], "array_range"),
    ("routed_experts", [[[-1]]], "array_range"),
    ("logprobs", ["a", "b"], "array_dtype"),
    ("logprobs", [1 + 2j], "array_dtype"),
])
def test_bad_arrays_are_refused(field, value, error):
    """2**40 and -1 must be refused, not wrapped into valid-looking int32 token ids."""
    with pytest.raises(ValidationError) as info:
        _traj(**{field: value})
    assert [e["type"] for e in info.value.errors()] == [error]
    assert info.value.errors()[0]["loc"] == (field,)


def test_largest_int32_token_id_is_accepted():
    assert _traj(response_token_ids=[2**31 - 1]).response_token_ids.tolist() == [2**31 - 1]


def test_stored_arrays_are_read_only():
    t = make_trajectory()
    for name in sample_module._TRAJECTORY_ARRAYS:
        array = getattr(t, name)
        assert not array.flags.writeable, name
        with pytest.raises(ValueError):
            array[0] = 0


def test_the_callers_array_is_neither_frozen_nor_aliased():
    ids = np.array([1, 2, 3], np.int32)
    t = _traj(response_token_ids=ids)
    assert ids.flags.writeable
    ids[0] = 99
    assert t.response_token_ids.tolist() == [1, 2, 3]
    assert not np.shares_memory(ids, t.response_token_ids)


def test_a_read_only_view_of_a_writeable_array_is_not_aliased():
    """A caller's read-only view does not make the data immutable: the base can still change."""
    base = np.array([1, 2, 3], np.int32)
    view = base.view()
    view.flags.writeable = False
    t = _traj(response_token_ids=view)
    base[0] = 99
    assert t.response_token_ids.tolist() == [1, 2, 3]


def test_a_read_only_array_the_caller_owns_is_not_aliased():
    """numpy lets the owner of a frozen array unfreeze it, so the contract must own a copy."""
    ids = np.array([1, 2, 3], np.int32)
    ids.flags.writeable = False
    t = _traj(response_token_ids=ids)
    ids.flags.writeable = True
    ids[0] = 99
    assert t.response_token_ids.tolist() == [1, 2, 3]


def test_json_mode_dumps_arrays_as_lists_and_python_mode_as_arrays():
    t = make_trajectory()
    as_json = t.model_dump(mode="json")
    assert as_json["response_token_ids"] == [21, 22, 23, 24]
    assert as_json["logprobs"] == [-0.5, -1.25, 0.0, -2.0]
    assert as_json["action_mask"] == [1, 1, 0, 1]
    assert as_json["routed_experts"] == [[[1, 2]], [[3, 4]], [[5, 6]], [[7, 0]]]
    assert as_json["finish_reason"] == "tool_calls"
    assert json.loads(t.model_dump_json())["routed_experts"] == [[[1, 2]], [[3, 4]], [[5, 6]], [[7, 0]]]
    assert isinstance(t.model_dump()["response_token_ids"], np.ndarray)


def test_json_round_trip_gives_an_equal_model_with_canonical_dtypes():
    t = make_trajectory(logprobs=np.array([-0.1, -1e-7, -33.3, -1.5], np.float32))
    again = Trajectory.model_validate_json(t.model_dump_json())
    assert again == t
    assert again.logprobs.tobytes() == t.logprobs.tobytes()
    group = make_group().sealed()
    assert SampleGroup.model_validate_json(group.model_dump_json()) == group


def test_equality_sees_array_contents_dtype_and_shape():
    assert make_trajectory() == make_trajectory()
    assert make_trajectory() != make_trajectory(logprobs=[-0.5, -1.25, 0.0, -2.5])
    assert make_trajectory() != make_trajectory(action_mask=None)


# --------------------------------------------------------------------------------------------
# Content hash (contracts/sample.py)
# --------------------------------------------------------------------------------------------

HASHED_GROUP_FIELDS = {
    "group_id", "job_id", "lease_id", "worker_id", "task_id", "policy_version", "checkpoint_digest",
    "tokenizer_hash", "sampling_config_hash", "engine_name", "engine_version", "engine_fingerprint",
    "device_type", "precision_class", "quantization_class", "wall_time_s", "created_at",
}
HASHED_VIA_TRAJECTORIES = {"trajectories"}
UNHASHED_GROUP_FIELDS = {"policy_lag_steps", "content_hash", "signature"}
HASHED_TRAJECTORY_ARRAYS = ("prompt_token_ids", "response_token_ids", "logprobs", "action_mask",
                            "tool_output_mask", "routed_experts")
HASHED_TRAJECTORY_SCALARS = ("sample_index", "reward", "reward_components", "turn_boundaries",
                             "finish_reason")


def test_every_group_and_trajectory_field_has_a_hashing_decision():
    """A new field must be put in the hashed or the excluded list here *and* in sample.py.

    An unhashed provenance field could be changed after signing without anyone noticing; a
    hashed field the exchange stamps would break every signature. Decide, then update both.
    """
    assert set(SampleGroup.model_fields) == (
        HASHED_GROUP_FIELDS | HASHED_VIA_TRAJECTORIES | UNHASHED_GROUP_FIELDS)
    assert set(sample_module._GROUP_UNHASHED) == HASHED_VIA_TRAJECTORIES | UNHASHED_GROUP_FIELDS
    assert set(Trajectory.model_fields) == set(HASHED_TRAJECTORY_ARRAYS) | set(HASHED_TRAJECTORY_SCALARS)
    assert sample_module._TRAJECTORY_ARRAYS == HASHED_TRAJECTORY_ARRAYS
    assert sample_module._TRAJECTORY_SCALARS == HASHED_TRAJECTORY_SCALARS


def _reference_hash(group: SampleGroup) -> str:
    """The canonical bytes exactly as content_hash's docstring describes them, built by hand."""

    def cjson(value) -> bytes:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                          allow_nan=False).encode()

    digest = hashlib.sha256(b"rollmarket.sample_group.v1\n")
    header = {name: getattr(group, name) for name in sorted(HASHED_GROUP_FIELDS)}
    header["created_at"] = group.created_at.isoformat()
    digest.update(cjson(header))
    for t in group.trajectories:
        digest.update(b"\n" + cjson({
            "sample_index": t.sample_index, "reward": t.reward,
            "reward_components": t.reward_components, "turn_boundaries": t.turn_boundaries,
            "finish_reason": t.finish_reason.value,
        }))
        for name in HASHED_TRAJECTORY_ARRAYS:
            array = getattr(t, name)
            if array is None:
                digest.update(f"\n{name}:none".encode())
            else:
                digest.update(f"\n{name}:{array.dtype.str}:{array.shape}\n".encode())
                digest.update(array.astype(array.dtype.newbyteorder("<")).tobytes())
    return digest.hexdigest()


def test_content_hash_follows_the_documented_canonical_bytes():
    """Workers sign this hash: changing the byte layout breaks every signature in flight.

    Do not 'fix' this test without a decision (and a new domain tag).
    """
    group = make_group(trajectories=[make_trajectory(0), make_trajectory(1, routed_experts=None,
                                                                        tool_output_mask=None)])
    assert content_hash(group) == _reference_hash(group)
    sealed = group.sealed()
    assert sealed.content_hash == _reference_hash(group)
    assert sealed.compute_content_hash() == sealed.content_hash


def test_content_hash_is_stable_across_msgpack_and_json_round_trips():
    group = make_group(created_at=datetime(2024, 5, 1, 14, 30, 15, 123456,
                                           tzinfo=timezone(timedelta(hours=2)))).sealed()
    via_msgpack = SampleGroup.model_validate(unpackb(packb(group)))
    via_json = SampleGroup.model_validate_json(group.model_dump_json())
    via_dict = SampleGroup.model_validate(json.loads(json.dumps(group.model_dump(mode="json"))))
    for again in (via_msgpack, via_json, via_dict):
        assert again == group
        assert content_hash(again) == group.content_hash
        assert again.content_hash == group.content_hash


def _group_field_changes() -> dict[str, object]:
    return {
        "group_id": "grp-2", "job_id": "job-2", "lease_id": "lease-2", "worker_id": "w2",
        "task_id": "task-2", "policy_version": 4, "checkpoint_digest": sha("other"),
        "tokenizer_hash": sha("other"), "sampling_config_hash": sha("other"), "engine_name": "vllm",
        "engine_version": "1.1", "engine_fingerprint": sha("fp2"), "device_type": "h100",
        "precision_class": "fp8", "quantization_class": "fp8-e4m3", "wall_time_s": 1.5,
        "created_at": T0 + timedelta(microseconds=1),
    }


def test_the_change_table_covers_every_hashed_group_field():
    assert set(_group_field_changes()) == HASHED_GROUP_FIELDS


@pytest.mark.parametrize("name", sorted(HASHED_GROUP_FIELDS))
def test_content_hash_changes_with_every_hashed_group_field(name):
    group = make_group()
    changed = make_group(**{name: _group_field_changes()[name]})
    assert content_hash(changed) != content_hash(group)


@pytest.mark.parametrize("name,value", [
    ("sample_index", 5), ("reward", 1.5000001), ("reward_components", {"correct": 1.0, "format": 0.25}),
    ("reward_components", {"correct": 1.0}), ("turn_boundaries", [0, 3]), ("turn_boundaries", []),
    ("finish_reason", FinishReason.stop),
])
def test_content_hash_changes_with_every_hashed_trajectory_scalar(name, value):
    group = make_group()
    changed = make_group(trajectories=[make_trajectory(0, **{name: value}), make_trajectory(1, reward=0.0)])
    assert content_hash(changed) != content_hash(group)


@pytest.mark.parametrize("name", HASHED_TRAJECTORY_ARRAYS)
def test_content_hash_changes_with_any_array_byte(name):
    group = make_group()
    base = getattr(group.trajectories[0], name)
    for flat_index in range(base.size):
        for byte in range(base.itemsize):
            raw = bytearray(base.tobytes())
            raw[flat_index * base.itemsize + byte] ^= 0x01
            flipped = np.frombuffer(bytes(raw), dtype=base.dtype).reshape(base.shape)
            if name in ("action_mask", "tool_output_mask") and flipped.max() > 1:
                continue  # not a valid mask; the contract refuses it
            changed = make_group(trajectories=[make_trajectory(0, **{name: flipped}),
                                               make_trajectory(1, reward=0.0)])
            assert content_hash(changed) != content_hash(group), (name, flat_index, byte)


def test_content_hash_sees_shape_and_absence_not_only_bytes():
    experts_TLK = np.arange(8, dtype=np.int16).reshape(4, 1, 2)
    reshaped = experts_TLK.reshape(4, 2, 1)  # same bytes, other [T, L, K]
    one = make_group(trajectories=[make_trajectory(0, routed_experts=experts_TLK)])
    two = make_group(trajectories=[make_trajectory(0, routed_experts=reshaped)])
    assert content_hash(one) != content_hash(two)
    all_ones = make_group(trajectories=[make_trajectory(0, action_mask=[1, 1, 1, 1], tool_output_mask=None)])
    absent = make_group(trajectories=[make_trajectory(0, action_mask=None, tool_output_mask=None)])
    assert content_hash(all_ones) != content_hash(absent)
    # Moving a token from the prompt to the response is a different sample.
    moved = make_group(trajectories=[make_trajectory(0, prompt_token_ids=[11, 12],
                                                     response_token_ids=[13, 21, 22, 23])])
    first = make_group(trajectories=[make_trajectory(0)])
    assert content_hash(moved) != content_hash(first)


def test_content_hash_sees_trajectory_order():
    a, b = make_trajectory(0), make_trajectory(1, reward=0.0)
    assert content_hash(make_group(trajectories=[a, b])) != content_hash(make_group(trajectories=[b, a]))


def test_content_hash_ignores_lag_hash_and_signature():
    """The exchange stamps policy_lag_steps after the worker signs; it must not break the hash."""
    group = make_group()
    for update in ({"policy_lag_steps": 7}, {"content_hash": sha("anything")}, {"signature": "c2ln"}):
        stamped = SampleGroup.model_validate({**group.model_dump(), **update})
        assert content_hash(stamped) == content_hash(group)


def test_sealed_fills_the_hash_and_changes_nothing_else():
    group = make_group()
    sealed = group.sealed()
    assert group.content_hash is None
    assert re.fullmatch(r"[0-9a-f]{64}", sealed.content_hash)
    assert sealed.model_copy(update={"content_hash": None}) == group


# --------------------------------------------------------------------------------------------
# JSON Schema export (`rollmarket schema --out DIR`)
# --------------------------------------------------------------------------------------------

_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list,
          "object": dict, "null": type(None)}


def schema_errors(instance, schema: dict, root: dict, path: str = "$") -> list[str]:
    """A small JSON Schema checker for the keywords pydantic emits (jsonschema is not installed)."""
    if "$ref" in schema:
        assert schema["$ref"].startswith("#/$defs/"), schema["$ref"]
        return schema_errors(instance, root["$defs"][schema["$ref"].split("/")[-1]], root, path)
    errors: list[str] = []
    if "anyOf" in schema:
        if all(schema_errors(instance, option, root, path) for option in schema["anyOf"]):
            errors.append(f"{path}: matches no anyOf option")
    for option in schema.get("allOf", []):
        errors += schema_errors(instance, option, root, path)
    if "type" in schema:
        kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        ok = any(isinstance(instance, _TYPES[k]) and not (k in ("integer", "number") and isinstance(instance, bool))
                 for k in kinds)
        if not ok:
            return errors + [f"{path}: {instance!r} is not of type {kinds}"]
    if "enum" in schema and instance not in schema["enum"]:
        errors.append(f"{path}: {instance!r} not in {schema['enum']}")
    if "const" in schema and instance != schema["const"]:
        errors.append(f"{path}: {instance!r} != {schema['const']!r}")
    if isinstance(instance, str):
        if "pattern" in schema and not re.search(schema["pattern"], instance):
            errors.append(f"{path}: {instance!r} does not match {schema['pattern']}")
        if len(instance) < schema.get("minLength", 0) or len(instance) > schema.get("maxLength", math.inf):
            errors.append(f"{path}: length of {instance!r} out of bounds")
    if isinstance(instance, (int, float)) and not isinstance(instance, bool):
        if instance < schema.get("minimum", -math.inf) or instance > schema.get("maximum", math.inf):
            errors.append(f"{path}: {instance} out of bounds")
        if "exclusiveMinimum" in schema and not instance > schema["exclusiveMinimum"]:
            errors.append(f"{path}: {instance} not above {schema['exclusiveMinimum']}")
        if "exclusiveMaximum" in schema and not instance < schema["exclusiveMaximum"]:
            errors.append(f"{path}: {instance} not below {schema['exclusiveMaximum']}")
    if isinstance(instance, list):
        if len(instance) < schema.get("minItems", 0) or len(instance) > schema.get("maxItems", math.inf):
            errors.append(f"{path}: {len(instance)} items out of bounds")
        if "items" in schema:
            for i, item in enumerate(instance):
                errors += schema_errors(item, schema["items"], root, f"{path}[{i}]")
    if isinstance(instance, dict):
        properties = schema.get("properties", {})
        for name in schema.get("required", []):
            if name not in instance:
                errors.append(f"{path}: missing required {name!r}")
        extra = schema.get("additionalProperties", True)
        for name, value in instance.items():
            if name in properties:
                errors += schema_errors(value, properties[name], root, f"{path}.{name}")
            elif extra is False:
                errors.append(f"{path}: unexpected property {name!r}")
            elif isinstance(extra, dict):
                errors += schema_errors(value, extra, root, f"{path}.{name}")
    return errors


@pytest.fixture(scope="module")
def schema_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("schemas") / "out"
    done = subprocess.run([sys.executable, "-m", "rollmarket", "schema", "--out", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return out


def test_schema_command_writes_one_file_per_exported_contract(schema_dir):
    names = {model.__name__ for model in EXPORTED}
    assert len(names) == len(EXPORTED)
    assert {p.name for p in schema_dir.iterdir()} == {f"{n}.schema.json" for n in names} | {"index.json"}
    index = json.loads((schema_dir / "index.json").read_text())
    assert index == {n: f"{n}.schema.json" for n in names}


@pytest.mark.parametrize("model", EXPORTED, ids=lambda m: m.__name__)
def test_each_schema_validates_a_real_instance(schema_dir, model):
    schema = json.loads((schema_dir / f"{model.__name__}.schema.json").read_text())
    assert schema["title"] == model.__name__
    assert schema["$id"].endswith(f"/{model.__name__}.schema.json")
    assert schema["type"] == "object"
    assert set(schema["properties"]) == set(model.model_fields)
    assert schema.get("additionalProperties") is False
    instance = FACTORIES[model]().model_dump(mode="json")
    assert schema_errors(instance, schema, schema) == []


@pytest.mark.parametrize("model", EXPORTED, ids=lambda m: m.__name__)
def test_each_schema_refuses_an_unknown_property_and_a_missing_required_one(schema_dir, model):
    """Keeps the checker above honest: it must be able to say no."""
    schema = json.loads((schema_dir / f"{model.__name__}.schema.json").read_text())
    instance = FACTORIES[model]().model_dump(mode="json")
    assert schema_errors({**instance, "surprise": 1}, schema, schema)
    required = [n for n, f in model.model_fields.items() if f.is_required()]
    assert set(schema.get("required", [])) == set(required)
    if required:
        trimmed = {k: v for k, v in instance.items() if k != required[0]}
        assert schema_errors(trimmed, schema, schema)


def test_array_schemas_state_their_rank_and_range(schema_dir):
    schema = json.loads((schema_dir / "Trajectory.schema.json").read_text())
    ids = schema["properties"]["response_token_ids"]
    array_ids = next(option for option in ids["anyOf"] if option.get("type") == "array")
    assert array_ids["items"] == {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
    experts = next(o for o in schema["properties"]["routed_experts"]["anyOf"] if o.get("type") == "array")
    assert experts["items"]["items"]["items"]["type"] == "integer"
    bad = make_trajectory().model_dump(mode="json")
    bad["response_token_ids"] = [1.5]
    assert schema_errors(bad, schema, schema)
    bad["response_token_ids"] = [[1]]
    assert schema_errors(bad, schema, schema)
