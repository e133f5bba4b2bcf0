"""Experiment (b), gradient part: does engine drift change the training step on one batch?

    python experiments/exp_b_gradients.py --out experiments/results/exp-b/gradients.json

Real rollouts: for each rollout engine (fp32, bf16, fp8 profiles of engines/precision.py, each
served by `rollmarket serve-model`'s app on loopback and driven by the real agent loop, calculator
tool and verifier) and each replicate r, one batch of the recipe's size (G runs of each of `groups`
training tasks, sampling seeds from r; the defaults are the tiny-start recipe of
configs/exp-a-campaign.toml). Replicate r has the same tasks and sampling seeds on every
engine, so its fp32 and bf16 batches differ only where a trajectory forked.

Gradients with the trainer's code: `train.learner.Learner.step` (GRPO advantages, PPO-clip, token
TIS with the recipe's cap), its optimizer swapped for SGD at lr 0 so the weights never move and the
step leaves its gradient in `.grad`, unclipped. Compared (cosine, ‖a − b‖/‖b‖):

1. weights channel — the same fp32 batch, IS on, behaviour logprobs from the fp32 sampler vs the
   bf16 / fp8 engines teacher-forced on those very tokens (router flips included);
2. sampling channel — the fp32 batch vs the bf16 / fp8 batch of the same seeds (forked runs differ);
3. the noise floor — two replicates of one engine (same tasks, other sampling seeds);
4. a positive control — behaviour logprobs shifted by ε_i ~ N(0, σ²) per sequence, whose expected
   effect is known in closed form (research/drift.py), measured against that prediction;
5. forks — per run, whether the bf16 / fp8 run's tokens differ from the fp32 run's and where, and
   the same for a rerun of the fp32 engine (what batching alone does).

The equivalence margins are declared below, before any result exists, and tested with
research/stats.py's TOST over the replicates (the replicate is the unit).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from rollmarket.agents import Agent, AgentSettings, ChatModel, LocalToolbox, Sampling, StitchError, stitch
from rollmarket.engines import RolloutEngine, TrainerEngine
from rollmarket.engines.loading import load_model
from rollmarket.observatory.dense import dense_summary
from rollmarket.observatory.offpolicy import offpolicy_figures
from rollmarket.research.drift import cosine, expected_squared_change, fork_position, relative_l2
from rollmarket.research.stats import t_interval, tost
from rollmarket.runs import code_version
from rollmarket.tasks.suites import load_suite
from rollmarket.train.advantages import compute_advantages
from rollmarket.train.batch import Datum
from rollmarket.train.config import resolve
from rollmarket.train.learner import Learner
from rollmarket.train.reference import sample_groups, serve_in_process
from rollmarket.verifiers import verify_trajectory

ROOT = Path(__file__).resolve().parent.parent
ENGINES = ("fp32", "bf16", "fp8")
DRIFTED = ("bf16", "fp8")

# Declared before running (docs/experiments.md, (b)): engine drift is negligible for the step when
# the gradient on the same batch with the engine's behaviour logprobs stays within 10% (relative L2)
# of the gradient with the fp32 sampler's — a tenth of what one more batch of the same engine moves
# it (two independent batches' gradients are nearly orthogonal: relative L2 ≈ √2) — and its cosine
# to it stays above 0.995.
MARGIN_RELATIVE_L2 = 0.10
MARGIN_COSINE = 0.995
ALPHA = 0.05
SIGMAS = (0.01, 0.03, 0.1, 0.3, 1.0)
"""Positive control: the per-sequence shifts (nats) injected into the behaviour logprobs."""
TOKEN_SIGMAS = (0.001, 0.003, 0.01, 0.03, 0.1)
"""Positive control, token level: independent per-token shifts (nats), around the real engines' |Δ|."""
PERMUTATIONS = 4
"""Placement control: the engine's own Δ values dealt to random tokens of the batch, this many times."""
PROBE = 0.5
"""Token-level control: Rademacher probes set each token's weight to 1 ± PROBE (below the cap), so
E‖Δg‖² = PROBE² · Σ_t ‖h_t‖², the sum over tokens of their parts' squared norms (Hutchinson)."""


