"""A small, realistic observatory run directory written through the contracts, for dashboard tests.

Three rollout engines (fp32, bf16, fp8) times two trainer engines (fp32, bf16) over ten calculator
tasks, three samples each: 30 trajectories per rollout engine, every one teacher-forced by both
trainers except fp8 x fp32, which covers 12 (the low-n tile). The tiny MoE's 4 layers x 8 experts,
top-2, give the router reports. Every number comes from one seeded simulation of per-token
logprobs, so the tiles, the reports, the worst tokens and the viewer's tokens agree with each other:
    Δ_t = trainer noise − rollout noise on a shared base logprob, with rare spikes on bf16 and fp8.
Each viewer file also holds one length probe, agent-0000#0@128 ('#' and '@' in a URL). Tasks
agent-0001 and agent-0004 (sample 0) split between bf16 and fp8 at turn 1 (tool_args): fp8 writes a
different expression. Nothing here depends on the real runner (`rollmarket observe`).
"""

from __future__ import annotations

import json
import math
import re
import zlib
from pathlib import Path

import numpy as np

from rollmarket.contracts import (
    AgentDivergenceReport,
    DeltaToken,
    DenseMismatchReport,
    DivergenceKind,
    Interval,
    LengthPoint,
    MatrixCell,
    ObservatoryMatrix,
    PositionBucket,
    PositionProfile,
    RouterMismatchReport,
    WorstToken,
)
from rollmarket.contracts.agent import (
    AgentStep,
    AgentTrajectory,
    TerminalReason,
    ToolCallRecord,
    ToolResult,
    VerifyResult,
)
from rollmarket.observatory import layout
from rollmarket.observatory.layout import TrajectoryView, ViewToolCall, ViewTurn

ROLLOUT_ENGINES = ["fp32", "bf16", "fp8"]
TRAINER_ENGINES = ["fp32", "bf16"]
TASKS = [f"agent-{k:04d}" for k in range(10)]
SAMPLES = 3
LENGTHS = [128, 512, 2048]
LOW_N_CELL = ("fp8", "fp32")
LOW_N = 12
DIVERGENT_TASKS = ["agent-0001", "agent-0004"]
NUM_LAYERS, NUM_EXPERTS, TOP_K = 4, 8, 2
CLAMP = 20.0
RUN_ID = "20250301T120000Z-f1x7e0"

# Per-engine numerics noise on a logprob (std), and the chance and std of a spike.
NOISE = {"fp32": (3e-4, 0.0, 0.0), "bf16": (0.10, 0.004, 0.8), "fp8": (0.24, 0.02, 1.4)}
TRAINER_NOISE = {"fp32": (3e-4, 0.0, 0.0), "bf16": (0.05, 0.0, 0.0)}
# Mean router top-1 flip rate of each (rollout, trainer) pair.
FLIP = {("fp32", "fp32"): 0.004, ("fp32", "bf16"): 0.03, ("bf16", "fp32"): 0.07,
        ("bf16", "bf16"): 0.08, ("fp8", "fp32"): 0.19, ("fp8", "bf16"): 0.21}

SYSTEM = "You are a careful agent. Use the calculator tool for arithmetic, then answer with the number."


def _seed(*parts: object) -> int:
    return zlib.crc32("|".join(map(str, parts)).encode())


def _tokens(text: str) -> list[str]:
    """A BPE-looking split: words with their leading space, runs of punctuation, newlines."""
    return re.findall(r" ?\w+|\n|[^\w\s\n]+| +", text)


def _token_id(text: str) -> int:
    return zlib.crc32(text.encode()) % 1536


# ----------------------------------------------------------------------------- the agent runs


def _task(k: int) -> tuple[int, int, int]:
    rng = np.random.default_rng(_seed("task", k))
    return int(rng.integers(11, 60)), int(rng.integers(11, 60)), int(rng.integers(2, 40))


def _script(task_id: str, sample: int, engine: str) -> tuple[str, list[dict], str]:
    """(question, turns, final answer): each turn is {'text', 'calls': [(name, args, result)]}."""
    k = int(task_id.split("-")[1])
    a, b, c = _task(k)
    two_step = k % 3 != 0
    question = f"What is {a} * {b} + {c}?" if two_step else f"What is {a} * {b}?"
    product = a * b
    turns = [{"text": f"<think>\nI need {a} * {b} first.\n</think>\n",
              "calls": [("calculator", f"{a}*{b}", str(product))]}]
    answer = product
    if two_step:
        diverge = engine == "fp8" and sample == 0 and task_id in DIVERGENT_TASKS
        expr = f"{product}-{c}" if diverge else f"{product}+{c}"
        answer = product - c if diverge else product + c
        turns.append({"text": f"<think>\nNow add {c}.\n</think>\n", "calls": [("calculator", expr, str(answer))]})
    turns.append({"text": f"The answer is {answer}.", "calls": []})
    return question, turns, str(answer)


