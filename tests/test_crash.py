"""Crash durability: SIGKILL the exchange mid-write, restart it on the same file, count.

What these tests protect (DESIGN.md: "nothing accepted is ever lost (kill the exchange mid-write,
restart, count)"):

* **An acknowledgement means the write is committed.** Four worker processes
  (tests/crash_worker.py) stream lease -> group -> submit and record a submission only after its
  200 receipt arrives (fsynced JSONL). The exchange is SIGKILLed and restarted on the same file
  and port six times: at whatever moment the stream is in, and (every other time) right after a
  receipt reaches a fifth worker in this process. Every recorded group must then be in the
  database, once, with the content hash its receipt named, and every lease a worker was granted
  must still be known. An exchange that answered before COMMIT loses groups or leases in the
  window between the two; the test catches it whenever a kill lands there (with a 5 ms window,
  every run; with the sub-millisecond window of answering just before a fast local COMMIT, about
  one run in five).
* **Retries across a crash are idempotent.** A submit whose answer was lost is re-sent by the
  client after the restart and must end as exactly one stored copy (a ``duplicate`` receipt),
  never two, never two groups under one lease or for one job.
* **Nothing half-written is stored or served.** ``PRAGMA integrity_check`` is ok; every stored
  group decodes and matches its content hash, both read straight from the file and fetched
  through ``TrainerClient.fetch`` (which raises IntegrityError on a mismatch); each group's job is
  ``done`` and its lease ``submitted`` (same transaction); each has exactly one audit record.
* **Enqueue and publish are atomic and idempotent across a crash.** A trainer killed mid-stream
  three times (each time resuming by re-sending from the first batch) finds each batch stored
  entirely or not at all, every acknowledged batch and version present, and re-sending
  everything after the restart creates exactly the missing jobs and no duplicates.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest

from helpers import ExchangeProcess, job, lease_one, policy, ready_worker, sha, trajectories
from rollmarket import WorkerClient
from rollmarket.client import ExchangeUnavailable
from rollmarket.contracts import LeaseGrant, SampleGroup, Tier, content_hash
from rollmarket.contracts.wire import unpackb

pytestmark = pytest.mark.slow

WORKER_SCRIPT = Path(__file__).with_name("crash_worker.py")
N_WORKERS = 4
GROUP_SIZE = 4
TOKENS = 300         # response tokens per trajectory
N_JOBS = 900         # far more than the test acknowledges (~200); < 1024, one fetch page
KILLS = 6            # SIGKILL + restart rounds; odd rounds are timed right after a receipt
PER_PHASE = 12       # acknowledged submissions to wait for before each kill and after the last restart


# -- small utilities --------------------------------------------------------------------------
def wait_for(predicate, timeout: float, what: str, poll: float = 0.05):
    """Poll `predicate` until it returns something truthy; fail with `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(poll)


def read_jsonl(paths) -> list[dict]:
    records = []
    for path in paths:
        if path.exists():
            # A worker appends whole lines and fsyncs; a partial last line can only be one being
            # written right now, and it is ignored until complete.
            for line in path.read_text().splitlines(keepends=True):
                if line.endswith("\n"):
                    records.append(json.loads(line))
    return records


@contextmanager
def open_ro(db: Path):
    """A read-only connection to the exchange's file (WAL lets it read beside the writer)."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    conn.row_factory = sqlite3.Row
    try:
        yield conn
    finally:
        conn.close()


def assert_integrity(conn: sqlite3.Connection) -> None:
    assert [r[0] for r in conn.execute("PRAGMA integrity_check")] == ["ok"]


# -- test 1: workers streaming submissions through repeated SIGKILLs ----------------------------
class Workers:
    """`crash_worker.py` processes, their acknowledged/refused records and logs. `url` is every
    worker's exchange URL, or a list with one (possibly comma-separated replicas) per worker."""

    def __init__(self, url: str | list[str], out: Path, n: int, tokens: int = TOKENS):
        self.out = out
        self.ids = [f"crash-w{i}" for i in range(n)]
        urls = url if isinstance(url, list) else [url] * n
        self.procs: list[subprocess.Popen] = []
        for worker_id, worker_url in zip(self.ids, urls, strict=True):
            log = open(out / f"{worker_id}.log", "wb")
            self.procs.append(subprocess.Popen(
                [sys.executable, str(WORKER_SCRIPT), worker_url, worker_id, str(out), str(tokens)],
                stdout=log, stderr=subprocess.STDOUT))
            log.close()

    def acked(self) -> list[dict]:
        return read_jsonl(self.out / f"{w}.acked.jsonl" for w in self.ids)

    def refused(self) -> list[dict]:
        return read_jsonl(self.out / f"{w}.refused.jsonl" for w in self.ids)

    def logs(self) -> str:
        return "\n".join(f"--- {w} ---\n{(self.out / f'{w}.log').read_text()[-3000:]}" for w in self.ids)

    def check_alive(self) -> None:
        dead = [(w, p.returncode) for w, p in zip(self.ids, self.procs) if p.poll() is not None]
        if dead:
            pytest.fail(f"worker(s) exited early: {dead}\n{self.logs()}")

    def ready(self) -> bool:
        self.check_alive()
        return all((self.out / f"{w}.ready").exists() for w in self.ids)

    def wait_acked(self, at_least: int, timeout: float, what: str) -> int:
        def enough():
            self.check_alive()
            count = len(self.acked())
            return count if count >= at_least else 0

        return wait_for(enough, timeout, what)

    def stop(self, timeout: float) -> list[int | None]:
        (self.out / "stop").touch()
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [p.poll() for p in self.procs]

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def probe_lease(probe: WorkerClient) -> LeaseGrant | None:
    """A lease for the probe, or None when the call did not get through (a lease whose answer
    was lost just expires; the probe may hold several)."""
    try:
        return lease_one(probe, wait_s=10)
    except ExchangeUnavailable:
        return None


def test_sigkill_while_workers_submit_loses_no_acknowledged_group(start_exchange, tmp_path):
    # Short leases: one granted just before a kill whose answer was lost, or one whose group waits
    # out a restart, expires; the reaper re-queues its job and a late submit is refused.
    server: ExchangeProcess = start_exchange("--reaper-interval-s", "0.2", "--lease-ttl-s", "5")
    with server.trainer(retries=8) as trainer:
        trainer.publish_policy(policy(0))
        jobs = [job(i, group_size=GROUP_SIZE) for i in range(N_JOBS)]
        for start in range(0, N_JOBS, 300):
            trainer.enqueue(jobs[start:start + 300])

    out = tmp_path / "workers"
    out.mkdir()
    workers = Workers(server.url, out, N_WORKERS)
    # A fifth worker in this process times every other kill to land right after a receipt
    # arrives: the moment an exchange that answered before committing would lose the group.
    probe = ready_worker(server.url, "crash-probe", max_concurrent_groups=8)
    probe_acked: list[dict] = []
    kills = []  # (how the kill was timed, acked before it, acked at the restart)
    try:
        wait_for(workers.ready, 60, "workers to register and ack the policy")
        for round_ in range(KILLS):
            before = workers.wait_acked(len(workers.acked()) + PER_PHASE, 40, "submissions to stream")
            timing = "streaming"
            if round_ % 2 == 1:
                grant = wait_for(lambda: probe_lease(probe), 30, "the probe to lease a job")
                group = probe.seal(probe.group_for(
                    grant, trajectories(GROUP_SIZE, tokens=TOKENS, seed=10_000 + round_)))
                receipt = probe.submit(group)
                server.kill()  # SIGKILL as soon as the receipt is in hand
                timing = "after a receipt"
                probe_acked.append({"group_id": receipt.group_id, "lease_id": receipt.lease_id,
                                    "content_hash": receipt.content_hash, "sent_hash": group.content_hash,
                                    "sent_group_id": group.group_id, "duplicate": receipt.duplicate,
                                    "interrupted": {}})
            else:
                server.kill()  # SIGKILL at whatever moment the stream is in
            server.start()  # same database file, same port
            kills.append((timing, before, len(workers.acked())))
        workers.wait_acked(len(workers.acked()) + PER_PHASE, 40, "workers to carry on after the restart")
        codes = workers.stop(timeout=60)
    finally:
        workers.kill()
        probe.close()
    assert codes == [0] * N_WORKERS, f"worker exit codes {codes}\n{workers.logs()}"

    acked, refused = workers.acked() + probe_acked, workers.refused()
    interrupted = Counter(k for r in acked + refused for k, n in r["interrupted"].items() for _ in range(n))
    print(f"kills {kills}; acked {len(acked)}, duplicate receipts {sum(r['duplicate'] for r in acked)}, "
          f"refused {len(refused)}, transport errors under submit {dict(interrupted)}")
    # The kills really hit the stream: some submission met the dead exchange and was re-sent.
    assert interrupted, f"no submission was interrupted by {kills}"
    # A refusal is allowed only for a lease that ended while the exchange was down. `unknown_lease`
    # means a lease was granted and then lost in the crash; `idempotency_conflict` means a re-sent
    # group was not recognised as the copy already stored.
    for r in refused:
        assert r["code"] == "rejected" and r["reasons"], f"refused {r['code']}: {r['message']}"
        assert set(r["reasons"]) <= {"expired_lease", "lease_not_active"}, \
            f"refused for {r['reasons']}: {r['message']}"
    for r in acked:
        assert r["group_id"] == r["sent_group_id"] and r["content_hash"] == r["sent_hash"], r
    acked_ids = Counter(r["group_id"] for r in acked)
    assert max(acked_ids.values()) == 1, "a worker was acknowledged twice for one group"

    # -- the file itself, read-only, beside the running exchange --------------------------------
    with open_ro(server.db) as conn:
        assert_integrity(conn)
        rows = {r["group_id"]: r for r in conn.execute(
            "SELECT g.group_id, g.lease_id, g.job_id, g.content_hash, g.payload,"
            " j.state AS job_state, j.group_id AS job_group, l.state AS lease_state"
            " FROM groups g LEFT JOIN jobs j ON j.job_id = g.job_id"
            " LEFT JOIN leases l ON l.lease_id = g.lease_id")}
        n_groups = conn.execute("SELECT COUNT(*) FROM groups").fetchone()[0]
        per_lease = conn.execute(
            "SELECT lease_id, COUNT(*) FROM groups GROUP BY lease_id HAVING COUNT(*) > 1").fetchall()
        per_job = conn.execute(
            "SELECT job_id, COUNT(*) FROM groups GROUP BY job_id HAVING COUNT(*) > 1").fetchall()
        accepted_audit = Counter(r[0] for r in conn.execute(
            "SELECT subject FROM audit WHERE kind = 'group.accepted'"))
        # The other direction of the same transaction: nothing is marked delivered without a group.
        orphans = conn.execute(
            "SELECT (SELECT COUNT(*) FROM jobs WHERE state = 'done' AND (group_id IS NULL"
            "         OR group_id NOT IN (SELECT group_id FROM groups))),"
            "       (SELECT COUNT(*) FROM leases WHERE state = 'submitted'"
            "         AND lease_id NOT IN (SELECT lease_id FROM groups))").fetchone()

    assert n_groups == len(rows)
    assert not per_lease, f"groups stored twice under one lease: {per_lease}"
    assert not per_job, f"groups stored twice for one job: {per_job}"
    lost = [g for g in acked_ids if g not in rows]
    assert not lost, f"{len(lost)} of {len(acked_ids)} acknowledged groups are missing after the crashes"
    for r in acked:
        assert rows[r["group_id"]]["content_hash"] == r["content_hash"], r
        assert rows[r["group_id"]]["lease_id"] == r["lease_id"], r
    # Groups whose answer was lost in the kill may be stored without an acknowledgement.
    assert n_groups >= len(acked_ids)
    for group_id, row in rows.items():
        group = SampleGroup.model_validate(unpackb(row["payload"]))
        assert group.group_id == group_id and group.content_hash == row["content_hash"]
        assert content_hash(group) == row["content_hash"], f"{group_id} is stored half-written"
        assert row["job_state"] == "done" and row["job_group"] == group_id, dict(row)
        assert row["lease_state"] == "submitted", dict(row)
        assert accepted_audit[group_id] == 1, f"{group_id}: {accepted_audit[group_id]} audit records"
    assert sum(accepted_audit.values()) == n_groups
    assert tuple(orphans) == (0, 0), f"(done jobs, submitted leases) without a stored group: {tuple(orphans)}"

    # -- served through the API: every stored group, each verified against its hash ------------
    fetched: list[str] = []
    with server.trainer(trainer_id="crash-check") as reader:
        for tier in Tier:
            result = reader.fetch(tier=tier, include_served=True, limit=1024)  # raises IntegrityError
            assert result.remaining == 0
            fetched += [f.group.group_id for f in result.groups]
    assert sorted(fetched) == sorted(rows), "the API does not serve exactly the stored groups"


# -- test 2: a trainer publishing and enqueueing through SIGKILLs ------------------------------
TRAINER_KILLS = 3


class CrashingTrainer(threading.Thread):
    """Publishes a version before every `every`-th batch and enqueues the batches in order, from
    the first, as a trainer restarted after a crash would; stops at its first error."""

    def __init__(self, server: ExchangeProcess, batches, versions, stored: set[int]):
        super().__init__(name="crash-trainer", daemon=True)
        self.server, self.batches, self.versions, self.stored = server, batches, versions, stored
        self.acked_batches: list[int] = []
        self.acked_versions: list[int] = []
        self.failure: list[BaseException] = []

    def run(self) -> None:
        # No client retries: once the exchange dies this trainer stops, like a crashed one.
        with self.server.trainer(retries=0) as trainer:
            try:
                for b, batch in enumerate(self.batches):
                    if b in self.versions:
                        trainer.publish_policy(self.versions[b], quorum=1)
                        self.acked_versions.append(self.versions[b].policy_version)
                    receipts = trainer.enqueue(batch)
                    assert [r.job_id for r in receipts] == [j.job_id for j in batch]
                    # A batch stored before the last crash is recognised, not created again.
                    assert all(r.created == (b not in self.stored) for r in receipts), (b, receipts[:2])
                    self.acked_batches.append(b)
            except BaseException as exc:  # noqa: BLE001 - judged by the test
                self.failure.append(exc)


def test_sigkill_while_trainer_enqueues_then_resend_creates_no_duplicates(start_exchange):
    server: ExchangeProcess = start_exchange("--reaper-interval-s", "0.2")
    n_batches, batch_size, every = 60, 150, 4
    batches = [[job(b * batch_size + i, version=0) for i in range(batch_size)] for b in range(n_batches)]
    versions = {b: policy(b // every) for b in range(0, n_batches, every)}
    key_of = {j.idempotency_key: b for b, batch in enumerate(batches) for j in batch}

    stored: set[int] = set()
    history = []
    for _ in range(TRAINER_KILLS):
        trainer = CrashingTrainer(server, batches, versions, stored)
        trainer.start()
        target = len(stored) + 3  # past what is already stored: new batches are being written
        wait_for(lambda t=trainer, n=target: len(t.acked_batches) >= n or not t.is_alive(), 60,
                 "the trainer to stream")
        server.kill()  # SIGKILL with the trainer's next publish or enqueue in flight
        trainer.join(30)
        assert not trainer.is_alive()
        assert len(trainer.failure) == 1 and isinstance(trainer.failure[0], ExchangeUnavailable), \
            f"the kill should have cut the trainer off mid-stream, got {trainer.failure!r}"
        server.start()

        # Each batch is all-or-nothing; every acknowledged batch and version survived. The batch
        # or version in flight at the kill may be committed with its answer lost; nothing later.
        with open_ro(server.db) as conn:
            assert_integrity(conn)
            count = Counter(key_of[r[0]] for r in conn.execute("SELECT idempotency_key FROM jobs"))
            stored_versions = [r[0] for r in conn.execute("SELECT version FROM policies ORDER BY version")]
        for b, batch in enumerate(batches):
            assert count[b] in (0, len(batch)), f"batch {b} is half stored: {count[b]} of {len(batch)}"
        now_stored = sorted(count)
        acked, acked_versions = trainer.acked_batches, trainer.acked_versions
        assert now_stored[:len(acked)] == acked, "an acknowledged batch was lost"
        assert len(now_stored) - len(acked) in (0, 1) and now_stored == list(range(len(now_stored))), now_stored
        assert stored_versions[:len(acked_versions)] == acked_versions, "an acknowledged version was lost"
        assert len(stored_versions) - len(acked_versions) in (0, 1), stored_versions
        history.append((len(acked), len(now_stored)))
        stored = set(now_stored)
    print(f"(acked, stored) batches at each kill: {history}")

    # Re-send everything, twice: the first pass creates exactly what was missing, the second nothing.
    with server.trainer(retries=8) as trainer:
        for resend in range(2):
            for b, batch in enumerate(batches):
                if b in versions:
                    trainer.publish_policy(versions[b], quorum=1)
                receipts = trainer.enqueue(batch)
                assert [r.job_id for r in receipts] == [j.job_id for j in batch]
                expect_created = resend == 0 and b not in stored
                assert all(r.created == expect_created for r in receipts), (resend, b)
        published = [p.policy_version for p in trainer.policies()]
        assert published == sorted(v.policy_version for v in versions.values())

    total = n_batches * batch_size
    with open_ro(server.db) as conn:
        assert_integrity(conn)
        counts = conn.execute("SELECT COUNT(*), COUNT(DISTINCT idempotency_key) FROM jobs").fetchone()
        assert tuple(counts) == (total, total)
        assert conn.execute("SELECT COUNT(*) FROM audit WHERE kind = 'job.enqueued'").fetchone()[0] == total
        assert conn.execute(
            "SELECT COUNT(*) FROM audit WHERE kind = 'policy.published'").fetchone()[0] == len(versions)
        assert {r[0] for r in conn.execute("SELECT state FROM jobs")} == {"queued"}
        digests = dict(conn.execute("SELECT version, digest FROM policies").fetchall())
    assert digests == {v.policy_version: sha(f"ckpt-{v.policy_version}") for v in versions.values()}
