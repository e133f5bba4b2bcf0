"""Dense mismatch statistics: tokens/s of `observatory.dense_summary` on one CPU core.

Input: float32 rollout and trainer logprobs (what engines return), cut into sequences of 1,024
tokens so the sequence ESS is computed too. Logprobs are −Exponential(1); Δ is Normal(0, 0.02)
with one token in 100,000 pushed to |Δ| = 25 (clipped) or 35 (vetoed), so the clipped path runs.

    dense_summary   the library: cache-sized chunks, reused buffers, float32 element-wise with
                    float64 sums, one partition for the top 1%
    naive           a straightforward port of the formulas (DESIGN.md, 'Formulas'): float64
                    copies, each statistic on its own temporaries, a full sort for the top 1%,
                    bincount for the sequence sums

Both compute every statistic; the largest relative difference between their answers is printed
as a check. The script pins itself to one core and one BLAS/OpenMP thread (re-executing itself
with OMP_NUM_THREADS=1 and friends when they are not set). Time is the best of --repeats runs.

    python benchmarks/dense_summary.py                          # 1M, 10M and 50M tokens
    python benchmarks/dense_summary.py --sizes 1e6,2e7 --repeats 5
"""

from __future__ import annotations

import os
import sys

_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
if any(os.environ.get(name) != "1" for name in _THREAD_VARS):  # before numpy loads BLAS
    os.environ.update({name: "1" for name in _THREAD_VARS})
    os.execv(sys.executable, [sys.executable, *sys.argv])

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from datetime import datetime, timezone  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from rollmarket.observatory import dense_summary  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SEQUENCE = 1024
console = Console(width=max(Console().width, 120))


def naive_summary(rollout, trainer, lengths, clamp=20.0, veto=30.0) -> dict[str, float]:
    """The formulas as a first port writes them: correct, vectorized, and wasteful."""
    rollout = rollout.astype(np.float64)
    trainer = trainer.astype(np.float64)
    delta = trainer - rollout
    n = delta.size
    w = np.exp(np.clip(delta, -clamp, clamp))
    sequence_ids = np.repeat(np.arange(lengths.size), lengths)
    big_w = np.exp(np.clip(np.bincount(sequence_ids, weights=delta, minlength=lengths.size), -clamp, clamp))
    k = math.ceil(n / 100)
    r = np.exp(np.clip(delta, -clamp, clamp))
    return {
        "token_ess": float(w.sum() ** 2 / (n * (w**2).sum())),
        "sequence_ess": float(big_w.sum() ** 2 / (big_w.size * (big_w**2).sum())),
        "mean_delta": float(delta.mean()),
        "mean_abs_delta": float(np.abs(delta).mean()),
        "max_abs_delta": float(np.abs(delta).max()),
        "clipped_fraction": float((np.abs(delta) > clamp).mean()),
        "veto_fraction": float((np.abs(delta) > veto).mean()),
        "second_moment": float((w**2).mean()),
        "top1pct_gradient_mass": float(np.sort(w)[::-1][:k].sum() / w.sum()),
        "kl_k1": float((rollout - trainer).mean()),
        "kl_k3": float((r - np.log(r) - 1).mean()),
        "chi2": float((r**2).mean() - 1),
        "log_ppl_rollout": float(-rollout.mean()),
        "log_ppl_trainer": float(-trainer.mean()),
        "log_ppl_diff": float(-trainer.mean() + rollout.mean()),
        "mean_prob_diff": float(np.abs(np.exp(rollout) - np.exp(trainer)).mean()),
    }


def make_inputs(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    rollout = -rng.exponential(1.0, n).astype(np.float32)
    delta = rng.normal(0.0, 0.02, n).astype(np.float32)
    outliers = rng.choice(n, size=max(2, n // 100_000), replace=False)
    delta[outliers] = np.where(np.arange(outliers.size) % 2 == 0, -25.0, -35.0)
    trainer = rollout + delta
    lengths = np.full(n // SEQUENCE, SEQUENCE, dtype=np.int64)
    if n % SEQUENCE:
        lengths = np.append(lengths, n % SEQUENCE)
    return rollout, trainer, lengths


def best_time(fn, repeats: int) -> tuple[float, object]:
    best, result = math.inf, None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def max_relative_difference(ours, naive: dict[str, float]) -> float:
    worst = 0.0
    for name, value in naive.items():
        mine = getattr(ours, name)
        worst = max(worst, abs(mine - value) / max(abs(value), 1e-12))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1e6,1e7,5e7", help="token counts, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "dense_summary.json")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    sizes = [int(float(s)) for s in args.sizes.split(",")]

    rows = []
    for n in sizes:
        rollout, trainer, lengths = make_inputs(n)
        dense_summary(rollout[:SEQUENCE], trainer[:SEQUENCE])  # warm-up
        ours_s, ours = best_time(partial(dense_summary, rollout, trainer, lengths=lengths), args.repeats)
        naive_s, naive = best_time(partial(naive_summary, rollout, trainer, lengths), args.repeats)
        rows.append({
            "tokens": n, "sequences": int(lengths.size),
            "seconds": ours_s, "tokens_per_s": n / ours_s,
            "naive_seconds": naive_s, "naive_tokens_per_s": n / naive_s,
            "speedup": naive_s / ours_s,
            "max_relative_difference": max_relative_difference(ours, naive),
        })
        console.log(f"{n:,} tokens: {n / ours_s / 1e6:.1f}M tok/s vs naive {n / naive_s / 1e6:.1f}M tok/s")
        del rollout, trainer

    table = Table(title="dense_summary on one core (float32 logprobs, sequences of 1,024 tokens)")
    for column in ("tokens", "dense_summary tok/s", "naive tok/s", "speed vs naive", "max rel. diff"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(f"{row['tokens']:,}", f"{row['tokens_per_s'] / 1e6:.1f}M",
                      f"{row['naive_tokens_per_s'] / 1e6:.1f}M", f"{row['speedup']:.1f}×",
                      f"{row['max_relative_difference']:.1e}")
    console.print(table)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "dense_summary",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "numpy": np.__version__, "threads": 1},
        "args": {"sizes": sizes, "repeats": args.repeats, "sequence_tokens": SEQUENCE},
        "rows": rows,
    }, indent=2) + "\n")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
