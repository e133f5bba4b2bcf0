"""`rollmarket collect` against the served tiny model: resumable after kill -9, failures kept apart,
bad task files refused; `rollmarket profile` on what it wrote."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from helpers import served_model
from rollmarket.localhost import free_port

REPO = Path(__file__).resolve().parents[1]
MOE = REPO / "models" / "tiny-moe"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with served_model(MOE, tmp_path_factory.mktemp("collect") / "serve.log") as url:
        yield url


def collect_cmd(url: str, out: Path, tmp: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "rollmarket", "collect", "--tasks", "arithmetic:heldout", "--model-url", url,
            "--out", str(out), "--runs-dir", str(tmp / "runs"), "--max-tokens", "64", *extra]


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_collect_resumes_after_kill_9_without_losing_or_repeating_runs(server, tmp_path):
    out = tmp_path / "rollouts.jsonl"
    cmd = collect_cmd(server, out, tmp_path, "--limit", "12", "--repeats", "4", "--concurrency", "4")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(out.read_text().splitlines() if out.exists() else []) < 8:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    first = len(lines(out))
    assert 8 <= first < 48, "killed mid-way"
    with open(out, "a") as handle:  # what a crash mid-write leaves: half a line
        handle.write('{"task_id": "arithmetic-heldout-0011", "sample_ind')
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = lines(out)
    keys = Counter((r["task_id"], r["sample_index"]) for r in runs)
    assert len(keys) == 48 and max(keys.values()) == 1, "every (task, sample) exactly once"
    assert all(r["verification"] is not None and r["steps"] for r in runs)
    # A finished collection is a no-op.
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and len(lines(out)) == 48
    assert "0 new runs" in again.stderr.replace("\n", " ")

    profile = subprocess.run([sys.executable, "-m", "rollmarket", "profile", str(out)], capture_output=True,
                             text=True, timeout=120)
    assert profile.returncode == 0, profile.stderr
    report = json.loads(out.with_name("rollouts.profile.json").read_text())
    assert report["overall"]["samples"] == 48 and report["overall"]["tasks"] == 12
    for row in report["tasks"]:
        mine = [r for r in runs if r["task_id"] == row["task_id"]]
        assert row["correct"] == sum(r["verification"]["passed"] for r in mine)


def test_failed_runs_go_to_the_failures_file_and_are_retried(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}/v1"
    out = tmp_path / "rollouts.jsonl"
    cmd = collect_cmd(dead, out, tmp_path, "--limit", "2", "--repeats", "2", "--model", "tiny-moe")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    failures = lines(tmp_path / "rollouts.failures.jsonl")
    assert len(failures) == 4 and {f["terminal_reason"] for f in failures} == {"model_error"}
    assert lines(out) == []


def test_a_bad_tasks_file_is_refused_with_its_line(tmp_path, server):
    tasks = tmp_path / "tasks.jsonl"
    good = json.dumps({"task_id": "t1", "prompt": "What is 2 + 2?", "verifier": "numeric", "answer": "4"})
    tasks.write_text(good + "\n" + '{"task_id": "t2", "verifier": "numeric"}\n')
    done = subprocess.run([sys.executable, "-m", "rollmarket", "collect", "--tasks", str(tasks), "--model-url", server,
                           "--out", str(tmp_path / "o.jsonl"), "--runs-dir", str(tmp_path / "runs")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and ":2:" in done.stderr, done.stderr
    tasks.write_text(json.dumps({"task_id": "t1", "prompt": "hi", "verifier": "no-such-verifier"}) + "\n")
    done = subprocess.run([sys.executable, "-m", "rollmarket", "collect", "--tasks", str(tasks), "--model-url", server,
                           "--out", str(tmp_path / "o.jsonl"), "--runs-dir", str(tmp_path / "runs")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "no-such-verifier" in done.stderr
    assert not (tmp_path / "o.jsonl").exists()


def test_collect_with_tools_and_verifiers_on_a_resources_server(server, tmp_path):
    """--resources-url: every tool call and every verdict goes over HTTP to `rollmarket verifier
    serve`, one session per run; the results match what the in-process tools would say."""
    import subprocess as sp

    from rollmarket.agents.tools import run_tool
    from rollmarket.agents.workspace import task_workspace
    from rollmarket.localhost import wait_healthy
    from rollmarket.tasks.suites import load_suite

    port = free_port()
    with open(tmp_path / "resources.log", "ab") as log:
        proc = sp.Popen([sys.executable, "-m", "rollmarket", "verifier", "serve", "--port", str(port)],
                        stdout=log, stderr=sp.STDOUT)
    out = tmp_path / "rollouts.jsonl"
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, log=tmp_path / "resources.log", timeout=60)
        cmd = collect_cmd(server, out, tmp_path, "--limit", "4", "--repeats", "2",
                          "--resources-url", f"http://127.0.0.1:{port}")
        cmd[cmd.index("arithmetic:heldout")] = "lookup:heldout"
        done = sp.run(cmd, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    finally:
        proc.terminate()
        proc.wait(20)
    runs = lines(out)
    assert len(runs) == 8 and all(r["verification"] is not None for r in runs)
    tasks = {t.task_id: t for t in load_suite("lookup", "heldout")}
    calls = 0
    for r in runs:
        task = tasks[r["task_id"]]
        for s in r["steps"]:
            for call in s["tool_calls"]:
                if call["arguments"] is None:
                    continue
                with task_workspace(task.files) as context:
                    assert call["result"]["content"] == run_tool(call["name"], call["arguments"], context).content
                calls += 1
    assert calls >= 4, "lookup tasks call web_search or read_file"