def _call_markup(name: str, expression: str) -> str:
    return ('<tool_call>\n{"name": "' + name + '", "arguments": {"expression": "' + expression
            + '"}}\n</tool_call>')


def _view(task_id: str, sample: int, engine: str, tid: str, trainers: list[str]) -> TrajectoryView:
    question, script, answer = _script(task_id, sample, engine)
    k = int(task_id.split("-")[1])
    a, b, c = _task(k)
    expected = str(a * b + c) if k % 3 else str(a * b)
    turns: list[ViewTurn] = []
    new_messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    for index, step in enumerate(script):
        text = step["text"] + "".join(_call_markup(n, e) for n, e, _ in step["calls"]) + "<|im_end|>"
        toks = _tokens(text.replace("<|im_end|>", "")) + ["<|im_end|>"]
        rng = np.random.default_rng(_seed("lp", tid, engine, index))
        # A shared base logprob (what an exact engine would say); most tokens are near-certain.
        base = np.where(rng.random(len(toks)) < 0.8, -rng.exponential(0.05, len(toks)),
                        -rng.exponential(1.2, len(toks)))
        rollout = _noisy(base, NOISE[engine], rng)
        trainer_lp = {t: _noisy(base, TRAINER_NOISE[t], np.random.default_rng(_seed("tr", tid, engine, index, t)))
                      for t in trainers}
        calls = [ViewToolCall(name=n, arguments=json.dumps({"expression": e}), result=r, outcome="ok")
                 for n, e, r in step["calls"]]
        turns.append(ViewTurn(
            index=index, new_messages=new_messages, tokens=toks, token_ids=[_token_id(t) for t in toks],
            rollout_logprobs=[round(float(x), 6) for x in rollout],
            trainer_logprobs={t: [round(float(x), 6) for x in v] for t, v in trainer_lp.items()},
            content=step["text"].split("</think>\n")[-1], tool_calls=calls,
            finish_reason="tool_calls" if calls else "stop"))
        new_messages = [{"role": "tool", "name": n, "tool_call_id": f"call_{index}_{j}", "content": r}
                        for j, (n, _, r) in enumerate(step["calls"])]
    return TrajectoryView(trajectory_id=tid, task_id=task_id, rollout_engine=engine, prompt=question, turns=turns,
                          final_answer=f"The answer is {answer}.", terminal_reason="final_answer",
                          reward=1.0 if answer == expected else 0.0, expected=expected)


def _noisy(base: np.ndarray, noise: tuple[float, float, float], rng: np.random.Generator) -> np.ndarray:
    std, p_spike, spike_std = noise
    values = base + rng.normal(0.0, std, base.shape)
    if p_spike:
        values = values + np.where(rng.random(base.shape) < p_spike, rng.normal(0.0, spike_std, base.shape), 0.0)
    return np.minimum(values, -1e-6)


def _agent_trajectory(view: TrajectoryView, sample: int) -> AgentTrajectory:
    steps = []
    for turn in view.turns:
        calls = [ToolCallRecord(id=f"call_{turn.index}_{j}", name=c.name, raw_arguments=c.arguments,
                                arguments=json.loads(c.arguments), result=ToolResult(name=c.name, content=c.result))
                 for j, c in enumerate(turn.tool_calls)]
        steps.append(AgentStep(index=turn.index, response_token_ids=np.array(turn.token_ids, dtype=np.int32),
                               logprobs=np.array(turn.rollout_logprobs, dtype=np.float32), content=turn.content,
                               tool_calls=calls, finish_reason=turn.finish_reason))
    messages = [m for turn in view.turns for m in turn.new_messages]
    return AgentTrajectory(task_id=view.task_id, sample_index=sample, seed=sample, model="tiny-moe",
                           messages=messages, steps=steps, final_answer=view.final_answer,
                           terminal_reason=TerminalReason.final_answer,
                           verification=VerifyResult(reward=view.reward or 0.0, passed=view.reward == 1.0))


# ----------------------------------------------------------------------------- mismatch reports


