"""How fast the rollouts table answers over a big generations.jsonl, against re-reading the file.

Writes a synthetic training run of `--rows` generations (groups of 4 sharing a prompt with the
real system prompt's length, responses of a few hundred characters, 8 workers, 3 decisions) and
times the dashboard's real app in-process (fastapi TestClient: routing, the index, rendering),
the median of `--rounds` requests per case:

    cold open           the first request of a fresh process: the line offsets are read from the file
                        (the columns are then parsed in a background thread, waited for untimed)
    first filter        a filtered request as the first of a fresh process: it parses every row's columns
    first page          /train/<id>/rollouts (HTML), index warm
    last page           ?page=<last>
    filters             decision + step range + precision
    search              q= a word in 1 of ~50 responses
    sort by reward      sort=-reward
    after an append     1,000 rows appended, then the first page (the index reads only the new bytes)

The baseline is the naive server: every request re-reads and json-parses the whole file, then
filters, sorts and slices in Python (no rendering, so the ratio flatters it).

    python benchmarks/dashboard_generations.py                 # 100,000 rows, 5 rounds
    python benchmarks/dashboard_generations.py --rows 20000
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from _result import write_result
from fastapi.testclient import TestClient
from rich.console import Console
from rich.table import Table

from rollmarket.dashboard import create_dashboard_app
from rollmarket.dashboard.rollouts import _indexes

REPO = Path(__file__).resolve().parents[1]
RUN_ID = "20260101T000000Z-bench0"
SYSTEM = ("<|im_start|>system\nYou are a helpful assistant. Use a tool when you need one. Reply with the bare "
          "answer.\n\n# Tools\n\n" + "x" * 1000 + "<|im_end|>\n")
NEEDLE = "zebracorn"


def generation(i: int, rng: random.Random) -> dict:
    step, group = 1 + i // 400, i // 4
    words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "sum", "tool", "answer"]) for _ in range(45))
    return {"step": step, "group_id": f"grp_{group:08x}", "task_id": f"arithmetic-train-{group % 5000:04d}",
            "sample_index": i % 4, "policy_version": step - 1, "policy_lag": rng.choice([0, 0, 0, 1, 2]),
            "worker_id": f"worker-{group % 8}", "precision": ["bf16", "fp8", "fp16"][group % 3],
            "decision": ["train", "train", "train", "correct", "quarantine"][group % 5], "used": i % 3 != 0,
            "reward": float(rng.random() < 0.5), "trained_reward": 0.0, "advantage": rng.uniform(-1, 1),
            "tokens": rng.randint(20, 200), "clipped_tokens": rng.randint(0, 3),
            "prompt": f"{SYSTEM}<|im_start|>user\nWhat is {group} + {group % 97}?\nUse the \"calculator\", please.<|im_end|>\n",
            "response": (NEEDLE + " " if i % 50 == 7 else "") + words + ", done.\n<|im_end|>"}


def write_rows(path: Path, start: int, count: int, rng: random.Random) -> None:
    with open(path, "a", encoding="utf-8") as f:
        for i in range(start, start + count):
            f.write(json.dumps(generation(i, rng)) + "\n")


def naive(path: Path, params: dict) -> int:
    """The baseline server: parse every line on every request, then filter, sort and slice."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    for i, r in enumerate(rows):
        r["row"] = i
    if "decision" in params:
        rows = [r for r in rows if r["decision"] == params["decision"] and r["precision"] == params["precision"]
                and int(params["step_min"]) <= r["step"] <= int(params["step_max"])]
    if "q" in params:
        q = params["q"].lower()
        rows = [r for r in rows if q in r["prompt"].lower() or q in r["response"].lower() or q in r["task_id"].lower()]
    if params.get("sort") == "-reward":
        rows.sort(key=lambda r: -r["reward"])
    page = int(params.get("page", 1))
    return len(rows[(page - 1) * 25:page * 25])


def settle() -> None:
    """Wait (untimed) for the background column parse a cold open starts, so it slows no later request."""
    while any(index.warming.is_set() for index in list(_indexes.values())):
        time.sleep(0.01)


def median_s(fn, rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
        settle()
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "dashboard_generations.json")
    args = parser.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "runs" / RUN_ID
        run.mkdir(parents=True)
        path = run / "generations.jsonl"
        write_rows(path, 0, args.rows, rng)
        size_mb = path.stat().st_size / 1e6
        client = TestClient(create_dashboard_app(Path(tmp) / "runs"))
        base = f"/train/{RUN_ID}/rollouts"
        last = -(-args.rows // 25)
        steps = args.rows // 400
        cases = {
            "first page": {},
            "last page": {"page": str(last)},
            "filters": {"decision": "correct", "precision": "fp8", "step_min": str(steps // 4),
                        "step_max": str(steps // 2)},
            "search": {"q": NEEDLE},
            "sort by reward": {"sort": "-reward"},
        }

        def get(params: dict) -> None:
            response = client.get(base, params=params)
            assert response.status_code == 200, response.text[:500]

        def cold() -> None:
            _indexes.clear()
            get({})

        def cold_filter() -> None:
            _indexes.clear()
            get(cases["filters"])

        get({})  # templates compiled, routes warm: what a served dashboard has after its first page
        rows = [{"case": "cold open", "ours_s": median_s(cold, args.rounds), "naive_s": None},
                {"case": "first filter", "ours_s": median_s(cold_filter, args.rounds), "naive_s": None}]
        for name, params in cases.items():
            ours = median_s(lambda: get(params), args.rounds)
            base_s = median_s(lambda: naive(path, params), args.rounds)
            rows.append({"case": name, "ours_s": ours, "naive_s": base_s})
        appended = [args.rows]

        def append_then_open() -> None:
            write_rows(path, appended[0], 1000, rng)
            appended[0] += 1000
            get({})

        rows.append({"case": "after a 1,000-row append", "ours_s": median_s(append_then_open, args.rounds),
                     "naive_s": None})
        for r in rows:
            r["ratio"] = r["naive_s"] / r["ours_s"] if r["naive_s"] else None
            r["rows"] = args.rows
            r["file_mb"] = round(size_mb, 1)
    table = Table(title=f"rollouts table over {args.rows:,} generations ({size_mb:.0f} MB), median of {args.rounds}")
    for col in ("case", "dashboard (s)", "naive (s)", "naive / dashboard"):
        table.add_column(col, justify="left" if col == "case" else "right")
    for r in rows:
        table.add_row(r["case"], f"{r['ours_s']:.3f}", f"{r['naive_s']:.2f}" if r["naive_s"] else "–",
                      f"{r['ratio']:.0f}×" if r["ratio"] else "–")
    Console().print(table)
    write_result(args.out, "dashboard_generations", args, rows)


if __name__ == "__main__":
    main()
