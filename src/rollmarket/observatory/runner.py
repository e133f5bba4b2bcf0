"""The matrix runner: the same token ids, scored by every trainer engine, for every rollout engine.

    for each rollout engine (a precision profile of the model, or agent runs read from a file):
        run the agent on n suite tasks, one run each, the same seed per task on every engine
        sample length probes: each of the first tasks' prompts to exactly L tokens, per --lengths
        (ignore_eos; the tokens after the first EOS are masked out of every figure)
    for each trainer engine (fp32, bf16, fsdp-bf16, ...):
        teacher-force every run's stitched tokens and every probe  ─►  dense + router reports
    per (rollout, trainer): the tile (n, means, bootstrap 95% intervals, worst token, worst layer),
        the probes' ESS and |Δ| per L, and their per-token |Δ| and k3 by response position
    per pair of rollout engines: where the same task with the same seed split, and why (tokens)

Everything lands in a run directory laid out as `observatory/layout.py` says; the dashboard reads
it. Torch is imported here, lazily, and only here in this package.
"""

from __future__ import annotations

import gc
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, Field, field_validator, model_validator

from ..contracts import (
    AgentDivergenceReport,
    AgentTrajectory,
    DeltaToken,
    DenseMismatchReport,
    LengthPoint,
    MatrixCell,
    ObservatoryMatrix,
    PositionBucket,
    PositionProfile,
    RolloutCorrFigures,
    RouterMismatchReport,
    TaskSpec,
    WorstToken,
)
from ..contracts.seeds import task_seed
from . import layout
from .engines import PRECISIONS, ReplayUnavailable, parse_trainer, with_replay_twins

log = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]
"""progress(stage, done, total): the CLI draws bars from it; the library prints nothing."""


class ObserveSettings(BaseModel):
    """Settings of `rollmarket observe` (saved as config.json of the run)."""

    model: str = Field(description="Hugging Face model directory (the shipped tiny MoE, or any).")
    suite: str = Field("agent", description="Task suite whose tasks the agent runs.")
    split: str = Field("heldout", description="Split of the suite.")
    rollout_engines: list[str] = Field(default_factory=lambda: ["fp32", "bf16", "fp16", "fp8"],
                                       description="Precision profiles the rollouts are sampled at.")
    trainer_engines: list[str] = Field(default_factory=lambda: ["fp32", "bf16", "fsdp-bf16"],
                                       description="Engines that teacher-force: [fsdp-]<precision>[+replay] "
                                                   "(`observatory/engines.py`).")
    router_replay: bool = Field(False, description="Put each trainer engine's router-replay twin (`<engine>+replay`) "
                                                   "beside it, so every cell is shown with and without replay.")
    n: int = Field(30, ge=1, description="Agent runs per rollout engine (one per task).")
    lengths: list[int] = Field(default_factory=lambda: [128, 512, 2048],
                               description="Response lengths of the length probes (sampled to exactly L tokens).")
    length_n: int | None = Field(None, ge=1, description="Probes per length (default: n).")
    max_steps: int = Field(6, ge=1, description="Agent turns per run.")
    max_tokens: int = Field(128, ge=1, description="Tokens per agent turn.")
    temperature: float = Field(1.0, ge=0)
    seed: int = Field(0, description="Base seed; each task's seed mixes it with the task id.")
    device: str = Field("cpu", description="Torch device: cpu, cuda, auto.")
    concurrency: int = Field(16, ge=1, description="Agent runs in flight per rollout engine.")
    fsdp_world_size: int = Field(2, ge=1, description="Ranks of an fsdp-* trainer engine.")
    from_rollouts: dict[str, str] = Field(
        default_factory=dict,
        description="Rollout engine name -> a rollouts JSONL (AgentTrajectory lines) to use instead of "
                    "sampling: e.g. a worker's --rollouts file or `rollmarket collect` output.")
    from_captures: dict[str, str] = Field(
        default_factory=dict,
        description="Rollout engine name -> a capture store (`rollmarket proxy --store`): each captured "
                    "conversation becomes one run (any engine behind the proxy: vLLM, SGLang, ...).")
    rollout_urls: dict[str, str] = Field(
        default_factory=dict,
        description="Rollout engine name -> an OpenAI-compatible server serving --model (vLLM, SGLang, "
                    "`rollmarket serve-model`), e.g. {'vllm': 'http://127.0.0.1:8000/v1'}: the agent runs are "
                    "sampled from it with the worker's client (`rollmarket worker --model-url`).")

    @field_validator("trainer_engines")
    @classmethod
    def _trainer_names(cls, names: list[str]) -> list[str]:
        for name in names:
            parse_trainer(name)  # EngineNameError names the bad one
        return names

    @model_validator(mode="after")
    def _replay_twins(self) -> "ObserveSettings":
        if self.router_replay:
            self.trainer_engines = with_replay_twins(self.trainer_engines)
        return self