def _stitched(view: TrajectoryView, trainer: str):
    """Tokens of every turn in order with their stitched offsets (tool output counted, not compared)."""
    rows, offset = [], 0
    for turn in view.turns:
        offset += sum(len(_tokens(m["content"])) for m in turn.new_messages if m["role"] == "tool")
        for i, text in enumerate(turn.tokens):
            rows.append((offset + i, turn.index, text, turn.token_ids[i], turn.rollout_logprobs[i],
                         turn.trainer_logprobs[trainer][i]))
        offset += len(turn.tokens)
    return rows, offset


def dense_report(tid: str, rollout: str, trainer: str, rows: list[tuple], response_length: int) -> DenseMismatchReport:
    """The DESIGN.md formulas over the given (position, turn, text, id, rollout lp, trainer lp) rows."""
    r_lp = np.array([row[4] for row in rows])
    t_lp = np.array([row[5] for row in rows])
    delta = t_lp - r_lp
    w = np.exp(np.clip(delta, -CLAMP, CLAMP))
    n = len(delta)
    ratio = np.exp(delta)
    k = max(1, math.ceil(0.01 * n))
    worst = int(np.argmax(np.abs(delta)))
    texts = [row[2] for row in rows]
    p = rows[worst]
    return DenseMismatchReport(
        trajectory_id=tid, rollout_engine=rollout, trainer_engine=trainer, n_tokens=n,
        token_ess=float(w.sum() ** 2 / (n * (w ** 2).sum())), sequence_log_ratio=float(delta.sum()),
        mean_delta=float(delta.mean()), mean_abs_delta=float(np.abs(delta).mean()),
        max_abs_delta=float(np.abs(delta).max()), clipped_fraction=float((np.abs(delta) > CLAMP).mean()),
        veto_fraction=float((np.abs(delta) > 30).mean()), second_moment=float((w ** 2).mean()),
        top1pct_gradient_mass=float(np.sort(w)[::-1][:k].sum() / w.sum()), kl_k1=float((r_lp - t_lp).mean()),
        kl_k3=float((ratio - delta - 1).mean()), chi2=float((ratio ** 2).mean() - 1),
        log_ppl_rollout=float(-r_lp.mean()), log_ppl_trainer=float(-t_lp.mean()),
        log_ppl_diff=float(r_lp.mean() - t_lp.mean()),
        mean_prob_diff=float(np.abs(np.exp(r_lp) - np.exp(t_lp)).mean()), response_length=response_length,
        worst_token=WorstToken(position=p[0], token_id=p[3], token_text=p[2], delta=float(delta[worst]),
                               rollout_logprob=p[4], trainer_logprob=p[5],
                               context_before="".join(texts[max(0, worst - 24):worst]),
                               context_after="".join(texts[worst + 1:worst + 9]), turn=p[1]))


def _router_report(tid: str, rollout: str, trainer: str, n_tokens: int) -> RouterMismatchReport:
    rng = np.random.default_rng(_seed("router", tid, rollout, trainer))
    rate = FLIP[(rollout, trainer)]
    layer_rate = np.clip(rate * np.array([0.6, 0.9, 1.1, 1.4]) * rng.uniform(0.8, 1.2, NUM_LAYERS), 0, 1)
    flips_TL = rng.random((n_tokens, NUM_LAYERS)) < layer_rate
    per_layer = flips_TL.mean(axis=0)
    worst = int(np.argmax(per_layer))
    # A differing top-k set at a layer is a bit likelier than a top-1 flip (the second expert moves too).
    set_differs_TL = flips_TL | (rng.random((n_tokens, NUM_LAYERS)) < rate * 0.5)
    return RouterMismatchReport(
        trajectory_id=tid, rollout_engine=rollout, trainer_engine=trainer, n_tokens=n_tokens,
        num_layers=NUM_LAYERS, top_k=TOP_K, router_flip_rate=float(flips_TL.mean()),
        token_expert_disagreement_rate=float(set_differs_TL.any(axis=1).mean()),
        per_layer_flip_rate=[float(x) for x in per_layer], worst_layer=worst,
        worst_layer_flip_rate=float(per_layer[worst]), topk_overlap=float(1 - set_differs_TL.mean() / TOP_K))


def interval(values: list[float], seed: int) -> Interval:
    """Mean with a percentile-bootstrap 95% interval (1000 resamples)."""
    if not values:
        return Interval(mean=None, lo=None, hi=None, n=0)
    x = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), (1000, len(x)))].mean(axis=1)
    return Interval(mean=float(x.mean()), lo=float(np.quantile(means, 0.025)), hi=float(np.quantile(means, 0.975)),
                    n=len(x))


