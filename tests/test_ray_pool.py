"""A Ray worker pool on a real exchange: a local Ray head on loopback, `rollmarket pool` keeps
workers alive as actors (sampling from one `rollmarket serve-model` of the tiny MoE) while actors
are killed -9 at a rate (spot preemption), and the pool is scaled up and down while it runs.

The books come from the exchange's own database and audit log, not from the pool: every job done
with exactly one group, every lease a killed actor held given back (abandoned or expired) and its
job requeued and then done by another worker, the killed workers dead on the exchange and their
slots refilled under new worker ids, and the pool's size on the exchange following `pool scale`.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from helpers import TRAINER_TOKEN, ExchangeProcess, rollmarket_command, served_model
from ray_cluster import LOOPBACK_ENV, RayHead
from test_worker import MOE, jobs, policy

POOL = "spot"
BATCH = 4
KILLS = 3


def wait_until(what: str, check, timeout: float = 120.0, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout}s")


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    done = subprocess.run(rollmarket_command(*args), capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **LOOPBACK_ENV})
    assert done.returncode == 0, done.stderr
    return done


def pool_workers(db: Path) -> list[sqlite3.Row]:
    """The exchange's worker rows of the pool, read from its database (the manifest names the pool)."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    try:
        return [r for r in conn.execute("SELECT worker_id, status, manifest FROM workers")
                if json.loads(r["manifest"]).get("pool") == POOL]
    finally:
        conn.close()


def alive(db: Path) -> set[str]:
    return {r["worker_id"] for r in pool_workers(db) if r["status"] == "alive"}


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    head = RayHead(tmp_path_factory.mktemp("ray") / "ray.log").start()
    yield head
    import ray

    ray.shutdown()
    head.stop()


