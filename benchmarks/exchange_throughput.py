"""Exchange ingest throughput: groups/s, response tokens/s, p50/p99 lease and submit latency.

Each simulated worker loops lease → build a group (16 samples x 512 response tokens with
logprobs, 128 prompt tokens each) → seal it (content hash) → submit, against a real
`rollmarket exchange serve` process (full validation, hashing, durable SQLite writes with
synchronous=FULL). Modes:

    msgpack     the exchange as shipped: arrays as raw bytes (the thing measured)
    json        the same exchange and payload, arrays sent as plain JSON lists (the baseline)
    bare-json   a bare FastAPI + SQLite endpoint that parses the JSON body and stores it, validating
                nothing, with no leases (the reference point the issue quotes, ~1.5M tokens/s)
    bare-bytes  the same endpoint storing the raw body unparsed: HTTP plus one SQLite insert, the
                floor of what any Python ingest costs here

    python benchmarks/exchange_throughput.py                 # 1, 4, 16 workers, all modes
    python benchmarks/exchange_throughput.py --workers 16 --modes msgpack,json --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import secrets
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

from rollmarket import TrainerClient, WorkerClient
from rollmarket.contracts import (
    PolicyManifest,
    RolloutJob,
    SampleGroup,
    SamplingConfig,
    TaskSpec,
    Trajectory,
    WorkerManifest,
    content_hash,
)
from rollmarket.contracts.wire import MSGPACK, packb
from rollmarket.localhost import free_port, wait_healthy

SAMPLES = 16
RESPONSE_TOKENS = 512
PROMPT_TOKENS = 128
TOKENIZER = "ab" * 32
console = Console(width=max(Console().width, 150))


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _trajectories(seed: int) -> list[Trajectory]:
    rng = np.random.default_rng(seed)
    return [
        Trajectory(
            sample_index=i,
            prompt_token_ids=rng.integers(0, 150_000, PROMPT_TOKENS, dtype=np.int32),
            response_token_ids=rng.integers(0, 150_000, RESPONSE_TOKENS, dtype=np.int32),
            logprobs=-rng.random(RESPONSE_TOKENS, dtype=np.float32) * 4,
            action_mask=np.ones(RESPONSE_TOKENS, np.uint8),
            tool_output_mask=np.zeros(RESPONSE_TOKENS, np.uint8),
            reward=float(i % 2),
        )
        for i in range(SAMPLES)
    ]


# -- load generator (runs in child processes) ------------------------------------------------

async def _exchange_worker(url: str, token: str, manifest: WorkerManifest, wire: str, stop_at: float,
                           trajectories: list[Trajectory], out: dict, period: float | None,
                           offset: float) -> None:
    helper = WorkerClient(url, token, manifest=manifest, wire=wire)
    helper.loaded_fingerprint = manifest.engine_fingerprint
    async with httpx.AsyncClient(base_url=url, timeout=60,
                                 headers={"authorization": f"Bearer {token}", "accept": "application/json"}) as http:
        due = time.perf_counter() + offset
        while time.perf_counter() < stop_at:
            if period is not None:
                # Open loop: each worker starts a cycle every `period` seconds, as real workers
                # that spend their time generating would; a late cycle starts at once.
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                due += period
            t0 = time.perf_counter()
            response = await http.post("/v1/leases")
            t1 = time.perf_counter()
            grant = response.json()
            if response.status_code != 200 or grant.get("lease") is None:
                raise RuntimeError(f"no lease: {response.status_code} {response.text[:300]}")
            from rollmarket.contracts import LeaseGrant

            group = helper.group_for(LeaseGrant.model_validate(grant), trajectories)
            group = group.model_copy(update={"content_hash": content_hash(group)})
            if wire == "msgpack":
                body, kind = packb(group), MSGPACK
            else:
                body, kind = group.model_dump_json().encode(), "application/json"
            t2 = time.perf_counter()
            response = await http.post("/v1/groups", content=body, headers={"content-type": kind})
            t3 = time.perf_counter()
            if response.status_code != 200:
                raise RuntimeError(f"submit failed: {response.status_code} {response.text[:300]}")
            out["lease"].append(t1 - t0)
            out["submit"].append(t3 - t2)
            out["done_at"].append(t3)


async def _bare_worker(url: str, body: bytes, stop_at: float, out: dict) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            response = await http.post("/ingest", content=body, headers={"content-type": "application/json"})
            t1 = time.perf_counter()
            if response.status_code != 200:
                raise RuntimeError(f"bare ingest failed: {response.status_code}")
            out["submit"].append(t1 - t0)
            out["done_at"].append(t1)


def _load_process(mode: str, url: str, workers: list[tuple[int, str, str, dict]], start_at: float, stop_at: float,
                  seed: int, queue: mp.Queue, period: float | None, total_workers: int) -> None:
    trajectories = _trajectories(seed)
    results = []

    async def main() -> None:
        await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
        tasks = []
        for index, _, token, manifest_data in workers:
            # Paced workers start spread over one period so that arrivals are even.
            offset = 0.0 if period is None else period * index / total_workers
            out = {"lease": [], "submit": [], "done_at": []}
            results.append(out)
            if mode.startswith("bare"):
                group = SampleGroup(job_id="j", lease_id="l", worker_id="w", task_id="t", policy_version=0,
                                    checkpoint_digest="0" * 64, tokenizer_hash=TOKENIZER,
                                    sampling_config_hash="0" * 64, engine_name="bench", engine_version="1",
                                    engine_fingerprint="f", device_type="cpu", precision_class="bf16",
                                    quantization_class="none", trajectories=trajectories)
                tasks.append(_bare_worker(url, group.model_dump_json().encode(), stop_at, out))
            else:
                manifest = WorkerManifest.model_validate(manifest_data)
                tasks.append(_exchange_worker(url, token, manifest, mode, stop_at, trajectories, out, period, offset))
        await asyncio.gather(*tasks)

    asyncio.run(main())
    merged = {key: [v for out in results for v in out[key]] for key in ("lease", "submit", "done_at")}
    queue.put(merged)


# -- servers ---------------------------------------------------------------------------------

BARE_APP = '''
import json, sqlite3, sys
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
import uvicorn
conn = sqlite3.connect(sys.argv[1], check_same_thread=False, isolation_level=None)
conn.execute("pragma journal_mode=wal"); conn.execute("pragma synchronous=FULL")
conn.execute("create table if not exists g (id integer primary key, body blob)")
parse = sys.argv[3] == "json"
app = FastAPI()
@app.get("/healthz")
async def healthz(): return {"status": "ok"}
@app.post("/ingest")
async def ingest(request: Request):
    if parse:  # what an endpoint taking a JSON body does: parse it, store it
        body = json.dumps(await request.json())
    else:      # a byte sink: store what arrived
        body = await request.body()
    conn.execute("insert into g (body) values (?)", (body,))
    return JSONResponse({"ok": True})
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
'''


def _start_server(mode: str, tmp: Path) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    token = secrets.token_urlsafe(16)
    if mode.startswith("bare"):
        script = tmp / "bare_app.py"
        script.write_text(BARE_APP)
        proc = subprocess.Popen([sys.executable, str(script), str(tmp / "bare.db"), str(port),
                                 mode.removeprefix("bare-")])
    else:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollmarket", "exchange", "serve", "--db", str(tmp / f"{mode}.db"),
             "--port", str(port), "--log-level", "warning", "--lease-ttl-s", "600",
             "--heartbeat-ttl-s", "600"],
            env={**os.environ, "ROLLMARKET_TRAINER_TOKEN": token},
            stdout=subprocess.DEVNULL,
        )
    wait_healthy(url, proc)
    return proc, url, token


def _prepare_exchange(url: str, trainer_token: str, workers: int, jobs: int) -> list[tuple[str, str, dict]]:
    trainer = TrainerClient(url, trainer_token)
    trainer.publish_policy(PolicyManifest(
        policy_version=0, checkpoint_digest="c" * 64, tokenizer_hash=TOKENIZER, model_config_hash="d" * 64,
        vocab_size=150_000, precision_class="bf16"), quorum=1)
    registered = []
    for index in range(workers):
        manifest = WorkerManifest(
            worker_id=f"bench-{index}", engine_name="bench", engine_version="1", engine_fingerprint="f" * 16,
            precision_classes=["bf16"], supported_tokenizer_hashes=[TOKENIZER], max_context_tokens=32_768,
        )
        client = WorkerClient(url)
        registration = client.register(manifest)
        client.ack_reload(0, "c" * 64)
        registered.append((manifest.worker_id, registration.token, manifest.model_dump(mode="json")))
    task = TaskSpec(task_id="bench", prompt="benchmark", verifier="none")
    sampling = SamplingConfig(max_tokens=RESPONSE_TOKENS)
    for start in range(0, jobs, 2000):
        trainer.enqueue([RolloutJob(task=task, policy_version=0, group_size=SAMPLES, sampling_config=sampling,
                                    max_context_tokens=8192) for _ in range(start, min(jobs, start + 2000))])
    trainer.close()
    return registered


def run_case(mode: str, workers: int, seconds: float, processes: int, rate: float | None = None) -> dict:
    """One measurement. `rate` (response tokens/s over all workers) paces the workers; None runs
    them back to back (closed loop, the most the exchange can take)."""
    period = None if rate is None else workers * SAMPLES * RESPONSE_TOKENS / rate
    with tempfile.TemporaryDirectory(prefix="rollmarket-bench-") as tmp_name:
        tmp = Path(tmp_name)
        proc, url, token = _start_server(mode, tmp)
        try:
            if mode.startswith("bare"):
                registered = [(f"bare-{i}", "", {}) for i in range(workers)]
            else:
                # Enough jobs for a generous upper bound on throughput.
                registered = _prepare_exchange(url, token, workers, jobs=int(800 * seconds) + 200)
            cpu_before = _cpu_seconds(proc.pid)
            ctx = mp.get_context("spawn")
            queue = ctx.Queue()
            now = time.perf_counter()
            # perf_counter is system-wide on Linux (CLOCK_MONOTONIC), so children share the deadlines.
            start_at, stop_at = now + 2.0, now + 2.0 + seconds
            nproc = max(1, min(processes, workers))
            numbered = [(index, *worker) for index, worker in enumerate(registered)]
            shards = [numbered[i::nproc] for i in range(nproc)]
            children = [ctx.Process(target=_load_process,
                                    args=(mode, url, shard, start_at, stop_at, i, queue, period, workers))
                        for i, shard in enumerate(shards)]
            for child in children:
                child.start()
            parts = [queue.get(timeout=seconds + 120) for _ in children]
            for child in children:
                child.join()
            cpu_used = _cpu_seconds(proc.pid) - cpu_before
        finally:
            proc.terminate()
            proc.wait(15)
    submit = np.array([v for p in parts for v in p["submit"]])
    lease = np.array([v for p in parts for v in p["lease"]])
    done = np.array([v for p in parts for v in p["done_at"]])
    # Steady state: completions after the first second, so start-up and ramp do not count.
    window_start = start_at + 1.0
    groups = int((done >= window_start).sum())
    elapsed = float(done.max() - window_start) if groups else seconds
    submit = submit[done >= window_start]
    lease = lease[done >= window_start] if len(lease) else lease
    return {
        "mode": mode if rate is None else f"{mode} @{rate / 1e6:g}M/s", "workers": workers,
        "paced_tokens_per_s": rate, "groups": groups, "seconds": round(elapsed, 2),
        "groups_per_s": groups / elapsed, "tokens_per_s": groups * SAMPLES * RESPONSE_TOKENS / elapsed,
        "submit_p50_ms": float(np.percentile(submit, 50) * 1000) if groups else None,
        "submit_p99_ms": float(np.percentile(submit, 99) * 1000) if groups else None,
        "lease_p50_ms": float(np.percentile(lease, 50) * 1000) if len(lease) else None,
        "lease_p99_ms": float(np.percentile(lease, 99) * 1000) if len(lease) else None,
        "server_cpu_ms_per_group": cpu_used / groups * 1000 if groups else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="1,4,16", help="Comma-separated concurrent worker counts.")
    parser.add_argument("--modes", default="msgpack,json,bare-json,bare-bytes", help="Comma-separated modes.")
    parser.add_argument("--seconds", type=float, default=8.0, help="Measured seconds per case.")
    parser.add_argument("--processes", type=int, default=2, help="Load-generator processes.")
    parser.add_argument("--paced", default="2000000",
                        help="Comma-separated target token rates for paced (open-loop) msgpack runs with the "
                             "largest worker count; empty for none.")
    parser.add_argument("--out", type=Path, default=None, help="Also write the results as JSON here.")
    args = parser.parse_args()
    results = []
    for workers in [int(w) for w in args.workers.split(",")]:
        for mode in args.modes.split(","):
            console.print(f"running {mode} with {workers} worker(s) for {args.seconds:g}s …")
            results.append(run_case(mode, workers, args.seconds, args.processes))
    most = max(int(w) for w in args.workers.split(","))
    for rate in [float(r) for r in args.paced.split(",") if r.strip()]:
        console.print(f"running msgpack with {most} worker(s) paced at {rate / 1e6:g}M tokens/s …")
        results.append(run_case("msgpack", most, args.seconds, args.processes, rate=rate))
    table = Table(title=f"exchange ingest: {SAMPLES} samples x {RESPONSE_TOKENS} response tokens per group")
    for column in ("workers", "mode", "groups/s", "tokens/s", "vs json", "vs bare-json", "submit p50/p99 ms",
                   "lease p50/p99 ms", "server CPU ms/group"):
        table.add_column(column, justify="right")
    for row in results:
        def ratio(other: str, row: dict = row) -> str:
            base = next((r for r in results if r["mode"] == other and r["workers"] == row["workers"]), None)
            if row["paced_tokens_per_s"] is not None:
                return "-"
            return f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base and base["tokens_per_s"] else "-"

        lease = "-" if row["lease_p50_ms"] is None else f"{row['lease_p50_ms']:.1f} / {row['lease_p99_ms']:.1f}"
        table.add_row(
            str(row["workers"]), row["mode"], f"{row['groups_per_s']:.1f}", f"{row['tokens_per_s'] / 1e6:.2f}M",
            ratio("json"), ratio("bare-json"), f"{row['submit_p50_ms']:.1f} / {row['submit_p99_ms']:.1f}", lease,
            f"{row['server_cpu_ms_per_group']:.2f}",
        )
    console.print(table)
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.platform(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "command": " ".join(sys.argv)}
    console.print(meta)
    if args.out:
        args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
