"""Evals you can compare: `rollmarket eval reverify`, `rollmarket eval compare` and `rollmarket
curriculum`, run as real processes on real files (and a real resources server on loopback), and a
real training run sampling only a curriculum's tasks.

Expected values come from how the fixtures were written (which answers are right under which
verifier, how many runs of each task pass), never from the code under test.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import sqlite3
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from collections import Counter
from pathlib import Path

import pytest

from helpers import ServiceProcess, rollmarket_command
from rollmarket.contracts import AgentTrajectory, TaskSpec, TerminalReason, VerifyResult
from rollmarket.localhost import free_port
from rollmarket.tasks.suites import load_suite

ROOT = Path(__file__).resolve().parent.parent


def cli(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "rollmarket", *args], capture_output=True, text=True,
                          env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"}, cwd=ROOT)
    assert (done.returncode == 0) == ok, done.stdout + done.stderr
    return done


def run(task_id: str, index: int, answer: str, passed: bool | None) -> AgentTrajectory:
    verification = None if passed is None else VerifyResult(reward=float(passed), passed=passed)
    return AgentTrajectory(task_id=task_id, sample_index=index, messages=[{"role": "user", "content": "q"}],
                           final_answer=answer, terminal_reason=TerminalReason.final_answer,
                           verification=verification)


def write_runs(path: Path, runs: list[AgentTrajectory]) -> Path:
    path.write_text("".join(r.model_dump_json() + "\n" for r in runs))
    return path


def passing_runs(counts: dict[str, int], n: int) -> list[AgentTrajectory]:
    """n runs per task, the first counts[task] of them passed."""
    return [run(task, i, "x", i < c) for task, c in counts.items() for i in range(n)]


# ---------------------------------------------------------------------------------------------
# reverify

# Task t0 expects 3 and t1 expects 10. The answers and which verifier accepts them:
# exact compares text (after normalization), numeric compares numbers.
ANSWERS = {"t0": ["3", "3.0", "3.00", "4"], "t1": ["10", "1e1", "ten", "10.0"]}
EXACT_OK = {("t0", "3"), ("t1", "10")}
NUMERIC_OK = {("t0", "3"), ("t0", "3.0"), ("t0", "3.00"), ("t1", "10"), ("t1", "1e1"), ("t1", "10.0")}


@pytest.fixture
def stored(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(TaskSpec(task_id=t, prompt="?", verifier="exact", answer=a).model_dump_json() + "\n"
                             for t, a in (("t0", "3"), ("t1", "10"))))
    runs = [run(t, i, a, (t, a) in EXACT_OK) for t, answers in ANSWERS.items() for i, a in enumerate(answers)]
    return tasks, write_runs(tmp_path / "runs.jsonl", runs)


def check_reverified(out: Path) -> None:
    rescored = [AgentTrajectory.model_validate_json(line) for line in out.read_text().splitlines()]
    assert [(r.task_id, r.final_answer) for r in rescored] == [(t, a) for t, answers in ANSWERS.items()
                                                             for a in answers]
    assert {(r.task_id, r.final_answer) for r in rescored if r.verification.passed} == NUMERIC_OK
    assert all(r.verification.info["previous"]["passed"] == ((r.task_id, r.final_answer) in EXACT_OK)
               for r in rescored)
    report = json.loads(out.with_name("new.reverify.json").read_text())
    flipped = len(NUMERIC_OK - EXACT_OK)
    assert report["runs"] == 8 and report["agree"] == 8 - flipped
    assert report["disagreements"] == {"failed→passed": flipped}
    assert report["table"]["passed"] == {"passed": len(EXACT_OK), "failed": 0}
    assert report["table"]["failed"] == {"passed": flipped, "failed": 8 - len(NUMERIC_OK)}
    assert report["new_pass_rate"] == len(NUMERIC_OK) / 8 and report["old_pass_rate"] == len(EXACT_OK) / 8


def test_reverify_with_a_local_family_puts_old_and_new_side_by_side(stored, tmp_path):
    tasks, runs = stored
    out = tmp_path / "new.jsonl"
    done = cli("eval", "reverify", str(runs), "--tasks", str(tasks), "--verifier", "numeric", "--out", str(out))
    assert f"agree on {8 - len(NUMERIC_OK - EXACT_OK)} of 8 runs" in done.stdout
    check_reverified(out)


def test_reverify_through_a_resources_server_matches_the_local_family(stored, tmp_path):
    tasks, runs = stored
    port = free_port()
    server = ServiceProcess(rollmarket_command("verifier", "serve", "--port", str(port)), tmp_path / "verifier.log",
                            port).start(timeout=60)
    try:
        out = tmp_path / "new.jsonl"
        cli("eval", "reverify", str(runs), "--tasks", str(tasks), "--verifier", server.url, "--family", "numeric",
            "--out", str(out))
        check_reverified(out)
        # A family the tasks do not fit: the server answers 400, the command one error line, no file.
        bad = tmp_path / "bad.jsonl"
        done = cli("eval", "reverify", str(runs), "--tasks", str(tasks), "--verifier", server.url, "--family",
                   "json_schema", "--out", str(bad), ok=False)
        assert "schema: Field required" in done.stderr and not bad.exists()
    finally:
        server.stop()


def test_reverify_refuses_bad_input_and_writes_nothing(stored, tmp_path):
    tasks, runs = stored
    out = tmp_path / "new.jsonl"
    bad = cli("eval", "reverify", str(runs), "--tasks", str(tasks), "--verifier", "nope", "--out", str(out), ok=False)
    assert "unknown verifier 'nope'" in bad.stderr
    other = tmp_path / "other.jsonl"
    other.write_text(TaskSpec(task_id="t0", prompt="?", verifier="exact", answer="3").model_dump_json() + "\n")
    bad = cli("eval", "reverify", str(runs), "--tasks", str(other), "--verifier", "numeric", "--out", str(out),
              ok=False)
    assert "not in the task set: ['t1']" in bad.stderr
    assert not out.exists()


class GatedVerifier:
    """A /verify on loopback (ThreadingHTTPServer) that answers only as many requests as the test
    lets through: the rest wait, so the test knows which runs are finished and which in flight
    when it kills the client. passed: the final answer is the task's answer, as written."""

    def __init__(self):
        self.lock = threading.Condition()
        self.allowed = 0
        self.received: list[tuple[int, str, int]] = []  # (phase, task, sample) as they arrive
        self.answered: list[tuple[str, int]] = []
        self.in_flight = self.most_in_flight = 0
        self.phase = 0
        self.refuse: set[str] = set()
        """Tasks whose requests get a 400, as a server answers a task its verifier cannot score."""
        gate = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # health
                self.send_response(200)
                self.end_headers()

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                key = (body["trajectory"]["task_id"], body["trajectory"]["sample_index"])
                with gate.lock:
                    gate.received.append((gate.phase, *key))
                    gate.in_flight += 1
                    gate.most_in_flight = max(gate.most_in_flight, gate.in_flight)
                    gate.lock.notify_all()
                    gate.lock.wait_for(lambda: len(gate.answered) < gate.allowed)
                    gate.answered.append(key)
                    gate.in_flight -= 1
                    gate.lock.notify_all()
                passed = body["trajectory"]["final_answer"] == body["task"]["answer"]
                refused = key[0] in gate.refuse
                data = json.dumps({"error": {"code": "bad_task", "message": f"cannot score {key[0]}"}} if refused
                                  else {"reward": float(passed), "passed": passed}).encode()
                try:
                    self.send_response(400 if refused else 200)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client was killed while this one waited
                    pass

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def allow(self, n: int) -> None:
        with self.lock:
            self.allowed = n
            self.lock.notify_all()

    def wait(self, condition, what: str, timeout: float = 120) -> None:
        with self.lock:
            assert self.lock.wait_for(condition, timeout), what


