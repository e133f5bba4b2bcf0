"""How fast the CLI answers a new user: `rollmarket --help`, a taken port, and a model-free service.

Each case runs as a fresh process, the median of `--rounds` runs, interleaved round by round:

    baseline: import torch   `python -c "import torch"`: what every command paid while the CLI
                             imported its subcommands (and so torch) eagerly
    rollmarket --help        lists the commands from a table, imports none of them
    serve-model, taken port  the error line for a port another process holds (the model is not
                             loaded: the port is claimed first)
    exchange serve, healthy  from the command to the first 200 on /healthz (no torch in the process)

    python benchmarks/cli_startup.py               # 10 rounds
    python benchmarks/cli_startup.py --rounds 20
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from _result import write_result
from rich.console import Console
from rich.table import Table

from rollmarket.localhost import free_port

REPO = Path(__file__).resolve().parents[1]
ROLLMARKET = [sys.executable, "-m", "rollmarket"]


def _timed(argv: list[str], *, expect: int) -> float:
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, check=False)
    elapsed = time.perf_counter() - started
    if done.returncode != expect:
        raise SystemExit(f"{argv}: exit {done.returncode}, expected {expect}\n{done.stderr[-2000:]}")
    return elapsed


def _exchange_to_healthy(tmp: Path) -> float:
    port = free_port()
    started = time.perf_counter()
    proc = subprocess.Popen([*ROLLMARKET, "exchange", "serve", "--db", str(tmp / f"{port}.db"), "--port", str(port),
                             "--trainer-token", "bench", "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    try:
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    return time.perf_counter() - started
            except httpx.TransportError:
                pass
            if proc.poll() is not None:
                raise SystemExit(f"the exchange exited with {proc.returncode}")
            time.sleep(0.01)
    finally:
        proc.terminate()
        proc.wait(20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "cli_startup.json")
    args = parser.parse_args()
    samples: dict[str, list[float]] = {}
    with socket.socket() as held, tempfile.TemporaryDirectory() as tmp:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = str(held.getsockname()[1])
        cases = {
            "baseline: import torch": lambda: _timed([sys.executable, "-c", "import torch"], expect=0),
            "rollmarket --help": lambda: _timed([*ROLLMARKET, "--help"], expect=0),
            "serve-model, taken port": lambda: _timed([*ROLLMARKET, "serve-model", "models/tiny-moe", "--port", taken],
                                                      expect=1),
            "exchange serve, healthy": lambda: _exchange_to_healthy(Path(tmp)),
        }
        for case in cases.values():
            case()  # warm the page cache: every round then reads the same files from memory
        for _ in range(args.rounds):
            for name, case in cases.items():
                samples.setdefault(name, []).append(case())
    base = statistics.median(samples["baseline: import torch"])
    table = Table(title=f"CLI start-up, median of {args.rounds} fresh processes")
    for column in ("case", "seconds", "× import torch"):
        table.add_column(column, justify="right")
    rows = []
    for name, values in samples.items():
        median = statistics.median(values)
        rows.append({"case": name, "median_s": median, "samples_s": values})
        table.add_row(name, f"{median:.3f}", f"{median / base:.2f}×")
    console = Console(width=max(Console().width, 100))
    console.print(table)
    write_result(args.out, "cli_startup", args, rows)
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