@pytest.mark.slow
def test_a_ray_pool_survives_preemption_and_scales(ray_head, tmp_path):
    from rollmarket.exchange.market import market_report, open_readonly
    from rollmarket.worker.pool import pool_report

    exchange = ExchangeProcess(tmp_path / "ex.db", tmp_path / "ex.log", args=[
        "--lease-ttl-s", "4", "--heartbeat-ttl-s", "2", "--reaper-interval-s", "0.2"]).start()
    trainer = exchange.trainer()
    trainer.publish_policy(policy(0, MOE))
    address = ray_head.address
    view = open(tmp_path / "pool.out", "w+")
    foreground = None
    try:
        with served_model(MOE, tmp_path / "model.log") as model_url:
            foreground = subprocess.Popen(rollmarket_command(
                "pool", "--ray", address, "--name", POOL, "--workers", "2", "--num-cpus", "0.5",
                "--model-url", model_url, "--exchange", exchange.url, "--heartbeat-s", "0.4",
                "--lease-wait-s", "1", "--drain-s", "20"), stdout=view, stderr=subprocess.STDOUT,
                env={**os.environ, **LOOPBACK_ENV})
            wait_until("2 pool workers alive on the exchange", lambda: len(alive(exchange.db)) == 2)
            enqueued = 0

            def feed() -> None:
                """Keep work waiting, so that there is always a lease to preempt, however fast the box."""
                nonlocal enqueued
                if len(trainer.jobs(state="queued", limit=500)) < BATCH:
                    trainer.enqueue(jobs(0, BATCH, start=enqueued, max_tokens=32))
                    enqueued += BATCH

            # Spot preemption: kill -9 the process of an actor that holds a lease, once per refilled slot.
            killed: list[str] = []
            while len(killed) < KILLS:
                busy = wait_until("a pool worker holding a lease", lambda: feed() or [
                    w for w in trainer.workers() if w.pool == POOL and w.status == "alive" and w.active_leases
                    and w.worker_id not in killed], timeout=180)
                report = pool_report(address, POOL)
                slot = next((s for s in report.slots if s.worker_id == busy[0].worker_id and s.pid), None)
                if slot is None:  # not yet answered the supervisor: look again
                    time.sleep(0.2)
                    continue
                os.kill(slot.pid, signal.SIGKILL)
                killed.append(slot.worker_id)
                wait_until("the slot refilled", lambda: any(
                    s.slot == slot.slot and s.worker_id != slot.worker_id for s in pool_report(address, POOL).slots))


            # Scale up, then down while every worker holds a lease: the exchange sees the pool's size
            # follow, and the workers scaled away hand their leases back.
            cli("pool", "scale", POOL, "3", "--ray", address)
            wait_until("3 pool workers alive", lambda: len(alive(exchange.db)) == 3)
            shown_status = cli("exchange", "status", "--url", exchange.url, "--token", TRAINER_TOKEN).stdout
            assert f"pools (alive workers): {POOL} 3" in shown_status, shown_status
            wait_until("every pool worker holding a lease", lambda: feed() or sum(
                1 for w in trainer.workers() if w.pool == POOL and w.status == "alive" and w.active_leases) == 3)
            # Work stays queued while the command starts (seconds on a loaded box), so the workers it
            # drains are mid-lease when the stop reaches them, not idle on an empty queue.
            scaling = subprocess.Popen(rollmarket_command("pool", "scale", POOL, "1", "--ray", address),
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       env={**os.environ, **LOOPBACK_ENV})
            wait_until("pool scale 1 returned", lambda: feed() or scaling.poll() is not None)
            assert scaling.returncode == 0, scaling.stderr.read()
            wait_until("1 pool worker alive", lambda: len(alive(exchange.db)) == 1)
            wait_until("every job done", lambda: len(trainer.jobs(state="done", limit=500)) == enqueued, timeout=300)
            report = pool_report(address, POOL)
            status = json.loads(cli("pool", "status", POOL, "--ray", address, "--json").stdout)
            foreground.send_signal(signal.SIGINT)  # Ctrl-C: the command drains and stops its pool
            assert foreground.wait(90) == 0
            wait_until("no pool worker alive", lambda: not alive(exchange.db))
            view.seek(0)
            shown = view.read()
        summaries = {w.worker_id: w.pool for w in trainer.workers()}
    finally:
        if foreground is not None and foreground.poll() is None:  # a failed check must not leave the command running
            foreground.kill()
        view.close()
        exchange.stop()

    # The live view showed the pool, and Ctrl-C stopped it.
    assert f"pool {POOL}: " in shown and f"pool {POOL} stopped after {KILLS} restarts" in shown, shown[-2000:]
    # The supervisor restarted each killed actor, under a new id.
    died = [e.worker_id for e in report.events if e.kind == "died"]
    assert sorted(died) == sorted(killed) and report.restarts == KILLS
    assert report.target == 1 and status["target"] == 1 and len(status["slots"]) == 1

    conn = sqlite3.connect(exchange.db)
    conn.row_factory = sqlite3.Row
    groups = Counter(r["job_id"] for r in conn.execute("SELECT job_id FROM groups"))
    states = Counter(r["state"] for r in conn.execute("SELECT state FROM jobs"))
    audit = [dict(r) | {"data": json.loads(r["data"])} for r in conn.execute(
        "SELECT kind, actor, subject, data FROM audit ORDER BY seq")]
    workers = {r["worker_id"]: r for r in pool_workers(exchange.db)}

    # Every job done, each with exactly one group: nothing lost, nothing duplicated.
    assert enqueued >= BATCH and states == {"done": enqueued}
    assert len(groups) == enqueued and set(groups.values()) == {1}

    # Every lease a killed worker held and did not submit was given back and its job requeued.
    submitted = {r["lease_id"] for r in conn.execute("SELECT lease_id FROM groups")}
    given_back = {e["subject"]: e["kind"] for e in audit if e["kind"] in ("lease.abandoned", "lease.expired")}
    requeued = {e["data"]["lease_id"] for e in audit if e["kind"] == "job.requeued"}
    orphaned = [e["subject"] for e in audit if e["kind"] == "lease.issued" and e["actor"] in killed
                and e["subject"] not in submitted]
    assert orphaned, "no killed actor held a lease when it died"
    assert all(lease in given_back and lease in requeued for lease in orphaned)
    done_by = {r["job_id"]: r["worker_id"] for r in conn.execute("SELECT job_id, worker_id FROM groups")}
    for event in audit:
        if event["subject"] in orphaned and event["kind"] in ("lease.abandoned", "lease.expired"):
            assert done_by[event["data"]["job_id"]] != event["data"]["worker_id"]
    for worker_id in killed:
        assert workers[worker_id]["status"] == "dead"

    # The 2 workers scaled away gave their leases back at once (cancelled, requeued), none left to expire.
    drained = {e.worker_id for e in report.events if e.kind == "drained"}
    assert len(drained) == 2 and not drained & set(killed)
    handed_back = [e for e in audit if e["kind"] == "lease.failed" and e["data"]["worker_id"] in drained]
    assert handed_back, "no worker scaled away was holding a lease"
    assert all(e["data"]["kind"] == "cancelled" and e["subject"] in requeued for e in handed_back)
    assert not [e for e in audit if e["kind"] in ("lease.abandoned", "lease.expired")
                and e["data"]["worker_id"] in drained]
    # Pool workers registered: 2 at the start, one per restart, one for the scale-up.
    assert len(workers) == 2 + KILLS + 1
    # The exchange's worker summaries and the marketplace report name the pool.
    assert {w for w, pool in summaries.items() if pool == POOL} == set(workers)
    market = market_report(open_readonly(exchange.db), time.time())
    assert {w.worker_id for w in market.workers if w.pool == POOL} == set(workers)