def journal_keys(path: Path) -> list[int]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line)["key"] for line in lines[1:] if line.endswith("}")]


def wait_for(condition, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_reverify_is_concurrent_and_a_kill_9_loses_only_the_runs_in_flight(tmp_path):
    """12 runs, --concurrency 3, a verifier that answers 5 then holds every request: the client
    has exactly 5 results journaled and 3 in flight (never more) when it is killed with kill -9.
    The same command again scores only the other 7, and the output is every run, in order."""
    answers = {f"t{i}": str(i) for i in range(4)}
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(TaskSpec(task_id=t, prompt="?", verifier="exact", answer=a).model_dump_json() + "\n"
                             for t, a in answers.items()))
    runs = [run(t, i, a if i != 1 else "wrong", False) for t, a in answers.items() for i in range(3)]
    rollouts = write_runs(tmp_path / "runs.jsonl", runs)
    gate = GatedVerifier()
    out = tmp_path / "new.jsonl"
    journal = tmp_path / "new.reverify-journal.jsonl"
    command = [sys.executable, "-m", "rollmarket", "eval", "reverify", str(rollouts), "--tasks", str(tasks),
               "--verifier", gate.url, "--concurrency", "3", "--out", str(out)]
    env = {"COLUMNS": "200", "PATH": "/usr/bin:/bin"}
    try:
        gate.allow(5)
        first = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        gate.wait(lambda: len(gate.answered) == 5 and gate.in_flight == 3, "5 answered and 3 held")
        wait_for(lambda: len(journal_keys(journal)) == 5, "the 5 answered runs journaled")
        first.kill()  # SIGKILL
        first.wait()
        assert gate.most_in_flight == 3 and not out.exists()
        done_keys = journal_keys(journal)
        answered = {(runs[k].task_id, runs[k].sample_index) for k in done_keys}
        assert answered == set(gate.answered)

        with open(journal, "a") as torn:  # what a kill in the middle of a write leaves
            torn.write('{"key": 11, "run": {"task_id"')
        with gate.lock:
            gate.phase = 1
        gate.allow(10_000)
        again = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stdout + again.stderr
        assert "resuming: 5 of 12 runs already scored" in again.stdout
        rerun = [(t, i) for phase, t, i in gate.received if phase == 1]
        assert sorted(rerun) == sorted({(r.task_id, r.sample_index) for r in runs} - answered)
        rescored = [AgentTrajectory.model_validate_json(line) for line in out.read_text().splitlines()]
        assert [(r.task_id, r.sample_index) for r in rescored] == [(r.task_id, r.sample_index) for r in runs]
        assert [r.verification.passed for r in rescored] == [r.final_answer == answers[r.task_id] for r in runs]
        report = json.loads((tmp_path / "new.reverify.json").read_text())
        assert report["disagreements"] == {"failed→passed": 8} and not journal.exists()

        # A journal of another reverify (other args) is refused, and nothing is written.
        journal.write_text(json.dumps({"reverify": {"rollouts": "other"}}) + "\n")
        before = out.read_bytes()
        bad = cli("eval", "reverify", str(rollouts), "--tasks", str(tasks), "--verifier", gate.url, "--out", str(out),
                  ok=False)
        assert "the journal of another reverify" in bad.stderr and out.read_bytes() == before
    finally:
        gate.server.shutdown()


