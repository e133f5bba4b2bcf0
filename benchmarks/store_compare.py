"""The PostgreSQL store against SQLite, with one and two exchange replicas, in one run on one box.

Two measurements, every case against real `rollmarket exchange serve` processes:

    ingest     exchange_throughput.py's load (16 samples x 512 response tokens per group, lease →
               seal → submit back to back, msgpack) from `--workers` workers: response tokens/s
               and p50/p99 lease and submit latency. With two replicas the workers are split
               between them, as a load balancer would.
    fairness   `--light-workers` (1,000) light workers in `--processes` processes, each looping
               lease (long poll) → `--think-s` of "generation" → submit a 1-sample group of 16
               tokens: leases per worker (Jain's index (Σx)²/(n·Σx²), 1.0 = all equal; min and
               max), leases/s and p99 lease and submit latency.

Cases: sqlite (one process; the baseline of every ratio), postgres with 1 replica, postgres with
2 replicas. PostgreSQL is a throwaway cluster (tests/postgres.py) with fsync on, like SQLite's
synchronous=FULL: an acknowledged write is on disk in both.

    python benchmarks/store_compare.py                       # writes benchmarks/results/store_compare.json
    python benchmarks/store_compare.py --seconds 4 --light-workers 200 --out /tmp/x.json
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
from _result import write_result
from exchange_throughput import RESPONSE_TOKENS, SAMPLES, TOKENIZER, _cpu_seconds, _load_process, _prepare_exchange
from rich.console import Console
from rich.table import Table

from rollmarket import TrainerClient
from rollmarket.contracts import (
    PolicyManifest,
    RolloutJob,
    SamplingConfig,
    TaskSpec,
    Trajectory,
    WorkerManifest,
    content_hash,
)
from rollmarket.contracts.wire import MSGPACK, packb
from rollmarket.localhost import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
console = Console(width=max(Console().width, 150))
CASES = (("sqlite", 1), ("postgres", 1), ("postgres", 2))
LIGHT_TOKENS = 16


# -- servers -------------------------------------------------------------------------------------

@contextmanager
def exchanges(store: str, replicas: int, tmp: Path, pg_url: str | None, extra: tuple[str, ...] = ()):
    """`replicas` exchange processes on one store; yields (urls, trainer token, pids)."""
    token = secrets.token_urlsafe(16)
    db = str(tmp / "exchange.db") if store == "sqlite" else pg_url
    procs, urls = [], []
    try:
        for _ in range(replicas):
            port = free_port()
            proc = subprocess.Popen(
                [sys.executable, "-m", "rollmarket", "exchange", "serve", "--db", db, "--port", str(port),
                 "--log-level", "warning", "--lease-ttl-s", "600", "--heartbeat-ttl-s", "600", *extra],
                env={**os.environ, "ROLLMARKET_TRAINER_TOKEN": token}, stdout=subprocess.DEVNULL)
            procs.append(proc)
            urls.append(f"http://127.0.0.1:{port}")
            wait_healthy(urls[-1], proc)
        yield urls, token, [p.pid for p in procs]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)


@contextmanager
def postgres_database():
    """A throwaway PostgreSQL cluster (tests/postgres.py); yields a function making fresh databases."""
    from postgres import Cluster

    with Cluster() as cluster:
        yield cluster.create_database


# -- ingest ---------------------------------------------------------------------------------------

def ingest_case(store: str, replicas: int, workers: int, seconds: float, processes: int,
                new_db) -> dict:
    with tempfile.TemporaryDirectory(prefix="rollmarket-store-") as tmp_name:
        pg_url = new_db() if store == "postgres" else None
        with exchanges(store, replicas, Path(tmp_name), pg_url) as (urls, token, pids):
            registered = _prepare_exchange(urls[0], token, workers, jobs=int(800 * seconds) + 200)
            cpu_before = sum(_cpu_seconds(pid) for pid in pids)
            ctx = mp.get_context("spawn")
            queue = ctx.Queue()
            now = time.perf_counter()
            start_at, stop_at = now + 2.0, now + 2.0 + seconds
            nproc = max(replicas, min(processes, workers))
            numbered = [(index, *worker) for index, worker in enumerate(registered)]
            children = [ctx.Process(target=_load_process, args=(
                "msgpack", urls[i % replicas], numbered[i::nproc], start_at, stop_at, i, queue, None, workers))
                for i in range(nproc)]
            for child in children:
                child.start()
            parts = [queue.get(timeout=seconds + 180) for _ in children]
            for child in children:
                child.join()
            cpu_used = sum(_cpu_seconds(pid) for pid in pids) - cpu_before
    done = np.array([v for p in parts for v in p["done_at"]])
    keep = done >= start_at + 1.0  # steady state: the first second is ramp-up
    submit = np.array([v for p in parts for v in p["submit"]])[keep]
    lease = np.array([v for p in parts for v in p["lease"]])[keep]
    groups = int(keep.sum())
    elapsed = float(done.max() - (start_at + 1.0)) if groups else seconds
    return {
        "kind": "ingest", "store": store, "replicas": replicas, "workers": workers, "groups": groups,
        "seconds": round(elapsed, 2), "tokens_per_s": groups * SAMPLES * RESPONSE_TOKENS / elapsed,
        "submit_p50_ms": float(np.percentile(submit, 50) * 1000), "submit_p99_ms": float(np.percentile(submit, 99) * 1000),
        "lease_p50_ms": float(np.percentile(lease, 50) * 1000), "lease_p99_ms": float(np.percentile(lease, 99) * 1000),
        "server_cpu_ms_per_group": cpu_used / groups * 1000 if groups else None,
    }


# -- fairness: many light workers ----------------------------------------------------------------

def _light_process(urls: list[str], ids: list[int], think_s: float, seconds: float, ready, go, queue) -> None:
    trajectory = Trajectory(
        sample_index=0, prompt_token_ids=np.arange(8, dtype=np.int32),
        response_token_ids=np.arange(LIGHT_TOKENS, dtype=np.int32),
        logprobs=-np.full(LIGHT_TOKENS, 0.5, np.float32), action_mask=np.ones(LIGHT_TOKENS, np.uint8),
        tool_output_mask=np.zeros(LIGHT_TOKENS, np.uint8), reward=1.0)

    async def one(index: int, http: httpx.AsyncClient, gate: asyncio.Semaphore, out: dict,
                  go_event: asyncio.Event) -> None:
        from rollmarket import WorkerClient
        from rollmarket.contracts import LeaseGrant, WorkerRegistration

        manifest = WorkerManifest(
            worker_id=f"light-{index}", engine_name="bench", engine_version="1", engine_fingerprint="f" * 16,
            precision_classes=["bf16"], supported_tokenizer_hashes=[TOKENIZER], max_context_tokens=4096)
        url = urls[index % len(urls)]
        async with gate:  # registration in bounded bursts
            answer = await http.post(f"{url}/v1/workers/register", content=manifest.model_dump_json(),
                                     headers={"content-type": "application/json"})
            token = WorkerRegistration.model_validate(answer.json()).token
            auth = {"authorization": f"Bearer {token}"}
            ack = {"worker_id": manifest.worker_id, "policy_version": 0, "checkpoint_digest": "c" * 64,
                   "engine_fingerprint": manifest.engine_fingerprint}
            (await http.post(f"{url}/v1/reload-acks", json=ack, headers=auth)).raise_for_status()
        helper = WorkerClient(url, token, manifest=manifest)
        out["ready"] += 1
        await go_event.wait()
        stop_at = time.perf_counter() + seconds
        leases = 0
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            response = await http.post(f"{url}/v1/leases", params={"wait_s": 2}, headers=auth)
            out["lease"].append(time.perf_counter() - t0)
            grant = LeaseGrant.model_validate(response.json())
            if grant.lease is None:
                continue
            leases += 1
            await asyncio.sleep(think_s)
            group = helper.group_for(grant, [trajectory])
            body = packb(group.model_copy(update={"content_hash": content_hash(group)}))
            t1 = time.perf_counter()
            for attempt in range(3):
                try:  # a submission is idempotent: re-send it when a kept-alive connection was closed
                    response = await http.post(f"{url}/v1/groups", content=body,
                                               headers={**auth, "content-type": MSGPACK})
                    break
                except httpx.TransportError:
                    if attempt == 2:
                        raise
            out["submit"].append(time.perf_counter() - t1)
            response.raise_for_status()
        out["leases"][manifest.worker_id] = leases
        helper.close()

    async def main() -> dict:
        go_event = asyncio.Event()
        out = {"ready": 0, "lease": [], "submit": [], "leases": {}}
        # Idle connections are dropped before uvicorn's 5 s keep-alive ends them: a request on a
        # connection the server is closing at that moment fails with a ReadError.
        limits = httpx.Limits(max_connections=len(ids) + 10, max_keepalive_connections=len(ids) + 10,
                              keepalive_expiry=1.0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            gate = asyncio.Semaphore(16)
            tasks = [asyncio.create_task(one(i, http, gate, out, go_event)) for i in ids]
            while out["ready"] < len(ids):
                await asyncio.sleep(0.1)
            ready.release()
            await asyncio.to_thread(go.wait)
            go_event.set()
            await asyncio.gather(*tasks)
        return out

    queue.put(asyncio.run(main()))


def fairness_case(store: str, replicas: int, light_workers: int, processes: int, think_s: float,
                  seconds: float, new_db) -> dict:
    with tempfile.TemporaryDirectory(prefix="rollmarket-fair-") as tmp_name:
        pg_url = new_db() if store == "postgres" else None
        # No hold for better-ranked workers: equal workers, so any wait would only add latency.
        with exchanges(store, replicas, Path(tmp_name), pg_url, ("--preference-hold-s", "0")) as (urls, token, _):
            with TrainerClient(urls[0], token) as trainer:
                trainer.publish_policy(PolicyManifest(
                    policy_version=0, checkpoint_digest="c" * 64, tokenizer_hash=TOKENIZER,
                    model_config_hash="d" * 64, vocab_size=150_000, precision_class="bf16"), quorum=1)
                task = TaskSpec(task_id="fair", prompt="fairness", verifier="none")
                sampling = SamplingConfig(max_tokens=LIGHT_TOKENS)
                # More jobs than the workers can take: every lease request finds one.
                total = int(light_workers * (seconds / max(think_s, 0.05) + 2))
                for start in range(0, total, 2000):
                    trainer.enqueue([RolloutJob(task=task, policy_version=0, group_size=1, sampling_config=sampling,
                                                max_context_tokens=1024) for _ in range(start, min(total, start + 2000))])
            ctx = mp.get_context("spawn")
            queue, ready, go = ctx.Queue(), ctx.Semaphore(0), ctx.Event()
            ids = list(range(light_workers))
            children = [ctx.Process(target=_light_process, args=(urls, ids[i::processes], think_s, seconds,
                                                                  ready, go, queue)) for i in range(processes)]
            for child in children:
                child.start()
            for _ in children:
                if not ready.acquire(timeout=600):
                    raise RuntimeError("light workers did not register in 10 minutes")
            started = time.perf_counter()
            go.set()
            parts = [queue.get(timeout=seconds + 300) for _ in children]
            elapsed = time.perf_counter() - started
            for child in children:
                child.join()
    counts = np.array([n for p in parts for n in p["leases"].values()], dtype=float)
    lease = np.array([v for p in parts for v in p["lease"]])
    submit = np.array([v for p in parts for v in p["submit"]])
    return {
        "kind": "fairness", "store": store, "replicas": replicas, "workers": light_workers,
        "think_s": think_s, "seconds": round(elapsed, 2), "leases": int(counts.sum()),
        "leases_per_s": float(counts.sum() / elapsed),
        "jain": float(counts.sum() ** 2 / (len(counts) * (counts ** 2).sum())) if counts.sum() else 0.0,
        "min_leases": int(counts.min()), "max_leases": int(counts.max()),
        "lease_p99_ms": float(np.percentile(lease, 99) * 1000),
        "submit_p99_ms": float(np.percentile(submit, 99) * 1000) if len(submit) else None,
    }


# -- report ----------------------------------------------------------------------------------------

def print_tables(rows: list[dict]) -> None:
    def rate(r: dict) -> float:
        return r["tokens_per_s"] if r["kind"] == "ingest" else r["leases_per_s"]

    base = {r["kind"]: rate(r) for r in rows if r["store"] == "sqlite"}
    ingest = Table(title=f"ingest: {SAMPLES} x {RESPONSE_TOKENS} response tokens per group, msgpack")
    for column in ("store", "replicas", "workers", "tokens/s", "vs sqlite", "lease p50/p99 ms",
                   "submit p50/p99 ms", "server CPU ms/group"):
        ingest.add_column(column, justify="right")
    fair = Table(title="fairness: light workers")
    for column in ("store", "replicas", "workers", "leases/s", "vs sqlite", "Jain", "min/max leases",
                   "lease p99 ms", "submit p99 ms"):
        fair.add_column(column, justify="right")
    for r in rows:
        ratio = f"{rate(r) / base[r['kind']]:.2f}x" if base.get(r["kind"]) else "-"
        if r["kind"] == "ingest":
            ingest.add_row(r["store"], str(r["replicas"]), str(r["workers"]), f"{r['tokens_per_s'] / 1e6:.2f}M", ratio,
                           f"{r['lease_p50_ms']:.1f} / {r['lease_p99_ms']:.1f}",
                           f"{r['submit_p50_ms']:.1f} / {r['submit_p99_ms']:.1f}", f"{r['server_cpu_ms_per_group']:.2f}")
        else:
            fair.add_row(r["store"], str(r["replicas"]), str(r["workers"]), f"{r['leases_per_s']:.1f}", ratio,
                         f"{r['jain']:.3f}", f"{r['min_leases']} / {r['max_leases']}", f"{r['lease_p99_ms']:.1f}",
                         "-" if r["submit_p99_ms"] is None else f"{r['submit_p99_ms']:.1f}")
    console.print(ingest)
    console.print(fair)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=16, help="Ingest workers.")
    parser.add_argument("--seconds", type=float, default=8.0, help="Measured seconds per ingest case.")
    parser.add_argument("--light-workers", type=int, default=1000, help="Light workers in the fairness load.")
    parser.add_argument("--think-s", type=float, default=5.0, help="Each light worker's 'generation' time per lease.")
    parser.add_argument("--fair-seconds", type=float, default=60.0, help="Measured seconds per fairness case.")
    parser.add_argument("--processes", type=int, default=4, help="Load-generator processes.")
    parser.add_argument("--cases", default="sqlite:1,postgres:1,postgres:2", help="store:replicas, comma-separated.")
    parser.add_argument("--kinds", default="ingest,fairness", help="ingest, fairness or both.")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "store_compare.json")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-ups: servers, the cluster
    cases = [(store, int(n)) for store, n in (c.split(":") for c in args.cases.split(","))]
    rows = []
    with postgres_database() as new_db:
        for kind in args.kinds.split(","):
            for store, replicas in cases:
                console.print(f"{kind}: {store} with {replicas} replica(s) …")
                if kind == "ingest":
                    rows.append(ingest_case(store, replicas, args.workers, args.seconds, args.processes, new_db))
                else:
                    rows.append(fairness_case(store, replicas, args.light_workers, args.processes, args.think_s,
                                              args.fair_seconds, new_db))
    print_tables(rows)
    write_result(args.out, "store_compare", args, rows)
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
