"""What only the PostgreSQL store promises beyond the shared contract (test_store_contract.py):
several processes on one database, migrations under a lock, typed errors for a bad URL or a server
that is down, waiting out a restart of PostgreSQL, and `rollmarket exchange serve --db postgresql://…`.
Counts are read straight from the database with psycopg, not from the store under test.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading

import psycopg
import pytest

from helpers import ExchangeProcess, job, policy, ready_worker, trajectories
from rollmarket import TrainerClient
from rollmarket.exchange import ExchangeSettings
from rollmarket.exchange.store import StoreError
from rollmarket.exchange.stores import check_store, open_store
from rollmarket.exchange.stores.postgres import migrations
from test_store_contract import T0, Driver, published


def rows(url: str, sql: str) -> list[tuple]:
    with psycopg.connect(url) as conn:
        return conn.execute(sql).fetchall()


def test_replicas_that_open_together_migrate_once(postgres_url):
    """…and the settings they record name the database without its password (the throwaway
    cluster trusts loopback, so any password connects)."""
    with_password = postgres_url.replace("postgres@", "postgres:hunter2@")
    drivers: list[Driver] = []
    errors: list[BaseException] = []

    def open_one():
        try:
            drivers.append(Driver(with_password))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert errors == []
        assert rows(postgres_url, "SELECT version FROM schema_version ORDER BY version") == [
            (version,) for version, _, _ in migrations()]
        assert rows(postgres_url, "SELECT COUNT(*) FROM audit WHERE kind = 'exchange.started'") == [(4,)]
        recorded = rows(postgres_url, "SELECT data FROM audit UNION ALL SELECT value FROM meta")
        assert recorded and not any("hunter2" in row[0] for row in recorded)
        assert any(with_password.replace("hunter2", "***") in row[0] for row in recorded)
    finally:
        for driver in drivers:
            driver.close()


def test_two_replicas_never_lease_a_job_twice_and_store_one_group(postgres_url):
    """Two stores (two connection pools, as two exchange processes have) on one database, each
    driven from its own thread and event loop at the same time."""
    first, second = Driver(postgres_url), Driver(postgres_url)
    try:
        published(first)
        workers = [f"w{i}" for i in range(6)]
        for worker_id in workers:
            first.ready(worker_id, max_concurrent_groups=8)
        first.run(first.store.enqueue([job(i) for i in range(20)], T0))
        grants: list = []

        def rush(driver: Driver):
            async def leases():
                return await asyncio.gather(*(driver.store.lease(w, T0 + 1) for w in workers * 4))
            grants.extend(g for g in driver.run(leases()) if g.lease is not None)

        threads = [threading.Thread(target=rush, args=(d,)) for d in (first, second)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(grants) == 20
        assert rows(postgres_url, "SELECT COUNT(DISTINCT job_id), COUNT(*) FROM leases") == [(20, 20)]
        assert rows(postgres_url, "SELECT state, COUNT(*) FROM jobs GROUP BY state") == [("leased", 20)]

        group = first.group(grants[0])
        outcomes: list = []

        def submit(driver: Driver):
            async def twice():
                return await asyncio.gather(*(driver.store.submit(group, b"payload", [], T0 + 2) for _ in "ab"))
            outcomes.extend(driver.run(twice()))

        threads = [threading.Thread(target=submit, args=(d,)) for d in (first, second)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(o.receipt.duplicate for o in outcomes) == [False, True, True, True]
        assert rows(postgres_url, "SELECT group_id FROM groups") == [(group.group_id,)]
        assert rows(postgres_url, "SELECT COUNT(*) FROM audit WHERE kind = 'group.accepted'") == [(1,)]
    finally:
        first.close()
        second.close()


def test_replicas_reaping_at_once_end_each_lease_once(postgres_url):
    """Every replica reaps at start (and B's leader election aside, two may overlap): the rows
    are locked and re-read, so a lease expires once and its job is requeued once."""
    first, second = Driver(postgres_url), Driver(postgres_url)
    try:
        published(first)
        for worker_id in ("w1", "w2", "w3"):
            first.ready(worker_id, max_concurrent_groups=4)
        first.run(first.store.enqueue([job(i) for i in range(9)], T0))
        for worker_id in ("w1", "w2", "w3"):
            for _ in range(3):
                assert first.lease(worker_id).lease is not None
        results: list = []

        def reap(driver: Driver):
            results.append(driver.run(driver.store.reap(T0 + 1 + 60.0)))

        threads = [threading.Thread(target=reap, args=(d,)) for d in (first, second)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        expired = [lease_id for r in results for lease_id in r.expired_leases]
        assert len(expired) == len(set(expired)) == 9
        assert rows(postgres_url, "SELECT kind, COUNT(*) FROM audit WHERE kind IN ('lease.expired', 'job.requeued')"
                                  " GROUP BY kind ORDER BY kind") == [("job.requeued", 9), ("lease.expired", 9)]
        assert rows(postgres_url, "SELECT state, attempts, COUNT(*) FROM jobs GROUP BY state, attempts") == [
            ("queued", 1, 9)]
    finally:
        first.close()
        second.close()


def test_a_bad_url_or_a_server_that_is_down_is_a_typed_error(pg_cluster):
    down = f"postgresql://someone:secret@127.0.0.1:{pg_cluster.port + 1}/nothing"
    with pytest.raises(StoreError) as refused:
        check_store(down)
    assert "cannot connect" in str(refused.value) and "secret" not in str(refused.value)
    with pytest.raises(StoreError) as bad:
        check_store("postgresql://127.0.0.1:5432/db?nonsense_option=1")
    assert "secret" not in str(bad.value)
    store = open_store(down, ExchangeSettings(db=down))
    with pytest.raises(StoreError):
        asyncio.run(store.open({}, T0))


def test_without_psycopg_the_error_names_the_extra():
    code = ("import sys; sys.modules['psycopg'] = None\n"
            "from rollmarket.exchange.stores import check_store\n"
            "check_store('postgresql://127.0.0.1/x')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "StoreError" in done.stderr and "rollmarket[postgres]" in done.stderr


def test_the_store_waits_out_a_restart_of_postgresql():
    from postgres import Cluster

    with Cluster() as cluster:
        url = cluster.create_database()
        d = Driver(url)
        try:
            published(d)
            d.ready("w1", max_concurrent_groups=2)
            d.run(d.store.enqueue([job(0), job(1)], T0))
            first = d.lease("w1")
            cluster.kill()  # kill -9: the pool's connections die with it
            restarted = threading.Thread(target=cluster.start)
            restarted.start()
            second = d.lease("w1", now=T0 + 2)  # waits for the server, then succeeds
            restarted.join()
            assert {first.lease.job_id, second.lease.job_id} == {
                r[0] for r in rows(url, "SELECT job_id FROM jobs")}
            assert rows(url, "SELECT COUNT(*) FROM leases WHERE state = 'issued'") == [(2,)]
        finally:
            d.close()


def test_exchange_serve_on_postgresql(postgres_url, tmp_path):
    server = ExchangeProcess(db=postgres_url, log=tmp_path / "exchange.log").start()
    try:
        trainer = TrainerClient(server.url, "test-trainer-token")
        trainer.publish_policy(policy(0))
        worker = ready_worker(server.url, "w1")
        trainer.enqueue([job(0)])
        grant = worker.lease(wait_s=5)
        receipt = worker.submit(worker.group_for(grant, trajectories(grant.job.group_size)))
        assert rows(postgres_url, "SELECT group_id, tier FROM groups") == [(receipt.group_id, "fresh")]
        assert trainer.market().accepted_groups == 1
    finally:
        server.stop()


def test_exchange_serve_says_when_postgresql_is_unreachable(pg_cluster, tmp_path):
    url = f"postgresql://postgres@127.0.0.1:{pg_cluster.port + 1}/nothing"
    done = subprocess.run([sys.executable, "-m", "rollmarket", "exchange", "serve", "--db", url,
                           "--trainer-token", "t", "--port", "0"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "NO_COLOR": "1"})
    assert done.returncode == 1
    assert done.stderr.startswith("error: cannot connect to PostgreSQL") and "Traceback" not in done.stderr

