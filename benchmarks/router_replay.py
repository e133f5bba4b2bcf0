"""Router replay (R3) on the tiny MoE: what it does to the rollout/trainer mismatch, and its cost.

For each rollout precision a rollout engine at that precision samples responses; the fp32 trainer
engine teacher-forces them twice, routing itself (baseline) and replaying the rollout's experts.
Reported per precision, over every response token:

    flips        share of (token, MoE layer) whose top-1 expert differs from the rollout's
    set flips    share whose top-k set differs (a second-expert flip counts here, not above)
    |Δlogp|      mean and max |trainer − rollout| logprob
    time         best-of-repeats teacher-forcing time of the whole batch (the two in turn);
                 ratio replay / baseline

    python benchmarks/router_replay.py                       # fp16, bf16, fp8; 8 prompts × 64 tokens
    python benchmarks/router_replay.py --tokens 128 --repeats 40
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from _result import write_result
from rollmarket.engines import RolloutEngine, SamplingParams, TrainerEngine, load_model
from rollmarket.gate.budget import router_flip_rate

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ("What is 17 * 23?", "hello", "Read the file notes/readme.txt and tell me the port.",
           "Who founded the town of Velmora? Search for it.", "List three prime numbers above 50.",
           "Summarise the plot of a short story about a lighthouse.", "Convert 3.5 km to miles.",
           "Write a haiku about rain.")
console = Console(width=max(Console().width, 120))


def best_times(fns, repeats: int) -> list[float]:
    """Best-of-`repeats` seconds of each function, run in turn so that load on the shared box
    falls on all of them alike."""
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def set_flip_rate(a_list, b_list) -> float:
    """Share of (token, layer) whose top-k expert sets differ."""
    differ = [(np.sort(a, -1) != np.sort(b, -1)).any(-1) for a, b in zip(a_list, b_list)]
    return float(np.concatenate([d.ravel() for d in differ]).mean())


def measure(trainer: TrainerEngine, precision: str, args) -> dict:
    rollout = RolloutEngine(load_model(args.model, precision))
    prompts = [rollout.encode_chat([{"role": "user", "content": t}]) for t in PROMPTS[:args.prompts]]
    gens = rollout.generate(prompts, SamplingParams(max_tokens=args.tokens, seed=args.seed, ignore_eos=True))
    pairs = [(np.asarray(p), g.token_ids_T) for p, g in zip(prompts, gens)]
    experts = [g.routed_experts_TLK for g in gens]
    plain = trainer.score_batch(pairs)
    replayed = trainer.score_batch(pairs, replayed_experts=experts)
    behaviour = np.concatenate([g.logprobs_T for g in gens])
    gap = {name: np.abs(np.concatenate([s.logprobs_T for s in scored]) - behaviour)
           for name, scored in (("plain", plain), ("replay", replayed))}
    valid = [np.ones(len(g.token_ids_T), bool) for g in gens]
    seconds_plain, seconds_replay = best_times(
        [lambda: trainer.score_batch(pairs), lambda: trainer.score_batch(pairs, replayed_experts=experts)],
        args.repeats)
    return {
        "precision": precision, "tokens": int(behaviour.size),
        "flips_plain": router_flip_rate(experts, [s.routed_experts_TLK for s in plain], valid),
        "flips_replay": router_flip_rate(experts, [s.routed_experts_TLK for s in replayed], valid),
        "set_flips_plain": set_flip_rate(experts, [s.routed_experts_TLK for s in plain]),
        "set_flips_replay": set_flip_rate(experts, [s.routed_experts_TLK for s in replayed]),
        "mean_abs_delta_plain": float(gap["plain"].mean()), "mean_abs_delta_replay": float(gap["replay"].mean()),
        "max_abs_delta_plain": float(gap["plain"].max()), "max_abs_delta_replay": float(gap["replay"].max()),
        "seconds_plain": seconds_plain, "seconds_replay": seconds_replay,
        "time_ratio": seconds_replay / seconds_plain,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=REPO / "models" / "tiny-moe")
    parser.add_argument("--precisions", default="fp16,bf16,fp8")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "router_replay.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    trainer = TrainerEngine(load_model(args.model, "fp32"))
    rows = []
    for precision in args.precisions.split(","):
        console.log(f"{precision} rollout …")
        rows.append(measure(trainer, precision, args))
    table = Table(title=f"Router replay: {args.model.name}, fp32 trainer, baseline = the trainer routing itself")
    for name in ("rollout", "tokens", "top-1 flips", "set flips", "mean |Δlogp|", "max |Δlogp|",
                 "time (ms)", "replay / baseline time"):
        table.add_column(name, justify="left" if name == "rollout" else "right")
    for r in rows:
        table.add_row(r["precision"], f"{r['tokens']:,}",
                      f"{r['flips_plain']:.2%} → {r['flips_replay']:.2%}",
                      f"{r['set_flips_plain']:.2%} → {r['set_flips_replay']:.2%}",
                      f"{r['mean_abs_delta_plain']:.4f} → {r['mean_abs_delta_replay']:.4f}",
                      f"{r['max_abs_delta_plain']:.3f} → {r['max_abs_delta_replay']:.3f}",
                      f"{r['seconds_plain'] * 1e3:.1f} → {r['seconds_replay'] * 1e3:.1f}",
                      f"{r['time_ratio']:.2f}×")
    console.print(table)
    write_result(args.out, "router_replay", args, rows)
    console.log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
