"""The exchange leader (exchange/leader.py): one replica per PostgreSQL database holds the advisory
lock and runs the reaper; when it dies — kill -9, or PostgreSQL restarts — another takes over.

Who holds the lock is read from PostgreSQL's own `pg_locks`, not from the leaders' word.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import httpx
import psycopg
import pytest

from helpers import job, manifest, policy, sha
from postgres import Cluster
from rollmarket.contracts import ReloadAck
from rollmarket.exchange.leader import LEADER_LOCK_KEY, AdvisoryLockLeader, SoleLeader, leadership_for
from rollmarket.exchange.service import Exchange
from rollmarket.exchange.settings import ExchangeSettings

pytestmark = pytest.mark.timeout(240)


def lock_holders(url: str) -> list[int]:
    """Backend pids that hold the leader lock, from pg_locks (a 64-bit key is split in two)."""
    unsigned = LEADER_LOCK_KEY & 0xFFFFFFFFFFFFFFFF
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
            "AND classid::bigint = %s AND objid::bigint = %s AND objsubid = 1",
            (unsigned >> 32, unsigned & 0xFFFFFFFF)).fetchall()
    return [row[0] for row in rows]


def leader_pids(url: str) -> list[int]:
    """Backend pids of the leaders' sessions, by application name."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute("SELECT pid FROM pg_stat_activity WHERE application_name = "
                            "'rollmarket-exchange-leader'").fetchall()
    return sorted(row[0] for row in rows)


async def until(condition, timeout_s: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def test_sqlite_is_always_leader(tmp_path):
    assert isinstance(leadership_for(tmp_path / "x.db"), SoleLeader)
    assert leadership_for(tmp_path / "x.db").is_leader
    assert isinstance(leadership_for("postgresql://postgres@127.0.0.1:1/x"), AdvisoryLockLeader)


def test_one_leader_and_takeover_on_stop(postgres_url):
    async def scenario():
        leaders = [AdvisoryLockLeader(postgres_url, retry_s=0.1) for _ in range(3)]
        for leader in leaders:
            await leader.start()
        await until(lambda: any(x.is_leader for x in leaders), what="a leader")
        await asyncio.sleep(0.5)  # several rounds of tries by the others
        assert sum(x.is_leader for x in leaders) == 1
        assert len(await asyncio.to_thread(lock_holders, postgres_url)) == 1
        first = next(x for x in leaders if x.is_leader)
        await first.stop()
        rest = [x for x in leaders if x is not first]
        await until(lambda: any(x.is_leader for x in rest), what="a new leader")
        await asyncio.sleep(0.5)
        assert sum(x.is_leader for x in rest) == 1 and not first.is_leader
        assert len(await asyncio.to_thread(lock_holders, postgres_url)) == 1
        for leader in rest:
            await leader.stop()
        assert await asyncio.to_thread(lock_holders, postgres_url) == []

    asyncio.run(scenario())


CONTENDER = """
import asyncio, sys
from rollmarket.exchange.leader import AdvisoryLockLeader
async def main():
    leader = AdvisoryLockLeader(sys.argv[1], retry_s=0.1)
    await leader.start()
    while not leader.is_leader:
        await asyncio.sleep(0.05)
    print("leader", flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


def test_kill_9_of_the_leader_hands_over(postgres_url):
    """A leader process killed with SIGKILL never lets go itself: PostgreSQL ends its session."""
    proc = subprocess.Popen([sys.executable, "-c", CONTENDER, postgres_url], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "leader"
        held_by = lock_holders(postgres_url)
        assert len(held_by) == 1

        async def scenario():
            other = AdvisoryLockLeader(postgres_url, retry_s=0.1)
            await other.start()
            await asyncio.sleep(0.5)
            assert not other.is_leader  # the child still holds it
            proc.send_signal(signal.SIGKILL)
            started = time.monotonic()
            await until(lambda: other.is_leader, timeout_s=30, what="takeover after kill -9")
            took = time.monotonic() - started
            holders = await asyncio.to_thread(lock_holders, postgres_url)
            assert holders and holders != held_by
            assert holders == await asyncio.to_thread(leader_pids, postgres_url)
            await other.stop()
            return took

        took = asyncio.run(scenario())
        assert took < 10, f"takeover took {took:.1f}s"
    finally:
        proc.kill()
        proc.wait()


def test_postgres_restart_and_kill_9_leadership_comes_back():
    """PostgreSQL restarts (and crashes): every session ends; the leader notices, lets go, and
    one replica leads again once the server is back."""
    with Cluster() as cluster:
        url = cluster.url()

        async def scenario():
            leaders = [AdvisoryLockLeader(url, retry_s=0.1, check_timeout_s=2) for _ in range(2)]
            for leader in leaders:
                await leader.start()
            await until(lambda: any(x.is_leader for x in leaders), what="a leader")
            for outage in (cluster.stop, cluster.kill):
                await asyncio.to_thread(outage)
                await until(lambda: not any(x.is_leader for x in leaders), timeout_s=30,
                            what="leadership dropped while PostgreSQL is down")
                await asyncio.to_thread(cluster.start)
                await until(lambda: any(x.is_leader for x in leaders), timeout_s=60, what="a leader again")
                await asyncio.sleep(0.5)
                assert sum(x.is_leader for x in leaders) == 1
                assert len(await asyncio.to_thread(lock_holders, url)) == 1
            for leader in leaders:
                await leader.stop()

        asyncio.run(scenario())


def test_a_sqlite_exchange_says_it_leads(exchange):
    assert httpx.get(exchange.url + "/healthz").json()["leader"] is True
    assert "\nrollmarket_exchange_leader 1.0" in httpx.get(exchange.url + "/metrics").text


class Switch:
    """A leadership the test turns on and off."""

    is_leader = False

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None


def test_only_the_leader_reaps(tmp_path):
    """A replica that does not lead leaves an expired lease alone; once it leads, its reaper ends it."""
    async def expired(exchange: Exchange) -> list:
        return (await exchange.audit(0, "lease.expired", None, 10)).events

    async def scenario():
        switch = Switch()
        exchange = Exchange(ExchangeSettings(db=tmp_path / "x.db", trainer_token="t", lease_ttl_s=0.2,
                                             reaper_interval_s=0.05, preference_hold_s=0), leadership=switch)
        await exchange.start()
        try:
            await exchange.publish(policy(0), 1)
            await exchange.register(manifest("w1"))
            await exchange.ack_reload("w1", ReloadAck(worker_id="w1", policy_version=0,
                                                      checkpoint_digest=sha("ckpt-0"), engine_fingerprint=sha("fp-w1")))
            await exchange.enqueue([job(0)])
            grant = await exchange.lease("w1", wait_s=5)
            assert grant.lease is not None
            await asyncio.sleep(1.5)  # 7 TTLs, 30 reaper intervals: a sweep here would have ended it
            assert await expired(exchange) == []
            switch.is_leader = True
            await until_async(lambda: expired(exchange), what="the leader's reaper to expire the lease")
            assert [e.subject for e in await expired(exchange)] == [grant.lease.lease_id]
        finally:
            await exchange.stop()

    asyncio.run(scenario())


async def until_async(fetch, timeout_s: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while not await fetch():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)