def _sequence_ess(log_ratios: list[float]) -> float:
    w = np.exp(np.clip(np.asarray(log_ratios), -CLAMP, CLAMP))
    return float(w.sum() ** 2 / (len(w) * (w ** 2).sum()))


def _cell(rollout: str, trainer: str, dense: list[DenseMismatchReport], router: list[RouterMismatchReport],
          moe: bool = True) -> MatrixCell:
    seed = _seed("cell", rollout, trainer)
    worst = max(dense, key=lambda r: abs(r.worst_token.delta))
    flips = [r.router_flip_rate for r in router]
    per_layer = np.mean([r.per_layer_flip_rate for r in router], axis=0)
    disagreement = [r.token_expert_disagreement_rate for r in router]
    routing = {"router_flip_rate": interval(flips, seed + 4),
               "token_expert_disagreement_rate": interval(disagreement, seed + 5),
               "worst_layer": int(np.argmax(per_layer)), "worst_layer_flip_rate": float(per_layer.max())} if moe else {}
    return MatrixCell(
        rollout_engine=rollout, trainer_engine=trainer, n=len(dense), tokens=sum(r.n_tokens for r in dense),
        token_ess=interval([r.token_ess for r in dense], seed),
        sequence_ess=_sequence_ess([r.sequence_log_ratio for r in dense]),
        mean_abs_delta=interval([r.mean_abs_delta for r in dense], seed + 1),
        max_abs_delta=max(r.max_abs_delta for r in dense),
        kl_k3=interval([r.kl_k3 for r in dense], seed + 2),
        mean_prob_diff=interval([r.mean_prob_diff for r in dense], seed + 3),
        worst_token=worst.worst_token, worst_trajectory_id=worst.trajectory_id, low_n=len(dense) < 30, **routing)


