"""Several exchange replicas on one PostgreSQL database (docs/deploy.md).

What these tests protect:

* **Replicas keep no state a request depends on.** A worker registered through one replica is
  accepted by another (and a forged secret still refused); a lease request
  waiting on one replica gets work enqueued through another within the re-check interval.
* **A database outage is a 503** (`store_unavailable`), which clients retry and fail over on.
* **Chaos: nothing acknowledged is lost, nothing happens twice.** Three replicas, sixteen worker
  processes (tests/crash_worker.py: each fsyncs a line per 200 receipt, and is given the three
  URLs starting at a different replica) and a trainer that enqueues and fetches through the URL
  list. Mid-stream the leader replica is SIGKILLed, PostgreSQL is restarted, and later SIGKILLed
  and started again. Then, read straight from PostgreSQL: every acknowledged group is stored
  with the content hash its receipt named, no job and no lease has two groups, every enqueue the
  trainer had acknowledged is stored once, no job was ever leased to two workers at once (from
  the audit log: a `lease.issued` while an earlier lease of the job had not ended), and
  leadership moved to a surviving replica (its /healthz and `pg_locks`).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx
import psycopg
import pytest

from helpers import TRAINER_TOKEN, ExchangeProcess, job, manifest, policy, sha
from postgres import Cluster
from rollmarket import TrainerClient, WorkerClient
from rollmarket.client import ExchangeUnavailable, ServerError, Unauthorized
from rollmarket.client.errors import error_for
from rollmarket.contracts import Tier
from rollmarket.exchange.app import create_app
from rollmarket.exchange.settings import ExchangeSettings
from rollmarket.exchange.stores import postgres as pg_store
from test_crash import Workers, wait_for
from test_leader import lock_holders

REPLICA_ARGS = ("--reaper-interval-s", "0.2", "--lease-ttl-s", "5", "--leader-retry-s", "0.2",
                "--work-recheck-s", "0.2", "--heartbeat-ttl-s", "600")


def replicas(url: str, tmp_path: Path, n: int) -> list[ExchangeProcess]:
    """`n` exchange processes on the PostgreSQL database `url`, each on its own port."""
    started = []
    for i in range(n):
        started.append(ExchangeProcess(db=url, log=tmp_path / f"replica{i}.log", args=list(REPLICA_ARGS)).start())
    return started


def health(replica: ExchangeProcess) -> dict | None:
    try:
        return httpx.get(replica.url + "/healthz", timeout=5).json()
    except httpx.HTTPError:
        return None


def leaders(servers: list[ExchangeProcess]) -> list[ExchangeProcess]:
    return [s for s in servers if (health(s) or {}).get("leader")]


# -- stateless replicas -----------------------------------------------------------------------
def test_a_worker_registered_on_one_replica_works_on_another(postgres_url, tmp_path):
    r1, r2 = replicas(postgres_url, tmp_path, 2)
    try:
        # One leader, and /healthz and the Prometheus gauge agree on which.
        wait_for(lambda: leaders([r1, r2]), 30, "a leader")
        gauges = [httpx.get(r.url + "/metrics").text for r in (r1, r2)]
        assert sorted(g.count("\nrollmarket_exchange_leader 1.0") for g in gauges) == [0, 1]
        assert [bool(health(r)["leader"]) for r in (r1, r2)] == [
            "\nrollmarket_exchange_leader 1.0" in g for g in gauges]
        assert len(lock_holders(postgres_url)) == 1
        with TrainerClient(r1.url, TRAINER_TOKEN) as trainer:
            trainer.publish_policy(policy(0))
        first = WorkerClient(r1.url)
        first.register(manifest("w-roam"))
        on_r2 = WorkerClient(r2.url, first.http.token, manifest=first.manifest)
        on_r2.ack_reload(0, sha("ckpt-0"))  # r2 never saw this token: it re-reads the store
        on_r2.heartbeat()
        # A wrong secret for the same worker is still refused after the re-read.
        forged = WorkerClient(r2.url, first.http.token[:-4] + "AAAA", manifest=first.manifest)
        with pytest.raises(Unauthorized):
            forged.heartbeat()
        # A long poll on r2 wakes for a job enqueued through r1 (no event crosses processes).
        answer: dict = {}
        waiter = threading.Thread(target=lambda: answer.update(grant=on_r2.lease(wait_s=20),
                                                               at=time.monotonic()))
        waiter.start()
        time.sleep(1.0)  # the request is waiting on r2 by now (and if not, it leases at once)
        enqueued_at = time.monotonic()
        with TrainerClient(r1.url, TRAINER_TOKEN) as trainer:
            trainer.enqueue(job(7))
        waiter.join(30)
        assert answer["grant"].lease is not None
        assert answer["at"] - enqueued_at < 10, "the waiting lease did not see the other replica's job"
        for client in (first, on_r2, forged):
            client.close()
    finally:
        r1.stop()
        r2.stop()


# -- chaos --------------------------------------------------------------------------------------
N_REPLICAS = 3
N_WORKERS = 16
GROUP_SIZE = 2
TOKENS = 32
BATCH = 40
N_BATCHES = 30
PER_PHASE = 25  # acknowledged submissions to wait for before each blow and after the last one


class Trainer(threading.Thread):
    """Enqueues batches through the URL list (re-sending one until acknowledged: idempotency keys
    make that safe) and fetches fresh groups, recording what was acknowledged and served."""

    def __init__(self, urls: list[str], batches):
        super().__init__(daemon=True)
        self.client = TrainerClient(urls, TRAINER_TOKEN, trainer_id="chaos", retries=8)
        self.batches = batches
        self.enqueued: list[str] = []
        self.fetched: list[str] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            pending = list(self.batches)
            while not self.stop.is_set():
                if pending:
                    try:
                        receipts = self.client.enqueue(pending[0])
                    except (ExchangeUnavailable, ServerError):
                        time.sleep(0.2)
                        continue
                    self.enqueued += [r.job_id for r in receipts]
                    pending.pop(0)
                try:
                    self.fetched += [f.group.group_id for f in self.client.fetch(limit=64).groups]
                except (ExchangeUnavailable, ServerError):
                    pass
                self.stop.wait(0.3)
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.client.close()


def overlapping_leases(audit_rows) -> list[tuple[str, str, str]]:
    """(job, lease still live, lease issued over it) from audit rows (seq, kind, subject, data)
    in seq order: a lease lives from `lease.issued` to its group (`group.accepted`) or its end
    (`lease.expired`, `lease.abandoned`, `lease.failed`)."""
    live: dict[str, set[str]] = defaultdict(set)
    job_of: dict[str, str] = {}
    overlaps = []
    for _, kind, subject, data in audit_rows:
        data = json.loads(data)
        if kind == "lease.issued":
            if live[data["job_id"]]:
                overlaps += [(data["job_id"], other, subject) for other in live[data["job_id"]]]
            live[data["job_id"]].add(subject)
            job_of[subject] = data["job_id"]
        elif kind in ("lease.expired", "lease.abandoned", "lease.failed"):
            live[job_of.get(subject, data.get("job_id"))].discard(subject)
        elif kind == "group.accepted":
            live[data["job_id"]].discard(data["lease_id"])
    return overlaps


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_chaos_three_replicas_sixteen_workers_kill_and_restart(tmp_path):
    with Cluster() as cluster:
        url = cluster.create_database("chaos")
        servers = replicas(url, tmp_path, N_REPLICAS)
        urls = [s.url for s in servers]
        rotated = [",".join(urls[i % N_REPLICAS:] + urls[:i % N_REPLICAS]) for i in range(N_WORKERS)]
        with TrainerClient(urls, TRAINER_TOKEN) as setup:
            setup.publish_policy(policy(0))
        batches = [[job(b * BATCH + i, group_size=GROUP_SIZE) for i in range(BATCH)] for b in range(N_BATCHES)]
        trainer = Trainer(urls, batches)
        out = tmp_path / "workers"
        out.mkdir()
        workers = Workers(rotated, out, N_WORKERS, tokens=TOKENS)
        blows = []
        try:
            trainer.start()
            wait_for(workers.ready, 180, "16 workers to register and ack the policy")
            workers.wait_acked(PER_PHASE, 120, "submissions to stream")

            # 1. kill -9 the leader replica: another takes the lock.
            leader = wait_for(lambda: leaders(servers), 30, "a leader")
            assert len(leader) == 1, [s.url for s in leader]
            leader[0].kill()
            survivors = [s for s in servers if s is not leader[0]]
            new_leader = wait_for(lambda: leaders(survivors), 30, "a surviving replica to lead")
            assert len(new_leader) == 1
            blows.append(("leader killed", len(workers.acked())))
            workers.wait_acked(len(workers.acked()) + PER_PHASE, 120, "the stream to go on on two replicas")

            # 2. PostgreSQL restarts; 3. PostgreSQL is SIGKILLed and started again.
            for blow, outage in (("postgres restarted", cluster.restart),
                                 ("postgres killed", lambda: (cluster.kill(), cluster.start()))):
                outage()
                blows.append((blow, len(workers.acked())))
                workers.wait_acked(len(workers.acked()) + PER_PHASE, 180, f"the stream after: {blow}")
            wait_for(lambda: len(leaders(survivors)) == 1, 30, "one leader after the restarts")
            trainer.stop.set()
            trainer.join(60)
            codes = workers.stop(timeout=90)
        finally:
            trainer.stop.set()
            workers.kill()
        assert trainer.error is None, repr(trainer.error)
        assert trainer.enqueued and trainer.fetched, "the trainer neither enqueued nor fetched through the blows"
        assert codes == [0] * N_WORKERS, f"worker exit codes {codes}\n{workers.logs()}"

        acked, refused = workers.acked(), workers.refused()
        interrupted = Counter(k for r in acked + refused for k, n in r["interrupted"].items() for _ in range(n))
        print(f"blows {blows}; acked {len(acked)}, duplicate receipts {sum(r['duplicate'] for r in acked)}, "
              f"refused {len(refused)}, transport errors under submit {dict(interrupted)}, "
              f"enqueued {len(trainer.enqueued)}, fetched {len(trainer.fetched)}")
        for r in refused:  # only leases that ended while their worker could not submit
            assert set(r["reasons"]) <= {"expired_lease", "lease_not_active"}, r
        acked_ids = Counter(r["group_id"] for r in acked)
        assert max(acked_ids.values()) == 1, "a worker was acknowledged twice for one group"

        with psycopg.connect(url, autocommit=True) as conn:
            stored = {row[0]: row for row in conn.execute(
                "SELECT group_id, lease_id, job_id, content_hash FROM groups")}
            per_lease = conn.execute("SELECT lease_id FROM groups GROUP BY lease_id HAVING COUNT(*) > 1").fetchall()
            per_job = conn.execute("SELECT job_id FROM groups GROUP BY job_id HAVING COUNT(*) > 1").fetchall()
            jobs = {row[0]: row[1] for row in conn.execute("SELECT job_id, idempotency_key FROM jobs")}
            audit = conn.execute("SELECT seq, kind, subject, data FROM audit WHERE kind IN "
                                 "('lease.issued', 'lease.expired', 'lease.abandoned', 'lease.failed',"
                                 " 'group.accepted') ORDER BY seq").fetchall()
        lost = [g for g in acked_ids if g not in stored]
        assert not lost, f"{len(lost)} of {len(acked_ids)} acknowledged groups are missing"
        for r in acked:
            assert stored[r["group_id"]][3] == r["content_hash"] == r["sent_hash"], r
            assert stored[r["group_id"]][1] == r["lease_id"], r
        assert not per_lease and not per_job, (per_lease, per_job)
        assert set(trainer.fetched) <= set(stored)
        sent = {j.job_id: j.idempotency_key for batch in batches for j in batch}
        assert len(trainer.enqueued) == len(set(trainer.enqueued)), "a batch acknowledged twice"
        assert all(jobs.get(job_id) == sent[job_id] for job_id in trainer.enqueued), "an acknowledged job is missing"
        assert set(jobs) <= set(sent), "a job nobody sent"
        overlaps = overlapping_leases(audit)
        assert not overlaps, f"jobs leased twice at once: {overlaps[:5]}"
        assert len(lock_holders(url)) == 1
        # Fetching through the API serves only stored, hash-checked groups (IntegrityError otherwise).
        with TrainerClient(urls, TRAINER_TOKEN, trainer_id="chaos-check") as reader:
            served = [f.group.group_id for t in Tier for f in reader.fetch(tier=t, include_served=True,
                                                                          limit=1024).groups]
        assert sorted(served) == sorted(stored)
        for server in servers:
            server.stop()


def test_postgres_down_answers_503_store_unavailable(monkeypatch):
    """A replica whose database is gone answers 503 `store_unavailable` (not 500): clients retry a
    503 and fail over on it (tests/test_client_retries.py), and type it as ExchangeUnavailable."""
    monkeypatch.setattr(pg_store, "UNAVAILABLE_RETRY_S", 1.0)  # the store's wait for PostgreSQL to return
    with Cluster() as cluster:
        url = cluster.create_database("down")
        app = create_app(ExchangeSettings(db=url, trainer_token=TRAINER_TOKEN))
        exchange = app.state.exchange

        async def scenario():
            await exchange.start()
            try:
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://replica",
                                             headers={"authorization": f"Bearer {TRAINER_TOKEN}"}) as http:
                    assert (await http.get("/v1/pool")).status_code == 200
                    await asyncio.to_thread(cluster.stop)
                    answer = await http.get("/v1/pool")
                    return answer.status_code, answer.json()
            finally:
                await exchange.stop()

        status, body = asyncio.run(scenario())
    assert status == 503 and body["error"]["code"] == "store_unavailable", body
    assert isinstance(error_for(status, body), ExchangeUnavailable)
