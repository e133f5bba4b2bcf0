"""Cost per call of python_eval's isolation and of read_file's confined open.

python_eval: the median wall time of `PythonEval.__call__` on `print(1)` in each isolation mode,
with an empty task directory and with the world's 140 files, against a bare
`subprocess.run([python, "-I", "-S", "-c", "print(1)"])` (the baseline: a fresh interpreter and
nothing else). `unsafe-audit-hook-only` is what python_eval was before the bubblewrap sandbox.
read_file: the median of `ReadFile.__call__` on one world file with openat2, with the
component walk (the fallback where the kernel lacks openat2), and with the path checks it had
before (resolve the path, check it is below the directory, then open it by name).

All modes run interleaved, round after round, so that a loaded machine slows them alike.

    python benchmarks/python_eval_cost.py                 # 40 rounds
    python benchmarks/python_eval_cost.py --rounds 100
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _result import write_result
from rich.console import Console
from rich.table import Table

from rollmarket.agents import workspace
from rollmarket.agents.tools import python_eval
from rollmarket.agents.tools.python_eval import PythonEval, SandboxLimits
from rollmarket.agents.tools.read_file import ReadFile
from rollmarket.agents.workspace import task_workspace
from rollmarket.tasks.world import load_world

REPO = Path(__file__).resolve().parents[1]
console = Console(width=max(Console().width, 120))


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


def _old_read_file(workdir: Path, path: str) -> str:
    """read_file as it was: string checks on the resolved path, then an open by name."""
    root = workdir.resolve()
    real = (root / path).resolve()
    if not real.is_relative_to(root) or not real.is_file():
        raise ValueError(path)
    return real.read_bytes().decode("utf-8", "replace").rstrip("\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "python_eval_cost.json")
    args = parser.parse_args()
    files = load_world().files
    tools = {
        "bubblewrap (default)": PythonEval(SandboxLimits(timeout_s=30)),
        "bubblewrap, no audit hook": PythonEval(SandboxLimits(timeout_s=30, audit_hook=False)),
        "unsafe-audit-hook-only (before)": PythonEval(SandboxLimits(timeout_s=30, isolation="unsafe-audit-hook-only")),
    }
    python_eval.sandbox_setup()  # the once-per-process probe is not a call's cost
    python_eval.namespace_prefix()
    samples: dict[tuple[str, str], list[float]] = {}
    bare = [sys.executable, "-I", "-S", "-c", "print(1)"]
    with task_workspace({}) as empty, task_workspace(files) as world:
        for tool in tools.values():
            for context in (empty, world):
                assert tool({"code": "print(1)"}, context).content == "1"
        for _ in range(args.rounds):
            key = ("baseline: bare subprocess", "empty")
            started = time.perf_counter()
            subprocess.run(bare, capture_output=True, check=True)
            samples.setdefault(key, []).append(time.perf_counter() - started)
            for name, tool in tools.items():
                for label, context in (("empty", empty), ("world", world)):
                    result = tool({"code": "print(1)"}, context)
                    assert result.content == "1", result.content
                    samples.setdefault((name, label), []).append(result.elapsed_s)
        path = next(iter(files))
        reader = ReadFile()
        reads: dict[str, list[float]] = {"openat2": [], "component walk": [], "path checks (before)": []}
        def timed(read) -> float:
            started = time.perf_counter()
            read()
            return time.perf_counter() - started

        openat2 = workspace._openat2_call
        for _ in range(args.rounds * 50):
            reads["openat2"].append(timed(lambda: reader.run({"path": path}, world)))
            reads["path checks (before)"].append(timed(lambda: _old_read_file(world.workdir, path)))
            workspace._openat2_call = lambda: None
            reads["component walk"].append(timed(lambda: reader.run({"path": path}, world)))
            workspace._openat2_call = openat2

    base_key = ("baseline: bare subprocess", "empty")
    base = _median_ms(samples[base_key])
    table = Table(title=f"python_eval, median wall time of {args.rounds} calls of print(1)")
    for column in ("isolation", "task dir", "ms", "× baseline"):
        table.add_column(column, justify="right")
    rows = []
    for name in ["baseline: bare subprocess", *tools]:
        for label in ("empty", "world"):
            if (name, label) not in samples:
                continue
            wall_ms = _median_ms(samples[(name, label)])
            rows.append({"isolation": name, "task_dir": label, "ms": wall_ms})
            table.add_row(name, "empty" if label == "empty" else f"{len(files)} files", f"{wall_ms:.1f}",
                          f"{wall_ms / base:.2f}×")
    console.print(table)
    read_base = _median_ms(reads["path checks (before)"]) * 1000
    reads_table = Table(title=f"read_file, median of {args.rounds * 50} reads of {path}")
    for column in ("open", "µs per call", "× before"):
        reads_table.add_column(column, justify="right")
    for name, values in reads.items():
        micros = _median_ms(values) * 1000
        rows.append({"read_file": name, "us": micros})
        reads_table.add_row(name, f"{micros:.0f}", f"{micros / read_base:.2f}×")
    console.print(reads_table)
    console.print("baselines: a bare interpreter start (python_eval); read_file's earlier path checks (read_file; "
                  "ReadFile.run and the old checks alike, without the tool boundary's schema validation).")
    write_result(args.out, "python_eval_cost", args, rows)
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
