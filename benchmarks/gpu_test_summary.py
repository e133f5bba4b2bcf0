"""The GPU tests' result as a raw result docs/render.py can quote ("GPU tests" in docs/benchmarks.md).

    python benchmarks/gpu_test_summary.py JUNIT.xml [--out benchmarks/results/gpu_tests-cuda.json]

Reads the junit XML pytest wrote for tests/test_gpu_kernels.py (benchmarks/gpu_run.sh runs both on
the device) and writes one row per test case (its id, outcome, seconds and, unless it passed, the
first line of its message) with the machine it ran on: the GPU's name and the torch and Triton
versions, taken here, on that machine. Exits 1 when the XML is missing or unreadable.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from _result import write_result

REPO = Path(__file__).resolve().parents[1]


def rows_from_junit(path: Path) -> list[dict]:
    """One row per <testcase>: test id, outcome (passed, failed, error, skipped), seconds, message."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = "failed" if tag == "failure" else tag
                text = (found.get("message") or found.text or "").strip()
                message = text.splitlines()[0][:300] if text else ""
                break
        rows.append({"test": case.get("name"), "outcome": outcome,
                     "seconds": round(float(case.get("time") or 0.0), 3), "message": message})
    return rows


def this_machine() -> dict:
    """The GPU and library versions (none where torch or Triton is missing)."""
    found: dict = {}
    try:
        import torch
    except ImportError:
        return found
    found["torch"] = f"torch {torch.__version__}"
    try:
        import triton
        found["torch"] += f", triton {triton.__version__}"
    except ImportError:
        pass
    if torch.cuda.is_available():
        found["gpu"] = torch.cuda.get_device_name()
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", type=Path, help="The junit XML pytest wrote (--junitxml).")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gpu_tests-cuda.json")
    args = parser.parse_args()
    try:
        rows = rows_from_junit(args.junit)
    except (OSError, ET.ParseError) as exc:
        print(f"no test result to summarize: {exc}", file=sys.stderr)
        return 1
    write_result(args.out, "gpu_tests", args, rows, machine=this_machine())
    counts = {o: sum(r["outcome"] == o for r in rows) for o in ("passed", "failed", "error", "skipped")}
    print(", ".join(f"{n} {o}" for o, n in counts.items()), f"→ {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