def batch_seed(replicate: int, index: int) -> int:
    """The sampling seed of task `index` in replicate `replicate` (the same on every engine)."""
    return (replicate * 1_000_003 + index * 1_009 + 17) % 2**31


def sample_batches(model: str, precision: str, tasks, args, replicates: list[int]) -> dict[int, list[list]]:
    """replicate → groups of agent runs sampled by one engine at `precision`."""
    engine = RolloutEngine(load_model(model, precision, "cpu"))
    out = {}
    with serve_in_process(engine) as url:
        agent = Agent(ChatModel(url), LocalToolbox(), AgentSettings(max_steps=args.max_turns), verify=verify_trajectory)
        for r in replicates:
            samplings = [Sampling(temperature=args.temperature, max_tokens=args.max_tokens, seed=batch_seed(r, i))
                         for i in range(len(tasks))]
            out[r] = sample_groups(agent, tasks, args.group_size, samplings)
    return out


def model_tokens(run) -> np.ndarray:
    """Every token the model produced in a run, turn after turn (no prompt, no tool output)."""
    parts = [np.asarray(s.response_token_ids, dtype=np.int64) for s in run.steps]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def forks(a_groups, b_groups) -> dict:
    """Per run of two same-seed batches: whether and where the model's tokens first differ."""
    positions, lengths = [], []
    for ga, gb in zip(a_groups, b_groups):
        for ra, rb in zip(ga, gb):
            ta, tb = model_tokens(ra), model_tokens(rb)
            positions.append(fork_position(ta, tb))
            lengths.append(int(min(ta.size, tb.size)))
    forked = [p for p in positions if p is not None]
    return {"runs": len(positions), "forked": len(forked), "fork_positions": positions, "lengths": lengths,
            "forked_fraction": len(forked) / len(positions) if positions else None}


def to_data(groups) -> list[Datum]:
    """The trainer's data from groups of runs: GRPO advantages within each group, runs that tie
    their group dropped (as the trainer loop does), stitched token ids never re-tokenized."""
    data = []
    for runs in groups:
        advantages_G = compute_advantages(torch.tensor([r.reward for r in runs], dtype=torch.float32), "grpo")
        for run, adv in zip(runs, advantages_G.tolist()):
            if adv == 0.0:
                continue
            try:
                view = stitch(run.steps)
            except StitchError:
                continue
            mask_T = view.action_mask_T.astype(bool) & ~view.tool_output_mask_T.astype(bool)
            if view.logprobs_T is None or not mask_T.any():
                continue
            data.append(Datum(view.prompt_token_ids_P, view.response_token_ids_T, view.logprobs_T,
                              mask_T.astype(np.float32), advantage=adv))
    return data