@dataclass
class _Run:
    """One trajectory under observation: its id, its stitched view and, for agent runs, the run."""

    trajectory_id: str
    prompt_P: np.ndarray
    response_T: np.ndarray
    rollout_logprobs_T: np.ndarray
    valid_T: np.ndarray
    experts_TLK: np.ndarray | None
    boundaries: list[int]
    run: AgentTrajectory | None = None
    max_tokens: int | None = None
    trainer_logprobs: dict[str, np.ndarray] = field(default_factory=dict)
    produced_T: np.ndarray | None = None
    """Tokens the rollout engine produced (router replay replays these; None: all of them)."""

    @property
    def agent(self) -> AgentTrajectory:
        """The agent run (a length probe has none: asking for it there is a bug)."""
        if self.run is None:
            raise ValueError(f"{self.trajectory_id} is a length probe, not an agent run")
        return self.run


def _stitched(run: AgentTrajectory) -> _Run | None:
    from ..agents import StitchError, stitch

    try:
        view = stitch(run.steps)
    except StitchError:
        return None
    if view.logprobs_T is None or view.response_token_ids_T.size == 0:
        return None
    valid = view.action_mask_T.astype(bool) & ~view.tool_output_mask_T.astype(bool)
    return _Run(layout.trajectory_id(run.task_id, run.sample_index), view.prompt_token_ids_P,
                view.response_token_ids_T, view.logprobs_T, valid, view.routed_experts_TLK, view.turn_boundaries, run,
                produced_T=view.action_mask_T.astype(bool))


def sample_agent_runs(settings: ObserveSettings, rollout: str, tasks: list[TaskSpec],
                      progress: Progress | None = None) -> list[AgentTrajectory]:
    """Run the agent once per task against rollout engine `rollout`: the model at that precision
    served on loopback, or the server of `settings.rollout_urls[rollout]` through the worker's
    RemoteHost (the model directory it serves is `settings.model`)."""
    from ..agents import Agent, AgentSettings, ChatModel, LocalToolbox, Sampling
    from ..agents.collect import run_grouped
    from ..verifiers import verify_trajectory
    from ..worker.host import EmbeddedHost, RemoteHost

    url = settings.rollout_urls.get(rollout)
    host = (RemoteHost(url, model_dir=settings.model) if url is not None
            else EmbeddedHost(settings.model, rollout, settings.device))
    try:
        agent = Agent(ChatModel(host.url, host.identity().model_name), LocalToolbox(),
                      AgentSettings(max_steps=settings.max_steps), verify=verify_trajectory)
        sampling = Sampling(temperature=settings.temperature, max_tokens=settings.max_tokens, seed=settings.seed)
        on_run = None if progress is None else lambda done, total: progress(f"agent runs on {rollout}", done, total)
        return [runs[0] for runs in run_grouped(agent, tasks, 1, sampling, concurrency=settings.concurrency,
                                                 on_run=on_run)]
    finally:
        if isinstance(host, EmbeddedHost):
            host.close()


def probe_run(task_id: str, length: int, gen, eos_token_ids) -> _Run:
    """The _Run of one length probe: sampled past EOS (ignore_eos) to reach its length, so every
    token after the first EOS, which the model would not have written, is masked out."""
    from .positions import after_eos_mask

    valid_T = ~after_eos_mask(gen.token_ids_T, eos_token_ids)
    return _Run(layout.trajectory_id(task_id, 0, length), gen.prompt_token_ids_P, gen.token_ids_T,
                gen.logprobs_T, valid_T, gen.routed_experts_TLK, [0], None, length)