@pytest.mark.slow
def test_a_crashing_pool_backs_off_and_names_are_checked(ray_head, tmp_path):
    """Workers that cannot start (no model server at the URL) are restarted after a growing backoff,
    not in a tight loop; a taken name, and a pool that is not there, are one-line errors."""
    from rollmarket.localhost import free_port
    from rollmarket.worker.pool import pool_report

    address, name = ray_head.address, "crashy"
    nowhere = f"http://127.0.0.1:{free_port()}"
    start = ("pool", "--ray", address, "--name", name, "--workers", "1", "--num-cpus", "0.25", "--detach",
             "--model-url", nowhere + "/v1", "--exchange", nowhere)
    cli(*start)
    taken = subprocess.run(rollmarket_command(*start), capture_output=True, text=True, timeout=120,
                           env={**os.environ, **LOOPBACK_ENV})
    assert taken.returncode == 1
    assert taken.stderr.strip().splitlines()[-1] == (
        f"error: a pool named '{name}' already runs on {address} — pick another --name, or "
        "`rollmarket pool stop NAME` first")

    report = wait_until("two restarts", lambda: (r := pool_report(address, name)).restarts >= 2 and r, timeout=120)
    assert report.target == 1
    events = list(report.events)
    for i, event in enumerate(events):
        if event.kind != "died":
            continue
        assert "could not start: rollmarket.worker.host.HostError" in event.detail, event
        assert "restart in" in event.detail, event
        delay = float(event.detail.rsplit("restart in ", 1)[1].rstrip("s)"))
        successor = next((e for e in events[i + 1:] if e.kind == "restarted" and e.slot == event.slot), None)
        if successor is not None:
            assert successor.at - event.at >= delay - 0.05, (event, successor)
    delays = [float(e.detail.rsplit("restart in ", 1)[1].rstrip("s)")) for e in events if e.kind == "died"]
    assert delays[:2] == [0.5, 1.0]

    cli("pool", "stop", name, "--ray", address, "--drain-s", "5")
    gone = subprocess.run(rollmarket_command("pool", "status", name, "--ray", address), capture_output=True,
                          text=True, timeout=120, env={**os.environ, **LOOPBACK_ENV})
    assert gone.returncode == 1
    assert gone.stderr.strip().splitlines()[-1].startswith(f"error: no pool named '{name}' runs on {address} — ")


def test_without_ray_the_pool_names_the_extra(tmp_path):
    """`ray` is an extra: without it `rollmarket pool` says which one to install, in one line."""
    blocked = tmp_path / "no_ray"
    blocked.mkdir()
    (blocked / "ray.py").write_text("raise ImportError('ray is not installed here')\n")
    done = subprocess.run(rollmarket_command("pool", "status", "p", "--ray", "127.0.0.1:1"), capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(blocked)})
    assert done.returncode == 1
    assert done.stderr.strip() == "error: Ray worker pools need Ray: pip install 'rollmarket[ray]'"


def test_no_cluster_at_the_address_is_one_line():
    from rollmarket.localhost import free_port

    address = f"127.0.0.1:{free_port()}"
    done = subprocess.run(rollmarket_command("pool", "status", "p", "--ray", address), capture_output=True,
                          text=True, timeout=60, env={**os.environ, **LOOPBACK_ENV})
    assert done.returncode == 1
    assert done.stderr.strip() == (f"error: no Ray cluster answers at {address} — is the Ray cluster up "
                                   "(`ray status --address HOST:PORT`)?")