class Gradients:
    """The trainer's step gradient on a batch, weights untouched."""

    def __init__(self, model: str, args):
        config = resolve(None, [f"model.path={model}", f"rollout.temperature={args.temperature}",
                                "correction.kind=token_tis", f"correction.cap={args.cap}",
                                "optim.grad_clip=1e30", f"seed={args.seed}"])
        self.learner = Learner(config)
        self.params = [p for p in self.learner.model.parameters() if p.requires_grad]
        # lr 0: the step's update is p − 0·grad, so the weights stay the starting policy's, bit for bit.
        self.learner.optimizer = torch.optim.SGD(self.params, lr=0.0)
        self.temperature = args.temperature
        self.before = torch.cat([p.detach().flatten() for p in self.params]).clone()

    def old(self, data: list[Datum], replay: list[np.ndarray | None] | None = None) -> list[Datum]:
        """The data with π_old (the trainer's own teacher-forced logprobs) filled in; with `replay`
        (router replay, R3: per datum the experts to route its response tokens through), π_old is
        the replayed forward's and the data carry those experts into the step, as the loop does."""
        scored = self.learner.score([(d.prompt_token_ids_P, d.response_token_ids_T) for d in data], self.temperature,
                                    replayed_experts=replay)
        return [Datum(d.prompt_token_ids_P, d.response_token_ids_T, d.logprobs_T, d.action_mask_T, d.advantage,
                      d.corrected, s.logprobs_T, None if replay is None else replay[i])
                for i, (d, s) in enumerate(zip(data, scored))]

    def __call__(self, data: list[Datum], *, behaviour: list[np.ndarray] | None = None, corrected: bool,
                 advantages: list[float] | None = None) -> np.ndarray | None:
        """The flat gradient of one step on `data` (None when every group tied: nothing to train on);
        data that carry routed experts (`old(data, replay)`) are trained with router replay."""
        if not data:
            return None
        data = [Datum(d.prompt_token_ids_P, d.response_token_ids_T,
                      d.logprobs_T if behaviour is None else behaviour[i], d.action_mask_T,
                      d.advantage if advantages is None else advantages[i], corrected, d.old_logprobs_T,
                      d.routed_experts_TLK)
                for i, d in enumerate(data)]
        self.learner.step(data, self.temperature)
        g = np.concatenate([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().double().numpy().ravel()
                            for p in self.params])
        return g


def teacher_forced(model: str, precision: str, data: list[Datum], temperature: float):
    engine = TrainerEngine(load_model(model, precision, "cpu"))
    return engine.score_batch([(d.prompt_token_ids_P, d.response_token_ids_T) for d in data], temperature=temperature)


def permuted(data: list[Datum], behaviour: list[np.ndarray], rng: np.random.Generator) -> list[np.ndarray]:
    """Behaviour logprobs whose Δ = old − behaviour on the policy's tokens are the given ones, shuffled
    across the batch's policy tokens (the other positions keep theirs)."""
    masks = [d.action_mask_T.astype(bool) for d in data]
    delta_N = np.concatenate([(d.old_logprobs_T - b)[m] for d, b, m in zip(data, behaviour, masks)])
    delta_N = rng.permutation(delta_N)
    out, start = [], 0
    for d, b, m in zip(data, behaviour, masks):
        new = np.array(b, dtype=np.float32, copy=True)
        n = int(m.sum())
        new[m] = d.old_logprobs_T[m] - delta_N[start:start + n]
        out.append(new)
        start += n
    return out


def router_flip_rate(a, b) -> float | None:
    """Share of (token, MoE layer) positions whose top-1 expert differs between two scorings."""
    if a[0].routed_experts_TLK is None:
        return None
    flips = sum(int((x.routed_experts_TLK[:, :, 0] != y.routed_experts_TLK[:, :, 0]).sum()) for x, y in zip(a, b))
    total = sum(x.routed_experts_TLK[:, :, 0].size for x in a)
    return flips / total if total else None


def mismatch(data: list[Datum], behaviour: list[np.ndarray]) -> dict | None:
    """Trainer (π_old) vs a behaviour on the policy's tokens: mean |Δ|, our token ESS (the gate's) and
    verl's rollout_is ESS at C = 2 (None: no data)."""
    if not data:
        return None
    masks = [d.action_mask_T.astype(bool) for d in data]
    old_N = np.concatenate([d.old_logprobs_T[m] for d, m in zip(data, masks)]).astype(np.float64)
    beh_N = np.concatenate([b[m] for b, m in zip(behaviour, masks)]).astype(np.float64)
    abs_N = np.abs(old_N - beh_N)
    lengths = [int(m.sum()) for m in masks]
    return {"tokens": int(old_N.size), "mean_abs_delta": float(abs_N.mean()), "max_abs_delta": float(abs_N.max()),
            "fraction_above_0.1": float((abs_N > 0.1).mean()),
            "token_ess": float(dense_summary(beh_N, old_N).token_ess),
            "rollout_is_ess": offpolicy_figures(beh_N, old_N, lengths).rollout_is_eff_sample_size}


