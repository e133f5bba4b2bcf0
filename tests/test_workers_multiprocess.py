"""Several real worker processes against one exchange while a trainer enqueues jobs.

Each worker is `tests/worker_script.py` in its own Python process: it registers, acks the policy
and loops lease → submit. The test enqueues jobs in batches while they run, waits until every
job is done, stops the workers and then checks the books: each job done exactly once, each
group stored once, leases per worker summing to the total, and no lease left issued.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from helpers import job, policy, wait_until

SCRIPT = Path(__file__).with_name("worker_script.py")
WORKERS = 4
JOBS = 40
BATCH = 5


def test_worker_processes_complete_every_job_exactly_once(start_exchange, tmp_path):
    server = start_exchange("--reaper-interval-s", "0.2")
    trainer = server.trainer()
    trainer.publish_policy(policy(0))
    stop_file = tmp_path / "stop"
    worker_ids = [f"proc-{i}" for i in range(WORKERS)]
    procs = {}
    try:
        for worker_id in worker_ids:
            err = open(tmp_path / f"{worker_id}.err", "wb")
            procs[worker_id] = subprocess.Popen(
                [sys.executable, str(SCRIPT), server.url, worker_id, str(stop_file)],
                stdout=subprocess.PIPE, stderr=err,
            )
            err.close()

        # Every worker has registered and loaded v0 before the work arrives.
        wait_until("all workers aligned", lambda: sum(w.aligned for w in trainer.workers()) == WORKERS,
                 timeout=60)
        jobs = [job(i) for i in range(JOBS)]
        for start in range(0, JOBS, BATCH):
            receipts = trainer.enqueue(jobs[start:start + BATCH])
            assert all(r.created for r in receipts)
            time.sleep(0.05)

        wait_until("every job done", lambda: len(trainer.jobs(state="done", limit=1000)) == JOBS,
                 timeout=60, every=0.2)
    finally:
        stop_file.touch()
        outputs = {}
        for worker_id, proc in procs.items():
            try:
                out, _ = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
            outputs[worker_id] = (proc.returncode, out)

    reports = {}
    for worker_id, (code, out) in outputs.items():
        errors = (tmp_path / f"{worker_id}.err").read_text()
        assert code == 0, f"{worker_id} exited {code}:\n{errors}"
        reports[worker_id] = json.loads(out.decode().strip().splitlines()[-1])

    # Each job is done exactly once, with one group, delivered by one of the workers.
    views = trainer.jobs(limit=1000)
    assert len(views) == JOBS and {v.state for v in views} == {"done"}
    assert {v.job.job_id for v in views} == {j.job_id for j in jobs}
    assert all(v.attempts == 1 for v in views)
    group_of_job = {v.job.job_id: v.group_id for v in views}
    assert len(set(group_of_job.values())) == JOBS

    completed = [item for report in reports.values() for item in report["completed"]]
    assert len(completed) == JOBS
    assert Counter(item["job_id"] for item in completed) == Counter({j.job_id: 1 for j in jobs})
    assert {item["job_id"]: item["group_id"] for item in completed} == group_of_job

    # Every group is stored once, and served once to a fresh trainer.
    conn = sqlite3.connect(f"file:{server.db}?mode=ro", uri=True, timeout=30)
    try:
        rows = conn.execute("SELECT COUNT(*), COUNT(DISTINCT group_id), COUNT(DISTINCT job_id),"
                            " COUNT(DISTINCT lease_id) FROM groups").fetchone()
    finally:
        conn.close()
    assert rows == (JOBS, JOBS, JOBS, JOBS)
    fetched = trainer.fetch(limit=1024)
    assert sorted(f.group.group_id for f in fetched.groups) == sorted(group_of_job.values())
    assert fetched.remaining == 0

    # Leases per worker (as each process counted them) sum to the total the exchange issued.
    issued = trainer.audit(kind="lease.issued", limit=10_000).events
    assert len(issued) == JOBS
    per_worker = Counter(e.actor for e in issued)
    assert {w: len(r["completed"]) for w, r in reports.items() if r["completed"]} == dict(per_worker)
    assert sum(len(r["completed"]) for r in reports.values()) == JOBS
    assert sum(1 for r in reports.values() if r["completed"]) >= 2, "only one worker did any work"
    for worker_id, report in reports.items():
        mine = {e.subject for e in issued if e.actor == worker_id}
        assert {item["lease_id"] for item in report["completed"]} == mine

    pool = trainer.pool()
    assert pool.leases == {"submitted": JOBS}, pool.leases
    assert pool.jobs == {"done": JOBS}
    assert all(w.active_leases == 0 for w in pool.workers)
    assert len(trainer.audit(kind="group.accepted", limit=10_000).events) == JOBS
