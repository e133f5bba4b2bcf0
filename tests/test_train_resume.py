"""`rollmarket train` killed with SIGKILL at every point of a step, then `--resume`d: nothing lost, nothing twice.

One exchange process and one real worker process (`rollmarket worker`, the tiny MoE at bf16) serve
every case in turn; each case is its own run (its own trainer id and policy versions). The trainer
is a real `rollmarket train` process armed with ROLLMARKET_FAILPOINTS, which makes it SIGKILL itself
at the named point of the named step; `rollmarket train --resume RUN_DIR` then finishes the run
(in the test's process, through the CLI, so that torch loads once). What must hold is judged from
the files and from the exchange's own database, not from the trainer's word:

- every step 1..N has exactly one metrics row (and step 0 one, when evaluations are on);
- the exchange recorded exactly one decision and one feedback per group of the run, and all
  N × groups_per_step groups were decided: no step waited for groups that never come;
- generations.jsonl holds every trajectory of every decided group exactly once, with the decision
  the exchange recorded;
- every version of the run was published once, and the final one is the final checkpoint's digest.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import TRAINER_TOKEN, ExchangeProcess

from rollmarket.engines.provenance import checkpoint_digest
from rollmarket.runs import read_processes
from rollmarket.train.failpoints import Failpoint, FailpointError, parse

ROOT = Path(__file__).resolve().parent.parent
MODEL = str(ROOT / "models" / "tiny-moe")
RUN_TIMEOUT_S = 300.0
"""Longest a killed run may take to reach its fail point. A resumed run that waits for groups that never
come fails after loop.fetch_timeout_s (below) with a TrainingError."""

QUICK = [
    f"model.path={json.dumps(MODEL)}", "rollout.suite=arithmetic", "rollout.groups_per_step=2",
    "rollout.group_size=2", "rollout.temperature=2.0", "rollout.max_tokens=32", "agent.max_turns=2",
    "rollout.precisions=['bf16']", "eval.tasks=0", "optim.lr=1e-4", "loop.fetch_timeout_s=120",
    "loop.quorum_timeout_s=120", "local.lease_ttl_s=8", "local.workers=['bf16']",
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """An exchange process and a real worker process, shared by every case (one model load)."""
    root = tmp_path_factory.mktemp("resume-cluster")
    exchange = ExchangeProcess(db=root / "exchange.db", log=root / "exchange.log",
                               args=["--preference-hold-s", "0", "--heartbeat-ttl-s", "15", "--lease-ttl-s", "60"])
    exchange.start()
    log = open(root / "worker.log", "ab")
    worker = subprocess.Popen(
        [sys.executable, "-m", "rollmarket", "worker", "--model", MODEL, "--precision", "bf16", "--threads", "1",
         "--exchange", exchange.url, "--worker-id", "resume-bf16", "--heartbeat-s", "1", "--lease-wait-s", "1",
         "--max-steps", "2"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        yield exchange
    finally:
        worker.terminate()
        try:
            worker.wait(20)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        log.close()
        exchange.stop()


def train(args: list[str], *, failpoint: str | None = None,
          timeout: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
    """`rollmarket train ARGS` as a process of its own, armed with `failpoint` if given."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "ROLLMARKET_TRAINER_TOKEN": TRAINER_TOKEN}
    env.pop("ROLLMARKET_FAILPOINTS", None)
    if failpoint:
        env["ROLLMARKET_FAILPOINTS"] = failpoint
    return subprocess.run([sys.executable, "-m", "rollmarket", "train", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def resume(run_dir: Path, *args: str) -> None:
    """`rollmarket train --resume RUN_DIR` in this process (the killed one was a process of its own):
    torch is imported once for every case."""
    from click.testing import CliRunner

    from rollmarket.cli.main import main

    result = CliRunner().invoke(main, ["train", "--resume", str(run_dir), *args],
                                env={"ROLLMARKET_TRAINER_TOKEN": TRAINER_TOKEN, "ROLLMARKET_FAILPOINTS": None})
    assert result.exit_code == 0, (result.output, result.exception)


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def check_run(run_dir: Path, db: Path, *, steps: int, groups_per_step: int, group_size: int,
              evaluated: bool = False, sync: bool = True) -> None:
    """The files and the exchange agree: every step once, every decided trajectory once."""
    run_id = run_dir.name
    metrics = jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(0 if evaluated else 1, steps + 1)), "metrics rows"
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        groups = dict(conn.execute("SELECT group_id, job_id FROM groups WHERE job_id LIKE ?", (f"{run_id}-%",)))
        decided = conn.execute(
            "SELECT d.group_id, d.status, d.trainer_id FROM decisions d JOIN groups g ON g.group_id = d.group_id"
            " WHERE g.job_id LIKE ?", (f"{run_id}-%",)).fetchall()
        feedback = [r[0] for r in conn.execute(
            "SELECT f.group_id FROM feedback f JOIN groups g ON g.group_id = f.group_id WHERE g.job_id LIKE ?",
            (f"{run_id}-%",))]
        policies = dict(conn.execute("SELECT version, digest FROM policies"))
    decided_ids = [g for g, _, _ in decided]
    assert sorted(decided_ids) == sorted(set(decided_ids)), "a group was decided twice"
    assert sorted(feedback) == sorted(decided_ids), "feedback missing or twice"
    assert len(decided_ids) == steps * groups_per_step, (len(decided_ids), len(groups))
    job_step = {g: int(re.search(r"-s(\d{5})-", groups[g]).group(1)) for g in decided_ids}
    assert sorted(job_step.values()) == sorted(s for s in range(1, steps + 1) for _ in range(groups_per_step))

    rows = jsonl(run_dir / "generations.jsonl")
    keys = [(g["group_id"], g["sample_index"]) for g in rows]
    assert len(keys) == len(set(keys)), "a trajectory appears twice in generations.jsonl"
    assert set(keys) == {(g, i) for g in decided_ids for i in range(group_size)}
    status = {g: s for g, s, _ in decided}
    assert all(r["decision"] == status[r["group_id"]] for r in rows)
    # token_logprobs.jsonl stays row for row with generations.jsonl through every kill and repair.
    tokens = jsonl(run_dir / "token_logprobs.jsonl")
    assert [(t["step"], t["group_id"], t["sample_index"]) for t in tokens] == [
        (g["step"], g["group_id"], g["sample_index"]) for g in rows]
    assert all(len(t["trainer_logprobs"]) == g["tokens"] for t, g in zip(tokens, rows))
    if sync:  # a sync step trains on its own jobs; an async one also on the next step's
        assert all(r["step"] == job_step[r["group_id"]] for r in rows)

    base = base_version(db, run_id)
    final = run_dir / "checkpoints" / f"v{base + steps:04d}"
    assert policies[base + steps] == checkpoint_digest(final)
    assert max(policies) == base + steps
    assert not list((run_dir / "checkpoints").glob(".*partial")), "a half-written checkpoint was left"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_version"] == base + steps
    assert {t for _, _, t in decided} == {f"trainer-{run_id}"}  # the run's own trainer id
    if evaluated:
        evals = jsonl(run_dir / "evals.jsonl")
        per_step = [(r["step"], r["task_id"]) for r in evals]
        assert len(per_step) == len(set(per_step)) and {s for s, _ in per_step} == {0, steps}
        assert summary["eval_before"] and summary["eval_after"]


def base_version(db: Path, run_id: str) -> int:
    """The version the run started from, as the exchange knows it: its first job's."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        return conn.execute("SELECT policy_version FROM jobs WHERE job_id = ?", (f"{run_id}-s00001-000",)).fetchone()[0]


def decisions_of(db: Path, run_id: str) -> int:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        return conn.execute("SELECT count(*) FROM decisions d JOIN groups g ON g.group_id = d.group_id"
                            " WHERE g.job_id LIKE ?", (f"{run_id}-%",)).fetchone()[0]


# (point, the step it fires in, extra overrides). Most fire in step 1, to keep the killed runs short;
# before step 1's checkpoint the resume starts from start.json, after it from the checkpoint.
CASES = [
    (Failpoint.before_fetch, 1, []),
    (Failpoint.between_decisions, 1, []),
    # The first optimizer step, in whichever step first has a group with mixed rewards (groups of 4,
    # 3 a step: a step without one is rare, two in a row rarer still).
    (Failpoint.in_optimizer_step, None, ["rollout.group_size=4", "rollout.groups_per_step=3"]),
    (Failpoint.in_checkpoint_write, 2, []),  # resumes from v1, throws the partial v2 away, redoes step 2
    (Failpoint.before_reports, 1, []),
    (Failpoint.after_checkpoint_before_publish, 1, []),
    (Failpoint.waiting_for_quorum, 1, ["eval.tasks=2", "eval.samples=2", "eval.max_turns=2"]),
    # async: step 2's jobs were enqueued during step 1 at version base; a resumed step 2 enqueues them again.
    (Failpoint.between_decisions, 2, ["loop.mode=async", "loop.max_staleness=1"]),
]


@pytest.mark.parametrize(("point", "step", "extra"), CASES,
                         ids=[c[0].value + ("-async" if "loop.mode=async" in c[2] else "") for c in CASES])
def test_kill_9_at_a_point_then_resume(cluster, tmp_path, point, step, extra):
    overrides = [*QUICK, f"runs_root={json.dumps(str(tmp_path))}", f"exchange.url={cluster.url}", "loop.steps=2",
                 *extra]
    settings = dict(o.split("=", 1) for o in overrides)
    shape = {"steps": int(settings["loop.steps"]), "group_size": int(settings["rollout.group_size"]),
             "groups_per_step": int(settings["rollout.groups_per_step"])}
    armed = point.value if step is None else f"{point.value}@{step}"

    killed = train(overrides, failpoint=armed)
    assert killed.returncode == -9, f"the failpoint was not reached:\n{killed.stdout}\n{killed.stderr}"
    assert f"failpoint {point.value} reached" in killed.stderr
    (run_dir,) = tmp_path.iterdir()
    # The state the kill left is the one the point names.
    reported = decisions_of(cluster.db, run_dir.name)
    if point is Failpoint.in_checkpoint_write:
        assert list((run_dir / "checkpoints").glob(".v*.partial")), "the kill left no partial checkpoint"
    if point in (Failpoint.before_fetch, Failpoint.between_decisions, Failpoint.in_optimizer_step,
                 Failpoint.in_checkpoint_write, Failpoint.before_reports):
        # Decisions wait for their step's checkpoint: only earlier, committed steps' are at the exchange.
        assert reported % shape["groups_per_step"] == 0
        if step is not None:
            assert reported == shape["groups_per_step"] * (step - 1)
    if point in (Failpoint.after_checkpoint_before_publish, Failpoint.waiting_for_quorum):
        assert reported == shape["groups_per_step"]
        base = base_version(cluster.db, run_dir.name)
        with sqlite3.connect(f"file:{cluster.db}?mode=ro", uri=True) as conn:
            newest = conn.execute("SELECT max(version) FROM policies").fetchone()[0]
        assert newest == base + (point is Failpoint.waiting_for_quorum)

    started = time.monotonic()
    resume(run_dir)
    check_run(run_dir, cluster.db, evaluated="eval.tasks=2" in extra, sync="loop.mode=async" not in extra, **shape)
    print(f"{armed}: resumed in {time.monotonic() - started:.1f}s")


def test_kill_9_of_a_local_run_then_resume(tmp_path):
    """--local: the kill takes the in-process exchange and workers down too; resume restarts them on
    the run's exchange.db."""
    overrides = [*QUICK, f"runs_root={json.dumps(str(tmp_path))}", "loop.steps=2"]
    killed = train([*overrides, "--local"], failpoint="before_reports@1")
    assert killed.returncode == -9, f"{killed.stdout}\n{killed.stderr}"
    (run_dir,) = tmp_path.iterdir()
    resume(run_dir, "--local")
    check_run(run_dir, run_dir / "exchange.db", steps=2, groups_per_step=2, group_size=2)
    # The killed process and the resuming one (this test's) are both recorded: the dashboard's liveness.
    killed_pid, resumed_pid = (p.pid for p in read_processes(run_dir))
    assert resumed_pid == os.getpid() != killed_pid


def test_failpoints_parse_and_refuse_unknown_names(tmp_path):
    assert parse("") == {}
    assert parse("between_decisions@2, in_checkpoint_write") == {
        Failpoint.between_decisions: 2, Failpoint.in_checkpoint_write: None}
    with pytest.raises(FailpointError, match="unknown fail point 'between_decision'"):
        parse("between_decision@2")
    with pytest.raises(FailpointError, match="whole number"):
        parse("before_fetch@two")

    from click.testing import CliRunner

    from rollmarket.cli.main import main

    bad = CliRunner().invoke(main, ["train", "--local", f"runs_root={json.dumps(str(tmp_path))}"],
                             env={"ROLLMARKET_FAILPOINTS": "nowhere"})
    assert bad.exit_code == 1 and "unknown fail point 'nowhere'" in bad.output
    assert not list(tmp_path.iterdir())  # refused before a run directory was made
