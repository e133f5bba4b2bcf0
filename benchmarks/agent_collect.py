"""Agent rollout throughput: runs/s and tokens/s of `rollmarket collect`'s loop, one run at a time
versus many in flight.

A real `rollmarket serve-model` process serves the tiny MoE on loopback; the agent loop runs the
arithmetic suite's held-out tasks (a calculator call, then the answer: two model turns and one
tool call per run) with in-process tools and verifiers. The baseline runs one agent at a time
(concurrency 1), as a naive evaluation script would; the others keep N runs in flight so that the
server's batcher decodes their turns together. Tokens are response tokens the engine sampled.

    python benchmarks/agent_collect.py                      # CPU, concurrency 1, 8 and 32
    python benchmarks/agent_collect.py --concurrency 1,16 --tasks 32 --repeats 4
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.table import Table

from rollmarket.agents import Agent, AgentSettings, ChatModel, LocalToolbox, Sampling
from rollmarket.agents.collect import collect
from rollmarket.localhost import free_port, wait_healthy
from rollmarket.tasks.suites import load_suite
from rollmarket.verifiers import verify_trajectory

REPO = Path(__file__).resolve().parents[1]
console = Console(width=max(Console().width, 120))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=REPO / "models" / "tiny-moe")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server (CPU).")
    parser.add_argument("--suite", default="arithmetic")
    parser.add_argument("--tasks", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "agent_collect.json")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    tasks = load_suite(args.suite, "heldout")[: args.tasks]
    port = free_port()
    work = Path(tempfile.mkdtemp(prefix="agent-bench-"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.Popen([sys.executable, "-m", "rollmarket", "serve-model", str(args.model), "--precision",
                             args.precision, "--device", args.device, "--port", str(port),
                             "--max-batch-seqs", str(max(levels) * 2)],
                            stdout=(work / "serve.log").open("ab"), stderr=subprocess.STDOUT, env=env)
    rows = []
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, log=work / "serve.log", timeout=300)
        model = ChatModel(f"http://127.0.0.1:{port}/v1")
        agent = Agent(model, LocalToolbox(), AgentSettings(max_steps=4), verify=verify_trajectory)
        sampling = Sampling(temperature=1.0, max_tokens=64, seed=0)
        warm = work / "warm.jsonl"
        collect(agent, tasks[:2], repeats=1, out=warm, failures=work / "warm.failures.jsonl", sampling=sampling)
        for level in levels:
            out = work / f"c{level}.jsonl"
            started = time.perf_counter()
            stats = collect(agent, tasks, repeats=args.repeats, out=out, failures=work / f"c{level}.failures.jsonl",
                            sampling=sampling, concurrency=level)
            seconds = time.perf_counter() - started
            runs = [json.loads(line) for line in out.read_text().splitlines()]
            tokens = sum(len(s["response_token_ids"]) for r in runs for s in r["steps"])
            turns = sum(len(r["steps"]) for r in runs)
            rows.append({"concurrency": level, "runs": stats.done, "failed": stats.failed, "turns": turns,
                         "tokens": tokens, "seconds": round(seconds, 3), "runs_per_s": stats.done / seconds,
                         "tokens_per_s": tokens / seconds, "pass_rate": stats.pass_rate})
    finally:
        proc.terminate()
        proc.wait(30)
    base = rows[0]
    table = Table(title=f"agent collection, {args.model.name} at {args.precision} on {args.device}, "
                        f"{args.tasks} {args.suite} tasks × {args.repeats}")
    for column in ("concurrency", "runs", "turns", "tokens", "seconds", "runs/s", "tokens/s", "× baseline",
                   "pass rate"):
        table.add_column(column, justify="right")
    for row in rows:
        row["speedup"] = row["runs_per_s"] / base["runs_per_s"]
        table.add_row(str(row["concurrency"]), str(row["runs"]), str(row["turns"]), str(row["tokens"]),
                      f"{row['seconds']:.1f}", f"{row['runs_per_s']:.2f}", f"{row['tokens_per_s']:.0f}",
                      f"{row['speedup']:.2f}×", f"{row['pass_rate']:.2f}")
    console.print(table)
    console.print("baseline: concurrency 1 (one agent run at a time)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "agent_collect", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2) + "\n")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