def sample_probes(settings: ObserveSettings, precision: str, tasks: list[TaskSpec],
                  progress: Progress | None = None) -> list[_Run]:
    """Each task's prompt sampled to exactly L tokens (ignore_eos) for each L in --lengths; the
    tokens after the first EOS are not valid (`probe_run`)."""
    from ..agents import task_messages
    from ..agents.tools import tool_schemas
    from ..engines import RolloutEngine, SamplingParams

    engine = RolloutEngine.from_path(settings.model, precision, settings.device)
    probes: list[_Run] = []
    count = settings.length_n or settings.n
    chosen = tasks[:count]
    for i, length in enumerate(settings.lengths):
        budget = engine.info.max_context_tokens - length
        prompts = [engine.encode_chat(task_messages(t), tools=tool_schemas(list(t.tools)) or None) for t in chosen]
        keep = [(t, p) for t, p in zip(chosen, prompts) if len(p) <= budget]
        params = [SamplingParams(temperature=settings.temperature, max_tokens=length, ignore_eos=True,
                                 seed=task_seed(settings.seed, t.task_id)) for t, _ in keep]
        gens = engine.generate([prompt for _, prompt in keep], params) if keep else []
        for (task, _), gen in zip(keep, gens):
            probes.append(probe_run(task.task_id, length, gen, engine.info.eos_token_ids))
        if progress:
            progress(f"length probes at {precision}", i + 1, len(settings.lengths))
    del engine
    gc.collect()
    return probes


def replay_problem(runs: list[_Run]) -> str | None:
    """Why router replay cannot score these runs (a rollout engine's), or None: it needs the rollout's
    routed experts of every run."""
    if not runs:
        return "no runs to replay"
    missing = sum(r.experts_TLK is None for r in runs)
    if missing:
        return (f"{missing} of {len(runs)} runs carry no routed experts (the rollout engine did not return them; "
                "vLLM on the CPU never does), so there is nothing to replay")
    return None


def _score(settings: ObserveSettings, trainer: str, runs: list[_Run]) -> list[Any]:
    """Teacher-force `runs` on trainer engine `trainer`; a `+replay` engine routes each produced
    token to the rollout's experts and raises ReplayUnavailable when a run has none."""
    from ..engines.routing import replayable

    name = parse_trainer(trainer)
    pairs = [(r.prompt_P, r.response_T) for r in runs]
    replays = None
    if name.replay:
        if (problem := replay_problem(runs)) is not None:
            raise ReplayUnavailable(problem)
        replays = [replayable(r.experts_TLK, np.ones(r.response_T.size, bool) if r.produced_T is None
                              else r.produced_T) for r in runs]
    if name.fsdp:
        from ..engines.fsdp import score_with_fsdp

        return score_with_fsdp(settings.model, name.precision, pairs, world_size=settings.fsdp_world_size,
                               replayed_experts=replays)
    from ..engines import TrainerEngine

    engine = TrainerEngine.from_path(settings.model, name.precision, settings.device)
    try:
        return engine.score_batch(pairs, replayed_experts=replays)
    finally:
        del engine
        gc.collect()


def _worst_token(run: _Run, tokenizer, trainer_T: np.ndarray) -> WorstToken | None:
    from .dense import worst_token_index

    index = worst_token_index(run.rollout_logprobs_T, trainer_T, mask=run.valid_T)
    if index is None:
        return None
    t = int(index)
    delta = trainer_T - run.rollout_logprobs_T
    turn = max((i for i, b in enumerate(run.boundaries) if b <= t), default=0)
    ids = run.response_T
    return WorstToken(
        position=t, token_id=int(ids[t]), token_text=tokenizer.decode([int(ids[t])]), delta=float(delta[t]),
        rollout_logprob=float(run.rollout_logprobs_T[t]), trainer_logprob=float(trainer_T[t]),
        context_before=tokenizer.decode([int(i) for i in ids[max(0, t - 24): t]]),
        context_after=tokenizer.decode([int(i) for i in ids[t + 1: t + 9]]), turn=turn)


def _floored(trainer_logprobs_T: np.ndarray) -> np.ndarray:
    # A probability that underflowed to 0 (-inf) is "impossible": a finite floor keeps the stats finite,
    # as the gate does.
    return np.maximum(np.nan_to_num(trainer_logprobs_T, nan=-1e4, neginf=-1e4), -1e4)


