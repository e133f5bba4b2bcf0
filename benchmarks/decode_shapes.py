"""A decode step on shapes the process has seen against shapes it has not.

`serve_sustained.py` found serve-model's eager decode step (tiny-moe, no CUDA graphs) at 20–25 ms
under a closed loop of HTTP streams, against 10–13 ms for the same requests on the engine alone or
on the server's `Batcher` driven in-process. Those two replay, in their measured runs, exactly the
batch compositions of their warm-up run (the same lengths, the same join rule, no timing in it),
so every eager step's shape (batch B, attended columns L) has been seen before. Over HTTP, when a
row finishes and its stream's next request joins depends on timing, so many steps meet a (B, L)
the process has not run yet. And decode_profile.py's first pass (every step a new shape) was 5–8×
its second (the same shapes again).

This runs the engine's closed loop (as serve_sustained.py's ``engine`` path) several times in one
process: ``first`` (lengths drawn with seed 1), ``seen`` (the same lengths again: every shape
seen), then ``new`` runs with lengths drawn with other seeds (mostly new shapes). Each condition
runs in a fresh process:

- ``exact``: the eager slot step at its exact (B, L), as serve-model runs MoE models;
- ``buckets``: (B, L) rounded up to powers of two as the CUDA graphs do, so shapes repeat;
- ``cudnn`` / ``math``: exact shapes with the attention kernel pinned.

With ``--profile`` the first ``new`` run's first steps run under ``torch.profiler``: the operators
with the most host time name the cost a new shape pays.

    python benchmarks/decode_shapes.py --device cuda                      # tiny-moe
    python benchmarks/decode_shapes.py --device cuda --model models/tiny-dense
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from _result import write_result

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))
from serve_sustained import add_inprocess_arguments, closed_loop, lengths  # noqa: E402
from serve_throughput import MESSAGES, _device_name  # noqa: E402

console = Console(width=max(Console().width, 120))
progress = Console(stderr=True)
CONDITIONS = ("exact", "buckets", "cudnn", "math")


def timed_loop(engine, prompt: list[int], sizes: list[int], concurrency: int, sync, seen: set,
               profiles: dict | None = None) -> dict:
    """serve_sustained.py's engine loop (the HTTP streams' workload), each step timed apart by
    whether its shape is new to this process. ``seen``: the step shapes this process has run
    (updated); ``profiles``: a cProfile each for steps on a new shape and on a seen one."""
    from rollmarket.engines.slots import MIN_WIDTH, SlotKV, bucket

    shapes: set = set()
    seconds = {True: 0.0, False: 0.0}  # inside step(), on a new shape / a seen one
    counts = {True: 0, False: 0}

    def step(session):
        kv = session.kv
        new = False
        if isinstance(kv, SlotKV):  # the step's (B, L), as SlotKV.decode picks it
            B, L = len(kv.owner), max(r.cached for r in session.rows) + 1
            shape = (bucket(B), bucket(L, MIN_WIDTH)) if kv.buckets else (B, L)
            shapes.add(shape)
            new = shape not in seen
            seen.add(shape)
        profile = profiles[new] if profiles is not None else None
        if profile is not None:
            profile.enable()
        before = time.perf_counter()
        events = session.step()
        seconds[new] += time.perf_counter() - before
        if profile is not None:
            profile.disable()
        counts[new] += 1
        return events

    sync()
    started = time.perf_counter()
    tokens, steps, _ = closed_loop(engine, prompt, sizes, concurrency, step)
    sync()
    return {"wall_s": time.perf_counter() - started, "tokens": tokens, "steps": steps,
            "step_ms": 1000 * sum(seconds.values()) / steps, "shapes": len(shapes),
            "new_shape_steps": counts[True],
            "new_shape_step_ms": 1000 * seconds[True] / counts[True] if counts[True] else None,
            "seen_shape_step_ms": 1000 * seconds[False] / counts[False] if counts[False] else None}


def _top(profile, steps: int, limit: int) -> list[dict]:
    """The functions with the most own time, per step."""
    import pstats

    stats = pstats.Stats(profile)
    rows = sorted(((v[2], v[3], v[1], f"{Path(f).name}:{line} {name}") for (f, line, name), v in stats.stats.items()),
                  reverse=True)[:limit]
    return [{"function": fn, "own_ms_per_step": 1000 * own / steps, "cum_ms_per_step": 1000 * cum / steps,
             "calls_per_step": calls / steps} for own, cum, calls, fn in rows]


def one(args) -> list[dict]:
    """One condition, in this (fresh) process."""
    import cProfile
    import gc

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from rollmarket.engines import RolloutEngine

    engine = RolloutEngine.from_path(args.model, args.precision, args.device, graphs=False,
                                     step_buckets=args.one == "buckets")
    prompt = engine.encode_chat(MESSAGES)
    gc.collect()
    gc.freeze()  # as serve-model does

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    pinned = {"cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}.get(args.one)
    rows = []
    seen: set = set()
    # Each new seed's lengths, then the same lengths again: the second run's steps are all on seen shapes.
    plan = [("first", 1), ("seen", 1)]
    for i in range(args.new_runs):
        plan += [("new", 2 + i), ("seen", 2 + i)]
    with sdpa_kernel([pinned]) if pinned else contextlib.nullcontext():
        for index, (label, seed) in enumerate(plan):
            profiles = {True: cProfile.Profile(), False: cProfile.Profile()} if args.profile and index == 2 else None
            row = timed_loop(engine, prompt, lengths(args.requests, args.max_tokens, seed), args.concurrency,
                              sync, seen, profiles)
            if profiles:
                row["profile_new"] = _top(profiles[True], max(row["new_shape_steps"], 1), args.profile_lines)
                row["profile_seen"] = _top(profiles[False], max(row["steps"] - row["new_shape_steps"], 1),
                                           args.profile_lines)
            rows.append({"condition": args.one, "run": label, "lengths_seed": seed, **row})
            progress.print(f"{args.one:8} {label:6} step {row['step_ms']:6.2f} ms over {row['steps']} steps, "
                           f"{row['shapes']} shapes, {row['new_shape_steps']} steps on a new one")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_inprocess_arguments(parser)
    parser.add_argument("--new-runs", type=int, default=2, help="Runs with lengths of new seeds.")
    parser.add_argument("--conditions", default=",".join(CONDITIONS))
    parser.add_argument("--profile", action="store_true",
                        help="cProfile the first new run's steps: those on a new shape and those on a seen one apart.")
    parser.add_argument("--profile-lines", type=int, default=12)
    parser.add_argument("--one", choices=CONDITIONS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args)))
        return
    args.out = args.out or REPO / "benchmarks" / "results" / (
        "decode_shapes-cuda.json" if args.device.startswith("cuda") else "decode_shapes.json")
    rows = []
    for condition in args.conditions.split(","):
        cmd = [sys.executable, __file__, "--one", condition, *sys.argv[1:]]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            console.print(f"[red]{condition} failed[/]:\n{done.stderr[-3000:]}")
            rows.append({"condition": condition, "error": done.stderr.strip().splitlines()[-1:]})
            continue
        sys.stderr.write(done.stderr[-2000:])
        rows.extend(json.loads(done.stdout.strip().splitlines()[-1]))
    table = Table(title=f"{args.model.name}: eager decode steps, seen and new shapes, {args.concurrency} streams, "
                        f"{args.requests} requests, {args.precision} on {args.device}")
    for column in ("condition", "run", "lengths seed", "steps", "shapes", "steps on a new shape", "step ms",
                   "ms on a new shape", "ms on a seen shape"):
        table.add_column(column, justify="right")

    def ms(value) -> str:
        return "" if value is None else f"{value:.2f}"

    for r in rows:
        if "error" in r:
            table.add_row(r["condition"], "failed", *[""] * 7)
            continue
        table.add_row(r["condition"], r["run"], str(r["lengths_seed"]), str(r["steps"]), str(r["shapes"]),
                      str(r["new_shape_steps"]), ms(r["step_ms"]), ms(r["new_shape_step_ms"]),
                      ms(r["seen_shape_step_ms"]))
    console.print(table)
    for r in rows:
        for kind in ("new", "seen"):
            for p in r.get(f"profile_{kind}") or []:
                console.print(f"  {r['condition']} {kind:4} shape: {p['function'][:70]:70} {p['calls_per_step']:6.1f} "
                              f"calls, own {p['own_ms_per_step']:6.2f} ms, cum {p['cum_ms_per_step']:6.2f} ms a step")
    import torch

    write_result(args.out, "decode_shapes", args, rows,
                 {"gpu": _device_name(args.device), "torch": f"torch {torch.__version__}"})
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
