"""A run's status on the runs index from the processes it recorded (`processes.jsonl`), not only
from how long its files have been quiet.

The live case is a real `rollmarket train` process against a real exchange with no workers: it
makes its run directory, publishes its policy and waits for groups that never come (running), then
is killed with SIGKILL while its files are still fresh: the index must say crashed at once, where
the files alone would say running for another 15 minutes. The other cases are processes of their
own (one that finishes its run, one that exits without a summary) and records written by hand for
what no process here can be (another host, a pid the system gave to a later process).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from fastapi.testclient import TestClient
from helpers import TRAINER_TOKEN, ExchangeProcess

from rollmarket.dashboard import create_dashboard_app
from rollmarket.runs import PROCESSES, read_processes, this_process

from training_fixture import write_training_run

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "models" / "tiny-moe")


def statuses(client: TestClient) -> dict[str, str]:
    return {e["run_id"]: e["status"] for e in client.get("/index.json").json()["entries"]}


def wait_for(condition, what: str, timeout: float = 180.0):
    """Poll `condition` until it returns something truthy (the machine is shared: no tight limits)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_killed_train_process_is_crashed_at_once(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    exchange = ExchangeProcess(db=tmp_path / "exchange.db", log=tmp_path / "exchange.log").start()
    log = open(tmp_path / "train.log", "wb")
    overrides = [f"model.path={json.dumps(MODEL)}", f"runs_root={json.dumps(str(runs))}", f"exchange.url={exchange.url}",
                 "rollout.suite=arithmetic", "rollout.groups_per_step=1", "rollout.group_size=2", "eval.tasks=0",
                 "loop.steps=2", "loop.fetch_timeout_s=600", "loop.quorum_timeout_s=600"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "ROLLMARKET_TRAINER_TOKEN": TRAINER_TOKEN}
    train = subprocess.Popen([sys.executable, "-m", "rollmarket", "train", *overrides], stdout=log,
                             stderr=subprocess.STDOUT, env=env)
    try:
        client = TestClient(create_dashboard_app(runs))
        # The run is listed once its config is written; by then it has recorded its process.
        run_id = wait_for(lambda: next(iter(statuses(client)), None), "the run directory")
        run_dir = runs / run_id
        assert [p.pid for p in read_processes(run_dir)] == [train.pid]
        assert statuses(client) == {run_id: "running"}
        train.send_signal(signal.SIGKILL)
        # Not reaped yet (a zombie) and its files written moments ago: still crashed.
        started = time.monotonic()
        wait_for(lambda: statuses(client) == {run_id: "crashed"}, "crashed after kill -9", timeout=30)
        print(f"crashed on the index {time.monotonic() - started:.2f} s after the kill")
        assert time.time() - max(f.stat().st_mtime for f in run_dir.iterdir()) < 15 * 60  # the files say fresh
        assert train.wait(timeout=30) == -signal.SIGKILL
        assert statuses(client) == {run_id: "crashed"}
    finally:
        if train.poll() is None:
            train.kill()
            train.wait()
        log.close()
        exchange.stop()


def test_a_finished_run_and_a_run_whose_process_exited(tmp_path):
    """Two real processes make their runs with `new_run_dir`: one writes summary.json (finished),
    the other exits without one (crashed at once, though its files are fresh)."""
    code = ("import json, sys; from rollmarket.runs import new_run_dir, write_json; d = new_run_dir(sys.argv[1]); "
            "write_json(d / 'config.json', {'config': {'loop': {'steps': 1}}}); "
            "sys.argv[2] == 'finish' and write_json(d / 'summary.json', {'steps': 1}); print(d.name)")
    names = {}
    for how in ("finish", "exit"):
        done = subprocess.run([sys.executable, "-c", code, str(tmp_path), how], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        names[how] = done.stdout.strip()
    client = TestClient(create_dashboard_app(tmp_path))
    assert statuses(client) == {names["finish"]: "finished", names["exit"]: "crashed"}


def test_records_this_host_cannot_judge_fall_back_to_the_files(tmp_path):
    """Another host's process: its fresh files say running, stale ones crashed. A record of this very
    process (alive) is running; the same pid with another start time is a reused pid: crashed. A
    resumed run (its first process gone, the resuming one alive) is running."""
    me = this_process()
    cases = {"20261101T000000Z-e15e01": replace(me, host=me.host + "-elsewhere"),
             "20261101T000000Z-e15e02": replace(me, host=me.host + "-elsewhere"),
             "20261101T000000Z-a11ve0": me,
             "20261101T000000Z-5e11d0": replace(me, start_ticks=me.start_ticks - 1),
             "20261101T000000Z-2e5000": [replace(me, start_ticks=me.start_ticks - 1), me]}
    for run_id, processes in cases.items():
        run = write_training_run(tmp_path / run_id, 2, planned=5, finished=False)
        (run / PROCESSES).write_text("".join(json.dumps(asdict(p)) + "\n"
                                             for p in (processes if isinstance(processes, list) else [processes])))
    old = time.time() - 3600
    for f in (tmp_path / "20261101T000000Z-e15e02").iterdir():
        os.utime(f, (old, old))
    client = TestClient(create_dashboard_app(tmp_path))
    assert statuses(client) == {"20261101T000000Z-e15e01": "running", "20261101T000000Z-e15e02": "crashed",
                                "20261101T000000Z-a11ve0": "running", "20261101T000000Z-5e11d0": "crashed",
                                "20261101T000000Z-2e5000": "running"}