def _reports(run: _Run, rollout: str, trainer: str, scored, tokenizer
             ) -> tuple[DenseMismatchReport, RouterMismatchReport | None]:
    from .dense import dense_summary
    from .dense import to_report as dense_report
    from .router import router_summary
    from .router import to_report as router_report

    trainer_T = _floored(scored.logprobs_T)
    summary = dense_summary(run.rollout_logprobs_T, trainer_T, mask=run.valid_T)
    dense = dense_report(summary, trajectory_id=run.trajectory_id, rollout_engine=rollout, trainer_engine=trainer,
                         response_length=int(run.response_T.size),
                         worst_token=_worst_token(run, tokenizer, trainer_T))
    router = None
    if run.experts_TLK is not None and scored.routed_experts_TLK is not None:
        rs = router_summary(run.experts_TLK, scored.routed_experts_TLK, mask=run.valid_T)
        router = router_report(rs, trajectory_id=run.trajectory_id, rollout_engine=rollout, trainer_engine=trainer)
    return dense, router


def _cell_rollout_corr(runs: list[_Run], trainer: str) -> RolloutCorrFigures:
    """verl's figures with the cell's trajectories as verl's batch (its default C = 2, token level)."""
    from .offpolicy import IS_THRESHOLD, offpolicy_figures

    rollout_N = np.concatenate([r.rollout_logprobs_T[r.valid_T] for r in runs] or [np.zeros(0)])
    trainer_N = np.concatenate([_floored(r.trainer_logprobs[trainer])[r.valid_T] for r in runs] or [np.zeros(0)])
    lengths_S = np.array([int(r.valid_T.sum()) for r in runs], dtype=np.int64)
    figures = offpolicy_figures(rollout_N, trainer_N, lengths_S, is_threshold=IS_THRESHOLD, is_level="token")
    return RolloutCorrFigures(is_threshold=IS_THRESHOLD, is_level="token", **figures.metrics(prefix=""))


def _cell(rollout: str, trainer: str, dense: list[DenseMismatchReport], router: list[RouterMismatchReport],
          rollout_corr: RolloutCorrFigures | None = None, absent: str | None = None) -> MatrixCell:
    from .dense import sequence_ess
    from .stats import bootstrap_interval

    def interval(values):
        return bootstrap_interval([v for v in values if v is not None])

    worst = max((d for d in dense if d.worst_token is not None),
                key=lambda d: abs(d.worst_token.delta) if d.worst_token else 0.0, default=None)
    cell: dict[str, Any] = dict(
        rollout_engine=rollout, trainer_engine=trainer, n=len(dense), tokens=sum(d.n_tokens for d in dense),
        token_ess=interval(d.token_ess for d in dense),
        sequence_ess=sequence_ess([d.sequence_log_ratio for d in dense]),
        mean_abs_delta=interval(d.mean_abs_delta for d in dense),
        max_abs_delta=max((d.max_abs_delta for d in dense if d.max_abs_delta is not None), default=None),
        kl_k3=interval(d.kl_k3 for d in dense), mean_prob_diff=interval(d.mean_prob_diff for d in dense),
        worst_token=worst.worst_token if worst else None, worst_trajectory_id=worst.trajectory_id if worst else None,
        low_n=len(dense) < 30, rollout_corr=rollout_corr, router_replay=parse_trainer(trainer).replay, absent=absent,
    )
    if router:
        cell["router_flip_rate"] = interval(r.router_flip_rate for r in router)
        cell["token_expert_disagreement_rate"] = interval(r.token_expert_disagreement_rate for r in router)
        layers = np.array([r.per_layer_flip_rate for r in router if r.per_layer_flip_rate], np.float64)
        if layers.size:
            per_layer = layers.mean(0)
            cell["worst_layer"] = int(per_layer.argmax())
            cell["worst_layer_flip_rate"] = float(per_layer.max())
    return MatrixCell(**cell)


