"""Experiment (d), gradient part: what does router replay (R3) do to the step on one batch, per precision?

    python experiments/exp_r3_gradients.py --threads 1 --out experiments/results/exp-r3/gradients.json

Experiment (b)'s weights channel (experiments/exp_b_gradients.py, whose code this reuses) with a
replay channel beside it. Replicate r is one batch of (a)'s tiny-start recipe sampled by the fp32
engine (real agent loop, calculator tool, verifier; sampling seeds from r). Each lower-precision
engine (fp16, bf16, fp8 profiles of engines/precision.py) is teacher-forced on that very batch: its
logprobs are the behaviour logprobs a worker at that precision would report for those tokens, and
its routed experts the experts it would report. The trainer (fp32) then takes its step
(`Learner.step`, GRPO, PPO-clip, token TIS with the recipe's cap; SGD at lr 0, so every gradient is
at the starting policy) on the batch with those behaviour logprobs:

- without replay: it routes itself (exp-b's weights channel, router flips included);
- with replay: π_old and the update route every policy token through the engine's experts
  (`trainer.router_replay`: teacher forcing and step exactly as the training loop does them).

Each is compared (cosine, ‖a − b‖/‖b‖) with the fp32-rollout gradient (the same batch, behaviour
logprobs the fp32 sampler's own, no replay), against the noise floor of the same configuration
(two replicates: same tasks, other sampling seeds). Beside it: what replay does to the off-policy
figures the gate sees on those tokens (mean |Δlogp|, our token ESS, verl's rollout_is ESS, router
top-1 flips on policy tokens); replay's routing alone (IS off: the behaviour logprobs do not enter
the step, so only the experts differ); and a control, the fp32 sampler's own experts replayed,
which must leave the gradient where it was.
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
from exp_b_gradients import (ALPHA, MARGIN_COSINE, MARGIN_RELATIVE_L2, ROOT, Gradients, equivalence, mismatch, pair,
                             sample_batches, summary, teacher_forced, to_data)

from rollmarket.research.stats import sign_flip_test
from rollmarket.runs import code_version
from rollmarket.tasks.suites import load_suite

PRECISIONS = ("fp16", "bf16", "fp8")
CHANNELS = ("off", "on")
"""Router replay off (the trainer routes itself) and on (it routes through the engine's experts)."""

# Declared before running (docs/experiments.md, (d)): exp-b's margins for "the step is the fp32-rollout
# step" (‖g − g_fp32‖/‖g_fp32‖ < 0.10 and cosine > 0.995, TOST over the replicates at α = 0.05), tested
# with and without replay; and "replay moves the step toward the fp32-rollout step" when the paired
# difference rel(on) − rel(off) over the replicates is negative by the exact sign-flip test.


def routing_changes(a_TLK: list, b_TLK: list, masks: list[np.ndarray]) -> dict | None:
    """Over the (policy token, MoE layer) positions of two routings: the share whose top-1 expert
    differs (the gate's router flip rate) and the share whose set of top-k experts differs."""
    top1 = topk = total = 0
    for a, b, m in zip(a_TLK, b_TLK, masks):
        if a is None or b is None:
            return None
        a, b = a[m.astype(bool)], b[m.astype(bool)]
        top1 += int((a[..., 0] != b[..., 0]).sum())
        topk += int((np.sort(a, -1) != np.sort(b, -1)).any(-1).sum())
        total += int(a[..., 0].size)
    return {"top1": top1 / total, "topk_set": topk / total} if total else None


def paired(on: list[float], off: list[float]) -> dict | None:
    """rel(on) − rel(off) per replicate: mean, 95% t interval, exact sign-flip p (None below 2)."""
    d = [a - b for a, b in zip(on, off) if a is not None and b is not None]
    if len(d) < 2:
        return None
    return {"differences": d, **summary(d), "sign_flip_p": sign_flip_test(d).p}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="models/tiny-start")
    parser.add_argument("--suite", default="arithmetic")
    parser.add_argument("--replicates", type=int, default=8)
    parser.add_argument("--groups", type=int, default=8, help="tasks per batch (the recipe's groups_per_step)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--cap", type=float, default=2.0, help="token TIS cap (the recipe's correction.cap)")
    parser.add_argument("--seed", type=int, default=0, help="task order and the trainer's seed")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "exp-r3" / "gradients.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.monotonic()
    model = str((ROOT / args.model) if not Path(args.model).is_absolute() else Path(args.model))
    tasks = load_suite(args.suite, "train")
    random.Random(args.seed).shuffle(tasks)
    tasks = tasks[:args.groups]
    reps = list(range(args.replicates))

    t0 = time.monotonic()
    batches = sample_batches(model, "fp32", tasks, args, reps)
    print(f"sampled fp32: {args.replicates} batches in {time.monotonic() - t0:.0f}s", flush=True)

    grads = Gradients(model, args)
    learner = grads.learner
    reference, reference_no_is, own_replay, own_replay_routing = {}, {}, [], []
    per = {p: {"gradient": {c: {} for c in CHANNELS}, "routing_alone": [], "on_vs_off": [],
               "mismatch": {c: [] for c in CHANNELS}, "routing": {c: [] for c in CHANNELS}}
           for p in PRECISIONS}
    datums = []
    for r in reps:
        data = grads.old(to_data(batches[r]))
        datums.append(len(data))
        if not data:
            continue
        pairs = [(d.prompt_token_ids_P, d.response_token_ids_T) for d in data]
        masks = [d.action_mask_T for d in data]
        reference[r] = grads(data, corrected=True)
        reference_no_is[r] = grads(data, corrected=False)
        fp32_tf = teacher_forced(model, "fp32", data, args.temperature)
        fp32_experts = [x.routed_experts_TLK for x in fp32_tf]
        # Control: replaying the experts fp32 itself chooses must leave the step where it was.
        own = [learner.replay_input(e, m) for e, m in zip(fp32_experts, masks)]
        own_replay.append(pair(grads(grads.old(data, own), corrected=True), reference[r]))
        for p in PRECISIONS:
            tf = teacher_forced(model, p, data, args.temperature)
            behaviour = [x.logprobs_T for x in tf]
            replay = [learner.replay_input(x.routed_experts_TLK, m) for x, m in zip(tf, masks)]
            replayed = grads.old(data, replay)
            rescored = learner.score(pairs, args.temperature, replayed_experts=replay)
            row = per[p]
            off = grads(data, behaviour=behaviour, corrected=True)
            on = grads(replayed, behaviour=behaviour, corrected=True)
            row["gradient"]["off"][r], row["gradient"]["on"][r] = off, on
            row["on_vs_off"].append(pair(on, off))
            row["routing_alone"].append(pair(grads(replayed, behaviour=behaviour, corrected=False), reference_no_is[r]))
            row["mismatch"]["off"].append(mismatch(data, behaviour))
            row["mismatch"]["on"].append(mismatch(replayed, behaviour))
            experts = [x.routed_experts_TLK for x in tf]
            row["routing"]["off"].append(routing_changes(fp32_experts, experts, masks))
            row["routing"]["on"].append(routing_changes([x.routed_experts_TLK for x in rescored], experts, masks))
        own_replay_routing.append(routing_changes(fp32_experts, [x.routed_experts_TLK for x in learner.score(
            pairs, args.temperature, replayed_experts=own)], masks))
        print(f"replicate {r}: {len(data)} datums, {time.monotonic() - started:.0f}s", flush=True)

    done = sorted(reference)
    later = [(r, s) for r in done for s in done if r < s]
    report: dict = {
        "question": "what does router replay (R3) do to the off-policy figures and to the training step on one "
                    "batch, per rollout precision?",
        "declared": {"margin_relative_l2": MARGIN_RELATIVE_L2, "margin_cosine": MARGIN_COSINE, "alpha": ALPHA},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {"platform": platform.platform(), "cpus": __import__("os").cpu_count(),
                    "torch": torch.__version__, "threads": args.threads},
        "code": code_version(), "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
        "tasks": [t.task_id for t in tasks], "datums": datums,
        "control_own_replay": {"per_replicate": own_replay, "routing": own_replay_routing},
        "floor": {"fp32, no replay": [pair(reference[s], reference[r]) for r, s in later],
                  **{f"{p}, replay": [pair(per[p]["gradient"]["on"][s], per[p]["gradient"]["on"][r])
                                      for r, s in later] for p in PRECISIONS}},
        "precisions": {},
    }
    for p in PRECISIONS:
        row = per[p]
        vs_fp32 = {c: [pair(row["gradient"][c][r], reference[r]) for r in done] for c in CHANNELS}
        rel = {c: [x["relative_l2"] for x in vs_fp32[c]] for c in CHANNELS}
        cos = {c: [x["cosine"] for x in vs_fp32[c]] for c in CHANNELS}
        report["precisions"][p] = {
            "vs_fp32": vs_fp32, "on_vs_off": row["on_vs_off"], "routing_alone": row["routing_alone"],
            "mismatch": row["mismatch"], "routing": row["routing"],
            "tests": {c: {"tost_relative_l2": equivalence(rel[c], MARGIN_RELATIVE_L2),
                          "tost_one_minus_cosine": equivalence([1 - x for x in cos[c]], 1 - MARGIN_COSINE)}
                      for c in CHANNELS},
            "replay_minus_none_relative_l2": paired(rel["on"], rel["off"]),
            "summary": {c: {"relative_l2": summary(rel[c]), "cosine": summary(cos[c]),
                            "token_ess": summary([m["token_ess"] for m in row["mismatch"][c]]),
                            "rollout_is_ess": summary([m["rollout_is_ess"] for m in row["mismatch"][c]]),
                            "mean_abs_delta": summary([m["mean_abs_delta"] for m in row["mismatch"][c]]),
                            "router_flip_rate": summary([x["top1"] for x in row["routing"][c]]),
                            "topk_set_change_rate": summary([x["topk_set"] for x in row["routing"][c]])}
                      for c in CHANNELS},
        }
    report["wall_s"] = time.monotonic() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=float) + "\n")
    print(json.dumps({p: report["precisions"][p]["summary"] for p in PRECISIONS}, indent=1, default=float))
    print(f"wrote {args.out} in {report['wall_s'] / 60:.1f} min")


if __name__ == "__main__":
    main()
