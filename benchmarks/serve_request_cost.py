"""What one request costs the model server's processes besides its decode: CPU per request.

A burst of a tiny model's 32 requests is over in about a tenth of a second on a GPU, so what
surrounds the decode (parsing the request, rendering the chat template, answering) weighs on
it. This starts a real `rollmarket serve-model`, sends bursts of ``--batch`` requests through the
official `openai` client from this process, and reads three clocks around them: the CPU time of
the HTTP process and of its engine process (from /proc; the engine process only with
``--engine-process``), the decode thread's busy wall (`decode_seconds` + `prefill_seconds` of
/v1/engine), and this process's own CPU (the client's share). Chat and plain completions, each at
``--max-tokens`` 1 (almost no decode) and 16.

    python benchmarks/serve_request_cost.py                         # tiny-dense on the CPU
    python benchmarks/serve_request_cost.py --device cuda           # the engine process by default there
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from serve_throughput import MESSAGES, _device_name, _start_server  # noqa: E402

console = Console(width=max(Console().width, 140))
CLOCK_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICK


def children(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in found]


async def bursts(url: str, name: str, route: str, batch: int, max_tokens: int, count: int) -> list[float]:
    """``count`` bursts through one client (made once: its set-up is not a request's cost); each
    burst's wall seconds."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    extra = {"ignore_eos": True}
    walls = []
    for _ in range(count):
        started = time.perf_counter()
        if route == "chat":
            await asyncio.gather(*(client.chat.completions.create(
                model=name, messages=MESSAGES, max_tokens=max_tokens, seed=s, extra_body=extra) for s in range(batch)))
        else:
            await asyncio.gather(*(client.completions.create(
                model=name, prompt="Count:", max_tokens=max_tokens, seed=s, extra_body=extra) for s in range(batch)))
        walls.append(time.perf_counter() - started)
    await client.close()
    return walls


def measure(url: str, name: str, server: int, engine: int | None, route: str, max_tokens: int, args) -> dict:
    asyncio.run(bursts(url, name, route, args.batch, max_tokens, 1))  # warm: shapes, graphs, caches

    async def measured() -> tuple[list[float], dict, float, float, float, dict]:
        from openai import AsyncOpenAI  # noqa: F401  (imported before the clocks start)

        before = httpx.get(url + "/v1/engine").json()
        server0, engine0 = cpu_seconds(server), cpu_seconds(engine) if engine else 0.0
        client0 = time.process_time()
        walls = await bursts(url, name, route, args.batch, max_tokens, args.bursts)
        client_s = time.process_time() - client0
        server_s, engine_s = cpu_seconds(server) - server0, (cpu_seconds(engine) - engine0) if engine else 0.0
        return walls, before, client_s, server_s, engine_s, httpx.get(url + "/v1/engine").json()

    walls, before, client_s, server_s, engine_s, after = asyncio.run(measured())
    busy_s = sum(after[k] - before[k] for k in ("decode_seconds", "prefill_seconds"))
    requests = args.bursts * args.batch
    per = 1000 / requests
    # In-process decode: the HTTP process's CPU holds the decode thread's too, so its share outside
    # the decode is the difference (the decode thread is CPU-bound there: one torch thread).
    outside = server_s - (busy_s if engine is None else 0.0)
    return {"route": route, "max_tokens": max_tokens, "requests": requests,
            "burst_wall_ms": 1000 * statistics.median(walls), "burst_wall_ms_runs": [1000 * w for w in walls],
            "http_process_cpu_ms_per_request": per * server_s,
            "http_side_cpu_ms_per_request": per * outside,
            "engine_process_cpu_ms_per_request": per * engine_s if engine else None,
            "decode_busy_ms_per_request": per * busy_s,
            "client_cpu_ms_per_request": per * client_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=REPO / "models" / "tiny-dense")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default=None, help="Default: fp32 on cpu, bf16 on cuda.")
    parser.add_argument("--batch", type=int, default=32, help="Requests per burst.")
    parser.add_argument("--bursts", type=int, default=5, help="Measured bursts per case.")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads; default 1 on cpu.")
    parser.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                        help="Pass serve-model's --engine-process/--no-engine-process (default: the server's own).")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON out; default benchmarks/results/serve_request_cost[-cuda].json.")
    args = parser.parse_args()
    kind = "cuda" if args.device.startswith("cuda") else "cpu"
    args.precision = args.precision or ("bf16" if kind == "cuda" else "fp32")
    args.threads = args.threads if args.threads is not None else (1 if kind == "cpu" else 0)
    args.batches, args.batch_window_ms = [args.batch], 5.0  # what _start_server reads
    extra = () if args.engine_process is None else (
        ("--engine-process",) if args.engine_process else ("--no-engine-process",))
    out = args.out or REPO / "benchmarks" / "results" / f"serve_request_cost{'-cuda' if kind == 'cuda' else ''}.json"
    with tempfile.TemporaryDirectory() as scratch:
        proc, url = _start_server(args.model, args, Path(scratch) / "serve.log", extra)
        try:
            facts = httpx.get(url + "/v1/engine").json()
            engine_pid = facts["engine_pid"] if facts.get("engine_process") else None
            if engine_pid is not None and engine_pid not in children(proc.pid):
                raise RuntimeError(f"the engine process {engine_pid} is not serve-model's child")
            rows = [measure(url, args.model.name, proc.pid, engine_pid, route, max_tokens, args)
                    for route in ("chat", "completions") for max_tokens in (1, 16)]
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.platform(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "device": args.device,
            "device_name": _device_name(args.device), "precision": args.precision, "model": args.model.name,
            "batch": args.batch, "bursts": args.bursts, "threads": args.threads,
            "engine_process": bool(facts.get("engine_process")), "command": " ".join(["benchmarks/serve_request_cost.py", *sys.argv[1:]])}
    import torch

    meta["torch"] = torch.__version__
    table = Table(title=f"serve-model, {args.model.name}, bursts of {args.batch} (engine process: {meta['engine_process']})")
    for column in ("route", "max tokens", "burst ms", "HTTP process CPU ms/req", "outside the decode ms/req",
                   "engine process CPU ms/req", "decode busy ms/req", "client CPU ms/req"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(r["route"], str(r["max_tokens"]), f"{r['burst_wall_ms']:.0f}",
                      f"{r['http_process_cpu_ms_per_request']:.2f}", f"{r['http_side_cpu_ms_per_request']:.2f}",
                      "-" if r["engine_process_cpu_ms_per_request"] is None else f"{r['engine_process_cpu_ms_per_request']:.2f}",
                      f"{r['decode_busy_ms_per_request']:.2f}", f"{r['client_cpu_ms_per_request']:.2f}")
    console.print(table)
    out.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