def _length_points(rollout: str, trainer: str, probes: list[_Run], dense: list[DenseMismatchReport]
                   ) -> list[LengthPoint]:
    from .stats import bootstrap_interval

    points = []
    for length in sorted({p.max_tokens for p in probes if p.max_tokens is not None}):
        mine = [(p, d) for p, d in zip(probes, dense) if p.max_tokens == length]
        points.append(LengthPoint(
            rollout_engine=rollout, trainer_engine=trainer, max_tokens=length,
            mean_response_tokens=float(np.mean([p.response_T.size for p, _ in mine])),
            token_ess=bootstrap_interval([d.token_ess for _, d in mine if d.token_ess is not None]),
            mean_abs_delta=bootstrap_interval([d.mean_abs_delta for _, d in mine if d.mean_abs_delta is not None]),
            mean_valid_tokens=float(np.mean([d.n_tokens for _, d in mine])),
            tokens_after_eos=sum(int((~p.valid_T).sum()) for p, _ in mine),
        ))
    return points


def position_profile_of(rollout: str, trainer: str, probes: list[_Run], trainer_logprobs: list[np.ndarray]
                        ) -> PositionProfile:
    """The probes' per-token |Δ| and k3 by response position (`observatory/positions.py`)."""
    from .positions import position_profile

    stats = position_profile([(p.rollout_logprobs_T, _floored(t), p.valid_T)
                              for p, t in zip(probes, trainer_logprobs, strict=True)])
    return PositionProfile(
        rollout_engine=rollout, trainer_engine=trainer, n_trajectories=len(probes),
        tokens_after_eos=sum(int((~p.valid_T).sum()) for p in probes),
        buckets=[PositionBucket(start=b.start, stop=b.stop, n_tokens=b.n_tokens, n_trajectories=b.n_trajectories,
                                mean_abs_delta=b.mean_abs_delta, kl_k3=b.kl_k3) for b in stats])


def _view(run: _Run, rollout: str, tokenizer, task: TaskSpec | None):
    """The trajectory viewer's record of one agent run."""
    agent = run.agent
    turns = []
    seen = 0
    for i, step in enumerate(agent.steps):
        # Messages up to this turn: the prompt, then per turn the assistant message and its tool results.
        upto = _messages_before_turn(agent, i)
        new = agent.messages[seen:upto]
        seen = upto + 1
        start = run.boundaries[i] if i < len(run.boundaries) else 0
        n = step.num_response_tokens
        ids = step.response_token_ids.tolist() if step.response_token_ids is not None else []
        turns.append(layout.ViewTurn(
            index=i, new_messages=new, tokens=[tokenizer.decode([t]) for t in ids], token_ids=ids,
            rollout_logprobs=[] if step.logprobs is None else [float(x) for x in step.logprobs],
            trainer_logprobs={t: [float(x) for x in lp[start: start + n]] for t, lp in run.trainer_logprobs.items()},
            content=step.content, finish_reason=step.finish_reason,
            tool_calls=[layout.ViewToolCall(name=c.name, arguments=c.raw_arguments, result=c.result.content,
                                            outcome=c.result.outcome.value) for c in step.tool_calls],
        ))
    prompt = next((m.get("content") or "" for m in agent.messages if m.get("role") == "user"), "")
    return layout.TrajectoryView(
        trajectory_id=run.trajectory_id, task_id=agent.task_id, rollout_engine=rollout, prompt=str(prompt),
        turns=turns, final_answer=agent.final_answer, terminal_reason=agent.terminal_reason.value,
        reward=None if agent.verification is None else agent.verification.reward,
        expected=None if task is None or task.answer is None else str(task.answer))


def _messages_before_turn(run: AgentTrajectory, turn: int) -> int:
    """Index in run.messages of the assistant message of `turn`."""
    assistant = [i for i, m in enumerate(run.messages) if m.get("role") == "assistant"]
    return assistant[turn] if turn < len(assistant) else len(run.messages)