def test_reverify_stops_at_a_scorers_error_keeping_what_finished(tmp_path):
    """One run at a time; the server refuses t1: the three t0 runs before it are journaled, no
    --out is written, and once the server scores t1 the same command scores only the other 9."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(TaskSpec(task_id=f"t{i}", prompt="?", verifier="exact", answer="1").model_dump_json()
                             + "\n" for i in range(4)))
    runs = [run(f"t{i}", j, "1", False) for i in range(4) for j in range(3)]
    rollouts = write_runs(tmp_path / "runs.jsonl", runs)
    gate = GatedVerifier()
    gate.allow(10_000)
    gate.refuse = {"t1"}
    out = tmp_path / "new.jsonl"
    args = ("eval", "reverify", str(rollouts), "--tasks", str(tasks), "--verifier", gate.url, "--concurrency", "1",
            "--out", str(out))
    try:
        failed = cli(*args, ok=False)
        assert "cannot score t1" in failed.stderr and not out.exists()
        assert journal_keys(tmp_path / "new.reverify-journal.jsonl") == [0, 1, 2]
        gate.refuse = set()
        with gate.lock:
            gate.phase = 1
        cli(*args)
        assert sorted((t, i) for phase, t, i in gate.received if phase == 1) == [
            (r.task_id, r.sample_index) for r in runs[3:]]
        assert len(out.read_text().splitlines()) == 12
    finally:
        gate.server.shutdown()


# ---------------------------------------------------------------------------------------------
# compare

def test_compare_pairs_tasks_and_gives_the_workbenchs_verdicts(tmp_path):
    n = 16
    base_counts = {f"task{i:02d}": 2 + i % 5 for i in range(12)}
    cand_counts = {t: c + 3 + i % 2 for i, (t, c) in enumerate(base_counts.items())}
    base = write_runs(tmp_path / "base.jsonl", passing_runs(base_counts, n))
    cand = write_runs(tmp_path / "cand.jsonl", passing_runs(cand_counts, n))
    out = tmp_path / "cmp.json"
    done = cli("eval", "compare", str(cand), str(base), "--out", str(out))
    assert "CONFIRMED" in done.stdout
    report = json.loads(out.read_text())
    (m,) = report["comparison"]["metrics"]
    diffs = [(cand_counts[t] - base_counts[t]) / n for t in sorted(base_counts)]
    assert m["verdict"] == "CONFIRMED" and m["unit"] == "tasks" and m["n_seeds"] == 12
    assert m["differences"] == pytest.approx(diffs)
    assert m["mean_difference"] == pytest.approx(sum(diffs) / len(diffs))
    assert m["sign_flip"]["p"] == pytest.approx(2 / 2 ** 12)  # every difference positive: the two extreme flips
    lo, hi = m["t_interval"]
    assert 0 < lo < sum(diffs) / len(diffs) < hi

    # The other way round it is REFUTED; from profiles it is the same comparison.
    cli("profile", str(base), "--out", str(tmp_path / "base.profile.json"))
    cli("profile", str(cand), "--out", str(tmp_path / "cand.profile.json"))
    cli("eval", "compare", str(tmp_path / "base.profile.json"), str(tmp_path / "cand.profile.json"),
        "--out", str(out))
    (back,) = json.loads(out.read_text())["comparison"]["metrics"]
    assert back["verdict"] == "REFUTED" and back["differences"] == pytest.approx([-d for d in diffs])


def test_compare_says_inconclusive_with_too_few_samples_or_no_difference(tmp_path):
    counts = {f"task{i:02d}": 1 + i % 3 for i in range(10)}
    few = cli("eval", "compare", str(write_runs(tmp_path / "a.jsonl", passing_runs(counts, 4))),
              str(write_runs(tmp_path / "b.jsonl", passing_runs({t: 0 for t in counts}, 4))),
              "--out", str(tmp_path / "few.json"))
    (m,) = json.loads((tmp_path / "few.json").read_text())["comparison"]["metrics"]
    assert m["verdict"] == "INCONCLUSIVE" and "a pass@k claim needs ≥ 16" in m["reason"], few.stdout
    same = passing_runs(counts, 16)
    cli("eval", "compare", str(write_runs(tmp_path / "c.jsonl", same)), str(write_runs(tmp_path / "d.jsonl", same)),
        "--metric", "reward", "--out", str(tmp_path / "same.json"))
    (m,) = json.loads((tmp_path / "same.json").read_text())["comparison"]["metrics"]
    assert m["verdict"] == "INCONCLUSIVE" and m["mean_difference"] == 0
    one = cli("eval", "compare", str(write_runs(tmp_path / "e.jsonl", passing_runs({"x": 1}, 16))),
              str(tmp_path / "d.jsonl"), ok=False)
    assert "0 task(s) with a value on both sides; pairing needs at least 2" in one.stderr


# Seeds × tasks: 6 training seeds a side (the fewest whose exact sign-flip test can reach p < 0.05:
# 2/2^6), 10 tasks, 16 samples each. base[s][t] passing runs; the candidate adds shift[s][t].
SEEDS, TASKS, N = 6, 10, 16


def seeded_evals(root: Path, shift) -> tuple[Path, Path, list[list[int]], list[list[int]]]:
    base = [[4 + (s + t) % 5 for t in range(TASKS)] for s in range(SEEDS)]
    cand = [[base[s][t] + shift(s, t) for t in range(TASKS)] for s in range(SEEDS)]
    for side, counts in (("base", base), ("cand", cand)):
        (root / side).mkdir(parents=True)
        for s in range(SEEDS):
            write_runs(root / side / f"seed{s}.jsonl",
                       passing_runs({f"task{t:02d}": counts[s][t] for t in range(TASKS)}, N))
    return root / "cand", root / "base", base, cand


def test_compare_with_seeds_confirms_a_shift_every_seed_shows(tmp_path):
    cand_dir, base_dir, base, cand = seeded_evals(tmp_path, lambda s, t: 3 + (s + t) % 3 - 1)
    out = tmp_path / "cmp.json"
    done = cli("eval", "compare", str(cand_dir), str(base_dir), "--out", str(out))
    report = json.loads(out.read_text())
    assert report["verdicts_from"] == "seeds"
    (m,) = report["seed_comparison"]["metrics"]
    per_seed = [sum(cand[s][t] - base[s][t] for t in range(TASKS)) / (TASKS * N) for s in range(SEEDS)]
    assert m["unit"] == "seeds" and m["seeds"] == [f"seed{s}" for s in range(SEEDS)]
    assert m["differences"] == pytest.approx(per_seed)
    assert m["sign_flip"]["p"] == pytest.approx(2 / 2 ** SEEDS)  # every seed better: the two extreme flips
    assert m["verdict"] == "CONFIRMED", m["reason"]
    boot = m["two_way_bootstrap"]
    assert boot["seeds"] == SEEDS and boot["tasks"] == TASKS and 0 < boot["lo"] < boot["hi"]
    (per_task,) = report["comparison"]["metrics"]
    assert per_task["unit"] == "tasks" and per_task["verdict"] == "CONFIRMED"
    assert per_task["differences"] == pytest.approx(
        [sum(cand[s][t] - base[s][t] for s in range(SEEDS)) / (SEEDS * N) for t in range(TASKS)])
    assert "CONFIRMED pass@1 (seeds as the unit)" in done.stdout


def test_compare_with_seeds_does_not_confirm_differences_within_seed_noise(tmp_path):
    """Two seeds of the candidate are much better, three a little worse, one a little better: every
    task's seed average is higher (per task, the paired test over tasks says CONFIRMED: tasks see
    the same six seeds), but over seeds it is noise and the verdict that counts is not CONFIRMED."""
    offsets = [6, 6, -2, -2, -2, 2]
    cand_dir, base_dir, base, cand = seeded_evals(tmp_path, lambda s, t: offsets[s] + t % 3 - 1)
    out = tmp_path / "cmp.json"
    cli("eval", "compare", str(cand_dir), str(base_dir), "--out", str(out))
    report = json.loads(out.read_text())
    (per_task,) = report["comparison"]["metrics"]
    assert all(d > 0 for d in per_task["differences"]) and per_task["verdict"] == "CONFIRMED"
    (m,) = report["seed_comparison"]["metrics"]
    per_seed = [sum(cand[s][t] - base[s][t] for t in range(TASKS)) / (TASKS * N) for s in range(SEEDS)]
    assert m["differences"] == pytest.approx(per_seed)
    # The exact two-sided sign-flip p, enumerated here: flips whose |sum| reaches the observed one.
    flips = [sum(sign * d for sign, d in zip(signs, per_seed)) for signs in itertools.product((1, -1), repeat=SEEDS)]
    expected_p = sum(abs(f) >= abs(sum(per_seed)) - 1e-12 for f in flips) / 2 ** SEEDS
    assert m["sign_flip"]["p"] == pytest.approx(expected_p) and expected_p > 0.05
    assert m["verdict"] == "INCONCLUSIVE"


def test_compare_with_seeds_needs_the_tasks_too(tmp_path):
    """Every seed of the candidate is better on task00 alone: over seeds it is significant, but a
    draw of tasks without task00 (a third of the bootstrap's) shows no difference at all."""
    cand_dir, base_dir, _, _ = seeded_evals(tmp_path, lambda s, t: 6 + s % 3 if t == 0 else 0)
    cli("eval", "compare", str(cand_dir), str(base_dir), "--out", str(tmp_path / "cmp.json"))
    (m,) = json.loads((tmp_path / "cmp.json").read_text())["seed_comparison"]["metrics"]
    assert m["sign_flip"]["p"] == pytest.approx(2 / 2 ** SEEDS) and m["t_interval"][0] > 0
    assert m["two_way_bootstrap"]["lo"] == 0 and m["verdict"] == "INCONCLUSIVE"
    assert "the two-way bootstrap (seeds and tasks resampled) interval" in m["reason"]


def test_compare_with_seeds_refuses_unpaired_or_mixed_sides(tmp_path):
    cand_dir, base_dir, _, _ = seeded_evals(tmp_path, lambda s, t: 1)
    (cand_dir / "seed5.jsonl").rename(cand_dir / "seed9.jsonl")
    bad = cli("eval", "compare", str(cand_dir), str(base_dir), "--out", str(tmp_path / "x.json"), ok=False)
    assert "seeds do not pair (only base: ['seed5']; only cand: ['seed9'])" in bad.stderr
    bad = cli("eval", "compare", str(cand_dir / "seed0.jsonl"), str(base_dir), "--out", str(tmp_path / "x.json"),
              ok=False)
    assert "one side has several seeds and the other one eval" in bad.stderr
    assert not (tmp_path / "x.json").exists()


# ---------------------------------------------------------------------------------------------
# curriculum

def curriculum_profile(tmp_path: Path) -> tuple[Path, dict[str, int]]:
    """Rollouts of real `arithmetic` training tasks: two solved, two hopeless, three learnable, one
    with too few samples."""
    ids = [t.task_id for t in load_suite("arithmetic", "train")][:8]
    counts = dict(zip(ids, (16, 15, 0, 0, 8, 4, 2, 1)))
    runs = [r for r in passing_runs(counts, 16) if not (r.task_id == ids[7] and r.sample_index >= 2)]
    return write_runs(tmp_path / "train.jsonl", runs), counts


def test_curriculum_drops_the_solved_and_the_hopeless_and_weights_the_learnable(tmp_path):
    profile, counts = curriculum_profile(tmp_path)
    ids = list(counts)
    out = tmp_path / "curriculum.json"
    cli("curriculum", str(profile), "--out", str(out), "--max-pass", "0.9")
    data = json.loads(out.read_text())
    learnable = {t: counts[t] / 16 for t in ids[4:7]}
    raw = {t: p * (1 - p) for t, p in learnable.items()}
    assert {t["task_id"]: t["weight"] for t in data["tasks"]} == pytest.approx(
        {t: w / sum(raw.values()) for t, w in raw.items()})
    assert set(data["solved"]) == set(ids[:2])
    assert set(data["hopeless"]) == set(ids[2:4]) and data["unmeasured"] == [ids[7]]
    bad = cli("curriculum", str(profile), "--out", str(tmp_path / "x.json"), "--min-pass", "0.95", ok=False)
    assert "min_pass" in bad.stderr and not (tmp_path / "x.json").exists()
    none = cli("curriculum", str(profile), "--out", str(tmp_path / "x.json"), "--max-pass", "0.05", ok=False)
    assert "no learnable task" in none.stderr and not (tmp_path / "x.json").exists()


def test_trainer_samples_only_the_kept_tasks_by_their_weights(tmp_path):
    from rollmarket.train.config import TrainConfigError, resolve, validate
    from rollmarket.train.loop import Trainer

    profile, counts = curriculum_profile(tmp_path)
    kept = list(counts)[4:7]
    weighted, uniform = tmp_path / "weighted.json", tmp_path / "uniform.json"
    cli("curriculum", str(profile), "--out", str(weighted))
    cli("curriculum", str(profile), "--out", str(uniform), "--mode", "keep")
    model = f"model.path={json.dumps(str(ROOT / 'models' / 'tiny-moe'))}"

    def trainer(path: Path) -> Trainer:
        config = resolve(None, [model, "rollout.suite=arithmetic", f"rollout.curriculum={json.dumps(str(path))}"])
        validate(config, local=True)
        return Trainer(config, local=True)

    draws = 6000
    sampler = trainer(weighted)
    picked = Counter(sampler.train_task(i).task_id for i in range(draws))
    assert set(picked) == set(kept)
    p = {t: counts[t] / 16 for t in kept}
    total = sum(q * (1 - q) for q in p.values())
    for task in kept:  # a binomial count within 5 standard deviations of its expectation
        share = p[task] * (1 - p[task]) / total
        assert abs(picked[task] - draws * share) < 5 * (draws * share * (1 - share)) ** 0.5, (task, picked)
    again = trainer(weighted)  # a resumed run picks the same tasks
    assert [again.train_task(i).task_id for i in range(50)] == [sampler.train_task(i).task_id for i in range(50)]
    cycler = trainer(uniform)
    cycle = [cycler.train_task(i).task_id for i in range(9)]
    assert sorted(cycle[:3]) == sorted(kept) and cycle[3:6] == cycle[:3] == cycle[6:]

    foreign = tmp_path / "foreign.json"
    data = json.loads(weighted.read_text())
    data["tasks"][0]["task_id"] = "not-a-task"
    foreign.write_text(json.dumps(data))
    with pytest.raises(TrainConfigError, match="not training tasks"):
        validate(resolve(None, [model, "rollout.suite=arithmetic", f"rollout.curriculum={json.dumps(str(foreign))}"]),
                 local=True)
    # A config that pins the content (rollout.curriculum_digest) refuses a file with other content.
    pinned = "sha256:" + hashlib.sha256(weighted.read_bytes()).hexdigest()
    for path, ok in ((weighted, True), (uniform, False)):
        config = resolve(None, [model, "rollout.suite=arithmetic", f"rollout.curriculum={json.dumps(str(path))}",
                                f"rollout.curriculum_digest={json.dumps(pinned)}"])
        if ok:
            validate(config, local=True)
        else:
            with pytest.raises(TrainConfigError, match="is not the curriculum the config names"):
                validate(config, local=True)


@pytest.mark.slow
def test_a_train_run_keeps_its_curriculum_by_content_across_a_resume(tmp_path):
    """Step 1 enqueues only the curriculum's tasks and saves the file's bytes in the run directory,
    their sha256 in config.json. The file is then rebuilt with one task; `train --resume` warns and
    goes on with the saved copy (step 2 again enqueues the three). A tampered copy is refused."""
    profile, counts = curriculum_profile(tmp_path)
    kept = list(counts)[4:7]
    curriculum = tmp_path / "curriculum.json"
    cli("curriculum", str(profile), "--out", str(curriculum), "--mode", "keep")
    original = curriculum.read_bytes()
    from rollmarket.train.config import resolve
    from rollmarket.train.loop import Trainer

    config = resolve(None, [
        f"model.path={json.dumps(str(ROOT / 'models' / 'tiny-moe'))}", "rollout.suite=arithmetic",
        f"rollout.curriculum={json.dumps(str(curriculum))}", "rollout.groups_per_step=3", "rollout.group_size=2",
        "rollout.max_tokens=16", "agent.max_turns=1", "eval.tasks=0", "loop.steps=1",
        "rollout.precisions=['bf16']", "local.workers=['bf16']", "local.lease_ttl_s=8",
        f"runs_root={json.dumps(str(tmp_path / 'runs'))}"])
    run_dir = Trainer(config, local=True).run()

    def enqueued() -> Counter:
        with sqlite3.connect(run_dir / "exchange.db") as db:
            return Counter(json.loads(row[0])["task"]["task_id"] for row in db.execute("SELECT body FROM jobs"))

    assert enqueued() == Counter(kept)  # one step of 3 groups: each kept task once
    assert (run_dir / "curriculum.json").read_bytes() == original
    saved = json.loads((run_dir / "config.json").read_text())["config"]["rollout"]
    assert saved["curriculum_digest"] == "sha256:" + hashlib.sha256(original).hexdigest()

    data = json.loads(original)
    data["tasks"] = data["tasks"][:1]
    curriculum.write_text(json.dumps(data))
    resumed = cli("train", "--resume", str(run_dir), "--local", "loop.steps=2")
    assert f"warning {curriculum} changed since the run began" in " ".join(resumed.stdout.split())
    assert enqueued() == Counter({task: 2 for task in kept})  # the saved three again, not the file's one

    (run_dir / "curriculum.json").write_text(json.dumps(data))
    bad = cli("train", "--resume", str(run_dir), "--local", "loop.steps=3", ok=False)
    assert "is not the curriculum the config names" in bad.stderr
    assert enqueued() == Counter({task: 2 for task in kept})