def _length_points(rollout: str, trainer: str) -> list[LengthPoint]:
    points = []
    for max_tokens in LENGTHS:
        rng = np.random.default_rng(_seed("length", rollout, trainer, max_tokens))
        ess, mad, lengths = [], [], []
        for _ in range(10):
            n = int(rng.integers(max_tokens // 2, max_tokens + 1))
            base = -rng.exponential(0.3, n)
            delta = _noisy(base, TRAINER_NOISE[trainer], rng) - _noisy(base, NOISE[rollout], rng)
            w = np.exp(np.clip(delta, -CLAMP, CLAMP))
            ess.append(float(w.sum() ** 2 / (n * (w ** 2).sum())))
            mad.append(float(np.abs(delta).mean()))
            lengths.append(n)
        seed = _seed("length-ci", rollout, trainer, max_tokens)
        points.append(LengthPoint(rollout_engine=rollout, trainer_engine=trainer, max_tokens=max_tokens,
                                  mean_response_tokens=float(np.mean(lengths)), token_ess=interval(ess, seed),
                                  mean_abs_delta=interval(mad, seed + 1)))
    return points


def _position_profile(rollout: str, trainer: str) -> PositionProfile:
    """Buckets [0, 16), [16, 32), [32, 64) of 10 probes; 7 tokens after an EOS excluded."""
    scale = NOISE[rollout][0] + TRAINER_NOISE[trainer][0]
    buckets = [PositionBucket(start=start, stop=stop, n_tokens=10 * (stop - start), n_trajectories=10,
                              mean_abs_delta=round(scale * (1 + k / 10), 6), kl_k3=round(scale * scale / 2, 8))
               for k, (start, stop) in enumerate([(0, 16), (16, 32), (32, 64)])]
    return PositionProfile(rollout_engine=rollout, trainer_engine=trainer, n_trajectories=10, tokens_after_eos=7,
                           buckets=buckets)


def _divergence(task_id: str, views: dict[str, dict[str, TrajectoryView]]) -> AgentDivergenceReport:
    tid = layout.trajectory_id(task_id, 0)
    a, b = views["bf16"][tid], views["fp8"][tid]
    split = 1
    turn_a = a.turns[split]
    # Engine B's logprobs of engine A's tokens of the split turn: fp8 noise on the same base.
    rng = np.random.default_rng(_seed("split", task_id))
    b_lp = _noisy(np.asarray(turn_a.rollout_logprobs), NOISE["fp8"], rng)
    offset = sum(len(t.tokens) for t in a.turns[:split])
    rows = [(offset + i, split, text, turn_a.token_ids[i], turn_a.rollout_logprobs[i], round(float(b_lp[i]), 6))
            for i, text in enumerate(turn_a.tokens)]
    report = dense_report(tid, "bf16", "fp8", rows, len(rows))
    # The split point: the first token where the two runs' texts of the turn differ.
    tokens_b = b.turns[split].tokens
    cut = next(i for i, (x, y) in enumerate(zip(turn_a.tokens, tokens_b)) if x != y)
    top = sorted(rows[:cut + 1], key=lambda r: -abs(r[5] - r[4]))[:5]
    calls_a = {(c.name, c.arguments) for t in a.turns for c in t.tool_calls}
    calls_b = {(c.name, c.arguments) for t in b.turns for c in t.tool_calls}
    return AgentDivergenceReport(
        task_id=task_id, sample_index=0, engine_a="bf16", engine_b="fp8", first_divergent_step=split,
        kind=DivergenceKind.tool_args, tool_choice_disagreement_rate=0.0,
        tool_call_jaccard=len(calls_a & calls_b) / len(calls_a | calls_b),
        final_answer_match_strict=a.final_answer == b.final_answer, final_answer_match_soft=False,
        steps_a=len(a.turns), steps_b=len(b.turns), split_turn=report,
        top_delta_tokens=[DeltaToken(position=r[0], token_text=r[2], delta=r[5] - r[4], rollout_logprob=r[4],
                                     trainer_logprob=r[5]) for r in top])


# ----------------------------------------------------------------------------- the run directory


def _write_jsonl(path: Path, records) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(r.model_dump_json() + "\n" for r in records))


def write_fixture_run(path: Path, *, created_at: str = "2025-03-01T12:00:00Z", model: str = "models/tiny-moe",
                      moe: bool = True) -> Path:
    """Write the fixture run into directory `path` (created) and return it; `moe=False` writes a
    dense model's run (no router reports, no router fields in the tiles)."""
    path.mkdir(parents=True, exist_ok=True)
    tids = [layout.trajectory_id(task, s) for task in TASKS for s in range(SAMPLES)]
    views: dict[str, dict[str, TrajectoryView]] = {}
    cells, length_scaling, positions = [], [], []
    for rollout in ROLLOUT_ENGINES:
        covered = {t: tids[:LOW_N] if (rollout, t) == LOW_N_CELL else tids for t in TRAINER_ENGINES}
        views[rollout] = {}
        for tid in tids:
            task_id, sample = tid.split("#")
            trainers = [t for t in TRAINER_ENGINES if tid in covered[t]]
            views[rollout][tid] = _view(task_id, int(sample), rollout, tid, trainers)
        # A length probe ('#' and '@' in its id), viewable but outside the tiles' agent runs.
        probe = layout.trajectory_id(TASKS[0], 0, LENGTHS[0])
        probe_view = _view(TASKS[0], 0, rollout, probe, TRAINER_ENGINES)
        _write_jsonl(layout.viewer_path(path, rollout), [*views[rollout].values(), probe_view])
        _write_jsonl(layout.trajectories_path(path, rollout),
                     [_agent_trajectory(v, int(v.trajectory_id.split("#")[1])) for v in views[rollout].values()])
        for trainer in TRAINER_ENGINES:
            dense, router = [], []
            for tid in covered[trainer]:
                rows, length = _stitched(views[rollout][tid], trainer)
                dense.append(dense_report(tid, rollout, trainer, rows, length))
                router.append(_router_report(tid, rollout, trainer, len(rows)))
            _write_jsonl(layout.dense_path(path, rollout, trainer), dense)
            if moe:
                _write_jsonl(layout.router_path(path, rollout, trainer), router)
            cells.append(_cell(rollout, trainer, dense, router, moe))
            length_scaling += _length_points(rollout, trainer)
            positions.append(_position_profile(rollout, trainer))
    divergence = [_divergence(task, views) for task in DIVERGENT_TASKS]
    _write_jsonl(path / layout.DIVERGENCE, divergence)
    matrix = ObservatoryMatrix(model=model, suite="agent", rollout_engines=ROLLOUT_ENGINES,
                               trainer_engines=TRAINER_ENGINES, cells=cells, length_scaling=length_scaling,
                               position_scaling=positions,
                               divergence=divergence, created_at=created_at)
    (path / layout.MATRIX).write_text(matrix.model_dump_json(indent=2) + "\n")
    config = {"settings": {"model": model, "suite": "agent", "rollout_engines": ROLLOUT_ENGINES,
                           "trainer_engines": TRAINER_ENGINES, "samples": SAMPLES, "lengths": LENGTHS,
                           "seed": 0, "clamp": CLAMP},
              "code_version": {"rollmarket": "0.1.0"}}
    (path / layout.CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path