def _divergence(settings: ObserveSettings, a_name: str, b_name: str, runs_a: dict[str, _Run],
                runs_b: dict[str, _Run], tokenizer) -> list[AgentDivergenceReport]:
    """Where runs of the same task and seed on engines a and b split, tied to tokens: engine b's
    numerics score a's tokens of the split turn (a trainer engine at b's precision)."""
    from .dense import dense_summary
    from .dense import to_report as dense_report
    from .divergence import first_token_split, trajectory_divergence
    from .divergence import to_report as divergence_report

    reports = []
    pending: list[tuple[Any, Any, Any, int, int]] = []
    for tid in sorted(set(runs_a) & set(runs_b)):
        a, b = runs_a[tid].agent, runs_b[tid].agent
        summary = trajectory_divergence(a, b)
        step = summary.first_divergent_step
        # Tying the split to tokens needs a trainer engine with b's numerics: only a precision profile has one
        # (an engine served elsewhere, such as vLLM, does not).
        if (step is None or step >= len(a.steps) or a.steps[step].response_token_ids is None
                or b_name not in PRECISIONS or b_name in settings.rollout_urls):
            reports.append(divergence_report(summary, task_id=a.task_id, engine_a=a_name, engine_b=b_name,
                                             sample_index=a.sample_index))
            continue
        sa = a.steps[step]
        assert sa.response_token_ids is not None  # checked above
        sb = b.steps[step] if step < len(b.steps) else None
        split = first_token_split(sa.response_token_ids.tolist(),
                                  [] if sb is None or sb.response_token_ids is None else sb.response_token_ids.tolist())
        pending.append((summary, a, sa, step, sa.num_response_tokens if split is None else split))
    if pending:
        scored = _score(settings, b_name, [_Run("", sa.prompt_token_ids, sa.response_token_ids, sa.logprobs,
                                                np.ones(sa.num_response_tokens, bool), None, [0])
                                           for _, _, sa, _, _ in pending])
        for (summary, a, sa, step, split), s in zip(pending, scored):
            delta = s.logprobs_T - sa.logprobs
            upto = min(split + 1, delta.size)
            order = np.argsort(-np.abs(delta[:upto]))[:5]
            ids = sa.response_token_ids
            top = [DeltaToken(position=int(t), token_text=tokenizer.decode([int(ids[t])]), delta=float(delta[t]),
                              rollout_logprob=float(sa.logprobs[t]), trainer_logprob=float(s.logprobs_T[t]))
                   for t in sorted(order)]
            turn_report = dense_report(dense_summary(sa.logprobs, s.logprobs_T),
                                       trajectory_id=f"{layout.trajectory_id(a.task_id, a.sample_index)}/turn{step}",
                                       rollout_engine=a_name, trainer_engine=b_name,
                                       response_length=int(sa.num_response_tokens))
            reports.append(divergence_report(summary, task_id=a.task_id, engine_a=a_name, engine_b=b_name,
                                             sample_index=a.sample_index, split_turn=turn_report,
                                             top_delta_tokens=top))
    return reports


def _write_jsonl(path: Path, records) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        for record in records:
            handle.write(record.model_dump_json() + "\n")


def check_replay(settings: ObserveSettings) -> None:
    """ReplayUnavailable when a `+replay` trainer engine is asked of a model without routed experts
    (read from its config.json: no torch, nothing written)."""
    if not any(parse_trainer(t).replay for t in settings.trainer_engines):
        return
    from ..engines.provenance import model_config

    config = model_config(Path(settings.model))
    # Transformers' configs name the expert count differently per family (Qwen3-MoE: num_local_experts).
    if not any(int(config.get(key) or 0) for key in ("num_experts", "num_local_experts", "n_routed_experts")):
        raise ReplayUnavailable(f"router replay needs an MoE model; {settings.model} has no routed experts")