def pair(a: np.ndarray | None, b: np.ndarray | None) -> dict:
    if a is None or b is None:
        return {"cosine": None, "relative_l2": None}
    return {"cosine": cosine(a, b), "relative_l2": relative_l2(a, b)}


def summary(values: list[float]) -> dict:
    x = [v for v in values if v is not None and np.isfinite(v)]
    if len(x) < 2:
        return {"n": len(x), "mean": float(np.mean(x)) if x else None, "interval": None}
    lo, hi = t_interval(x)
    return {"n": len(x), "mean": float(np.mean(x)), "interval": [lo, hi]}


def equivalence(values: list[float], margin: float) -> dict | None:
    """research/stats.py's TOST of |mean| < margin over the replicates (None below 2 of them)."""
    if len(values) < 2:
        return None
    eq = tost(values, margin, ALPHA)
    return {"margin": margin, "p": eq.p, "interval_90": list(eq.interval), "equivalent": eq.p < ALPHA}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="models/tiny-start")
    parser.add_argument("--suite", default="arithmetic")
    parser.add_argument("--replicates", type=int, default=6)
    parser.add_argument("--groups", type=int, default=8, help="tasks per batch (the recipe's groups_per_step)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--cap", type=float, default=2.0, help="token TIS cap (the recipe's correction.cap)")
    parser.add_argument("--draws", type=int, default=16, help="positive control: noise draws per σ")
    parser.add_argument("--seed", type=int, default=0, help="task order and the control's noise")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "exp-b" / "gradients.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.monotonic()
    model = str((ROOT / args.model) if not Path(args.model).is_absolute() else Path(args.model))
    tasks = load_suite(args.suite, "train")
    random.Random(args.seed).shuffle(tasks)
    tasks = tasks[:args.groups]
    reps = list(range(args.replicates))

    # 1. Rollouts: every engine, every replicate; the fp32 engine once more for replicate 0.
    batches = {}
    for precision in ENGINES:
        t0 = time.monotonic()
        batches[precision] = sample_batches(model, precision, tasks, args, reps)
        print(f"sampled {precision}: {args.replicates} batches in {time.monotonic() - t0:.0f}s", flush=True)
    rerun = sample_batches(model, "fp32", tasks, args, [0])[0]

    report: dict = {
        "question": "does engine drift change the training step (the policy gradient on one batch)?",
        "declared": {"margin_relative_l2": MARGIN_RELATIVE_L2, "margin_cosine": MARGIN_COSINE, "alpha": ALPHA,
                     "sigmas": list(SIGMAS)},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {"platform": platform.platform(), "cpus": __import__("os").cpu_count(),
                    "torch": torch.__version__, "threads": args.threads},
        "code": code_version(), "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
        "tasks": [t.task_id for t in tasks],
    }
    report["forks"] = {f"fp32 vs {p}": forks_all(batches["fp32"], batches[p], reps) for p in DRIFTED}
    report["forks"]["fp32 vs fp32 rerun"] = forks(batches["fp32"][0], rerun)
    report["correct_rate"] = {p: [float(np.mean([bool(run.verification and run.verification.passed)
                                                 for g in batches[p][r] for run in g])) for r in reps]
                              for p in ENGINES}

    # 2. Gradients.
    grads = Gradients(model, args)
    data = {p: {r: grads.old(to_data(batches[p][r])) for r in reps} for p in ENGINES}
    report["datums"] = {p: [len(data[p][r]) for r in reps] for p in ENGINES}
    g_on = {p: {r: grads(data[p][r], corrected=False) for r in reps} for p in ENGINES}
    g_is = {p: {r: grads(data[p][r], corrected=True) for r in reps} for p in ENGINES}

    # Weights channel: the fp32 batch, behaviour from each engine teacher-forced on its tokens.
    weights: dict = {p: {"per_replicate": [], "mismatch": [], "router_flip_rate": [], "permuted_relative_l2": []}
                     for p in DRIFTED}
    rng = np.random.default_rng(args.seed)
    sampler_vs_trainer = []
    without_is_identical = []
    for r in reps:
        d = data["fp32"][r]
        if not d:
            continue
        fp32_tf = teacher_forced(model, "fp32", d, args.temperature)
        sampler_vs_trainer.append(mismatch(d, [x.logprobs_T for x in d]))
        for p in DRIFTED:
            tf = teacher_forced(model, p, d, args.temperature)
            behaviour = [x.logprobs_T for x in tf]
            g = grads(d, behaviour=behaviour, corrected=True)
            weights[p]["per_replicate"].append(pair(g, g_is["fp32"][r]))
            weights[p]["mismatch"].append(mismatch(d, behaviour))
            weights[p]["router_flip_rate"].append(router_flip_rate(fp32_tf, tf))
            # The same Δ values on other tokens: the drift's size and tail, without where it falls.
            weights[p]["permuted_relative_l2"].append([
                relative_l2(grads(d, behaviour=permuted(d, behaviour, rng), corrected=True), g_is["fp32"][r])
                for _ in range(PERMUTATIONS)])
            # Without IS the behaviour logprobs do not enter the step: the gradient must not move at all.
            without_is_identical.append(bool(np.array_equal(grads(d, behaviour=behaviour, corrected=False),
                                                            g_on["fp32"][r])))
    report["sampler_vs_trainer_fp32"] = sampler_vs_trainer
    report["without_is_gradient_unchanged"] = without_is_identical

    # The engines' own batches with their own reported logprobs: what IS does there, per engine.
    report["is_on_vs_off_own_batch"] = {p: [pair(g_is[p][r], g_on[p][r]) for r in reps] for p in ENGINES}
    report["own_batch_mismatch"] = {p: [mismatch(data[p][r], [x.logprobs_T for x in data[p][r]]) for r in reps]
                                    for p in ENGINES}

    # Sampling channel and the noise floor (IS off: the trainer's default for a train decision).
    later = [(r, s) for r in reps for s in reps if r < s]
    report["sampling"] = {
        **{f"fp32 vs {p}, same seeds": [pair(g_on[p][r], g_on["fp32"][r]) for r in reps] for p in DRIFTED},
        **{f"{p} vs {p}, other seeds (floor)": [pair(g_on[p][s], g_on[p][r]) for r, s in later] for p in ENGINES},
        **{f"fp32 vs {p}, other seeds": [pair(g_on[p][s], g_on["fp32"][r]) for r in reps for s in reps if r != s]
           for p in DRIFTED},
    }

    # 3. Positive control on the first fp32 batch with data: per-sequence shifts of known size.
    first = next(r for r in reps if data["fp32"][r])
    d0 = data["fp32"][first]
    base = grads(d0, behaviour=[x.old_logprobs_T for x in d0], corrected=True)  # every weight exactly 1
    per_seq = [grads(d0, behaviour=[x.old_logprobs_T for x in d0], corrected=True,
                     advantages=[x.advantage if j == i else 0.0 for j, x in enumerate(d0)]) for i in range(len(d0))]
    control = []
    for sigma in SIGMAS:
        rows = []
        for _ in range(args.draws):
            eps_B = rng.normal(0.0, sigma, len(d0))
            behaviour = [(x.old_logprobs_T + e).astype(np.float32) for x, e in zip(d0, eps_B)]
            g = grads(d0, behaviour=behaviour, corrected=True)
            rows.append({**pair(g, base), **mismatch(d0, behaviour)})
        sq = [float(x @ x) for x in per_seq]
        expected = expected_squared_change(sigma, args.cap, sq, float(base @ base))
        control.append({"sigma": sigma, "draws": rows, "expected_sq_relative_l2": expected,
                        "measured_sq_relative_l2": summary([row["relative_l2"] ** 2 for row in rows]),
                        "expected_mean_abs_delta": sigma * float(np.sqrt(2 / np.pi))})
    report["positive_control"] = {
        "replicate": first, "sequences": len(d0),
        "sum_of_parts_relative_l2": relative_l2(np.sum(per_seq, axis=0), base), "sigmas": control}

    # The same at the token level: independent shifts per token. Σ_t ‖h_t‖² from Rademacher probes.
    probes = []
    for _ in range(args.draws):
        signs = [rng.choice([-1.0, 1.0], size=len(x.old_logprobs_T)) for x in d0]
        behaviour = [(x.old_logprobs_T - np.log1p(PROBE * sg)).astype(np.float32) for x, sg in zip(d0, signs)]
        g = grads(d0, behaviour=behaviour, corrected=True)
        probes.append(float((g - base) @ (g - base)) / PROBE**2)
    token_parts = float(np.mean(probes))
    token_control = []
    for sigma in TOKEN_SIGMAS:
        rows = []
        for _ in range(args.draws):
            behaviour = [(x.old_logprobs_T + rng.normal(0.0, sigma, len(x.old_logprobs_T))).astype(np.float32)
                         for x in d0]
            g = grads(d0, behaviour=behaviour, corrected=True)
            rows.append({**pair(g, base), **mismatch(d0, behaviour)})
        token_control.append({"sigma": sigma, "draws": rows,
                              "expected_sq_relative_l2": expected_squared_change(sigma, args.cap, [token_parts],
                                                                                 float(base @ base)),
                              "measured_sq_relative_l2": summary([row["relative_l2"] ** 2 for row in rows]),
                              "expected_mean_abs_delta": sigma * float(np.sqrt(2 / np.pi))})
    report["positive_control_tokens"] = {"replicate": first, "probe": PROBE, "token_parts_sq": probes,
                                         "sequence_parts_sq": sum(float(x @ x) for x in per_seq),
                                         "total_sq": float(base @ base), "sigmas": token_control}

    # 4. Summaries and the declared tests (the replicate is the unit).
    report["summary"] = {}
    for p in DRIFTED:
        rel = [x["relative_l2"] for x in weights[p]["per_replicate"]]
        cos = [x["cosine"] for x in weights[p]["per_replicate"]]
        rel = [x for x in rel if x is not None]
        cos = [x for x in cos if x is not None]
        report["summary"][f"weights {p}"] = {
            "relative_l2": summary(rel), "cosine": summary(cos),
            "tost_relative_l2": equivalence(rel, MARGIN_RELATIVE_L2),
            "tost_one_minus_cosine": equivalence([1 - c for c in cos], 1 - MARGIN_COSINE),
            "mean_abs_delta": summary([m["mean_abs_delta"] for m in weights[p]["mismatch"]]),
            "token_ess": summary([m["token_ess"] for m in weights[p]["mismatch"]]),
            "router_flip_rate": summary(weights[p]["router_flip_rate"]),
        }
    for key, rows in report["sampling"].items():
        report["summary"][key] = {"relative_l2": summary([x["relative_l2"] for x in rows]),
                                  "cosine": summary([x["cosine"] for x in rows])}
    report["weights"] = weights
    moved = float((torch.cat([p.detach().flatten() for p in grads.params]) - grads.before).abs().max())
    report["weights_moved_max_abs"] = moved  # 0: every gradient above is at the starting policy
    report["wall_s"] = time.monotonic() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=float) + "\n")
    print(json.dumps(report["summary"], indent=1, default=float))
    print(f"wrote {args.out} in {report['wall_s'] / 60:.1f} min")


def forks_all(a, b, reps) -> dict:
    rows = [forks(a[r], b[r]) for r in reps]
    return {"per_replicate": rows, "runs": sum(x["runs"] for x in rows), "forked": sum(x["forked"] for x in rows)}


if __name__ == "__main__":
    main()