def run_observatory(settings: ObserveSettings, run_dir: Path, progress: Progress | None = None, *,
                    config_name: str = layout.CONFIG) -> ObservatoryMatrix:
    """Sample (or read), score, compare and write everything under `run_dir`; return the matrix.

    The settings go to `config_name`; a run directory that already holds another run (a demo's
    training run) passes `layout.EMBEDDED_CONFIG` so that its own config.json stays.
    """
    check_replay(settings)
    from datetime import datetime, timezone

    from transformers import AutoTokenizer

    from ..runs import code_version, write_json
    from ..tasks.suites import load_suite

    run_dir.mkdir(parents=True, exist_ok=True)
    write_json(run_dir / config_name, {"observe": settings.model_dump(mode="json"), "code": code_version()})
    tokenizer = AutoTokenizer.from_pretrained(settings.model)
    tasks = load_suite(settings.suite, settings.split)[: settings.n]
    by_task = {t.task_id: t for t in load_suite(settings.suite, settings.split)}
    agent_runs: dict[str, list[_Run]] = {}
    probes: dict[str, list[_Run]] = {}
    for rollout in settings.rollout_engines:
        if rollout in settings.from_rollouts:
            source = Path(settings.from_rollouts[rollout])
            raw = [AgentTrajectory.model_validate_json(line) for line in source.read_text().splitlines() if line.strip()]
        elif rollout in settings.from_captures:
            from .sources import runs_from_captures

            raw = runs_from_captures(settings.from_captures[rollout])
        else:  # a precision profile served here, or a server of settings.rollout_urls
            raw = sample_agent_runs(settings, rollout, tasks, progress)
        # Length probes need the engine itself: only for rollout engines that are precision profiles (a
        # server elsewhere is not the embedded engine, whatever its name).
        probes[rollout] = (sample_probes(settings, rollout, tasks, progress)
                           if settings.lengths and rollout in PRECISIONS and rollout not in settings.rollout_urls
                           else [])
        _write_jsonl(layout.trajectories_path(run_dir, rollout), raw)
        agent_runs[rollout] = [r for r in (_stitched(run) for run in raw) if r is not None]
    cells, points, positions = [], [], []
    for t_index, trainer in enumerate(settings.trainer_engines):
        # A replay engine scores the rollout engines whose runs carry routed experts; the others' cells
        # say why they are absent.
        absent = {rollout: replay_problem(agent_runs[rollout] + probes[rollout])
                  for rollout in settings.rollout_engines} if parse_trainer(trainer).replay else {}
        everything = [r for rollout in settings.rollout_engines if absent.get(rollout) is None
                      for r in agent_runs[rollout] + probes[rollout]]
        if progress:
            progress("teacher forcing", t_index, len(settings.trainer_engines))
        scored = _score(settings, trainer, everything) if everything else []
        by_id = {id(r): s for r, s in zip(everything, scored)}
        for rollout in settings.rollout_engines:
            if absent.get(rollout) is not None:
                cells.append(_cell(rollout, trainer, [], [], absent=absent[rollout]))
                continue
            dense, router = [], []
            for r in agent_runs[rollout]:
                s = by_id[id(r)]
                r.trainer_logprobs[trainer] = s.logprobs_T
                d, rr = _reports(r, rollout, trainer, s, tokenizer)
                dense.append(d)
                if rr is not None:
                    router.append(rr)
            probe_dense = [_reports(p, rollout, trainer, by_id[id(p)], tokenizer)[0] for p in probes[rollout]]
            _write_jsonl(layout.dense_path(run_dir, rollout, trainer), dense)
            if router:
                _write_jsonl(layout.router_path(run_dir, rollout, trainer), router)
            if probe_dense:
                _write_jsonl(run_dir / "reports" / f"{layout.pair(rollout, trainer)}.lengths.dense.jsonl", probe_dense)
            cells.append(_cell(rollout, trainer, dense, router, _cell_rollout_corr(agent_runs[rollout], trainer)))
            if probes[rollout]:
                points += _length_points(rollout, trainer, probes[rollout], probe_dense)
                positions.append(position_profile_of(rollout, trainer, probes[rollout],
                                                     [by_id[id(p)].logprobs_T for p in probes[rollout]]))
    if progress:
        progress("teacher forcing", len(settings.trainer_engines), len(settings.trainer_engines))
    for rollout in settings.rollout_engines:
        _write_jsonl(layout.viewer_path(run_dir, rollout),
                     [_view(r, rollout, tokenizer, by_task.get(r.agent.task_id)) for r in agent_runs[rollout]])
    divergence: list[AgentDivergenceReport] = []
    reference = settings.rollout_engines[0]
    for other in settings.rollout_engines[1:]:
        divergence += _divergence(settings, reference, other,
                                  {r.trajectory_id: r for r in agent_runs[reference]},
                                  {r.trajectory_id: r for r in agent_runs[other]}, tokenizer)
    _write_jsonl(run_dir / layout.DIVERGENCE, divergence)
    matrix = ObservatoryMatrix(
        model=settings.model, suite=settings.suite, rollout_engines=list(settings.rollout_engines),
        trainer_engines=list(settings.trainer_engines), cells=cells, length_scaling=points,
        position_scaling=positions, divergence=divergence,
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    (run_dir / layout.MATRIX).write_text(json.dumps(matrix.model_dump(mode="json"), indent=2) + "\n")
    return matrix
