"""Real workers on a real exchange: the tiny MoE runs the agent on suite tasks, groups arrive with
full provenance, policies reload with digest checks, and a worker killed mid-lease loses nothing."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import ExchangeProcess, served_model, sha
from rollmarket.contracts import AgentTrajectory, PolicyManifest, RolloutJob, SamplingConfig
from rollmarket.engines.provenance import checkpoint_digest, model_config, model_config_hash, tokenizer_hash
from rollmarket.tasks.suites import load_suite

REPO = Path(__file__).resolve().parents[1]
MOE = REPO / "models" / "tiny-moe"


def policy(version: int, path: Path, digest: str | None = None) -> PolicyManifest:
    return PolicyManifest(
        policy_version=version, parent_version=None if version == 0 else version - 1,
        checkpoint_digest=digest or checkpoint_digest(path), checkpoint_uri=str(path),
        tokenizer_hash=tokenizer_hash(path), model_config_hash=model_config_hash(path),
        vocab_size=int(model_config(path)["vocab_size"]), precision_class="bf16",
    )


def jobs(version: int, n: int, *, group_size: int = 2, suite: str = "arithmetic", start: int = 0,
         max_tokens: int = 64) -> list[RolloutJob]:
    tasks = load_suite(suite, "heldout")
    return [RolloutJob(task=tasks[start + i], policy_version=version, group_size=group_size,
                       sampling_config=SamplingConfig(temperature=1.0, max_tokens=max_tokens, seed=i),
                       max_context_tokens=2048) for i in range(n)]


class Worker:
    def __init__(self, url: str, worker_id: str, tmp: Path, precision: str = "bf16", model_url: str | None = None,
                 args: tuple[str, ...] = (), model: tuple[str, ...] | None = None):
        """`model`: the model options in full (default: --model-url `model_url`, else the shipped tiny-moe)."""
        self.events = tmp / f"{worker_id}.events.jsonl"
        self.rollouts = tmp / f"{worker_id}.rollouts.jsonl"
        self.log = open(tmp / f"{worker_id}.log", "ab")
        if model is None:
            model = ["--model-url", model_url] if model_url else ["--model", str(MOE), "--precision", precision]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rollmarket", "worker", *model,
             "--threads", "1", "--exchange", url, "--worker-id", worker_id, "--heartbeat-s", "0.4",
             "--lease-wait-s", "1", "--events", str(self.events), "--rollouts", str(self.rollouts), *args],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})

    def seen(self) -> list[dict]:
        if not self.events.exists():
            return []
        return [json.loads(line) for line in self.events.read_text().splitlines() if line.strip()]

    def wait_for(self, event: str, timeout: float = 120, **match) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in self.seen():
                if e["event"] == event and all(e.get(k) == v for k, v in match.items()):
                    return e
            assert self.proc.poll() is None, f"worker exited with {self.proc.returncode}"
            time.sleep(0.1)
        raise AssertionError(f"no {event} {match} in {timeout}s: {self.seen()[-5:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def wait_done(trainer, n: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(trainer.jobs(state="done", limit=500)) >= n:
            return
        time.sleep(0.25)
    raise AssertionError(f"jobs not done in {timeout}s: {trainer.jobs(limit=50)}")


@pytest.fixture
def exchange(tmp_path):
    ex = ExchangeProcess(tmp_path / "ex.db", tmp_path / "ex.log",
                         args=["--lease-ttl-s", "3", "--heartbeat-ttl-s", "2", "--reaper-interval-s", "0.2"]).start()
    yield ex
    ex.stop()


def resaved_checkpoint(tmp: Path, version: int) -> Path:
    """The shipped weights re-saved with new metadata: a new digest for the same numbers."""
    from safetensors.torch import load_file, save_file

    target = tmp / f"ckpt-v{version}"
    shutil.copytree(MOE, target)
    save_file(load_file(str(MOE / "model.safetensors")), str(target / "model.safetensors"),
              metadata={"format": "pt", "policy_version": str(version)})
    return target


@pytest.mark.slow
def test_worker_feeds_agent_groups_with_provenance_and_reloads(exchange, tmp_path):
    trainer = exchange.trainer()
    trainer.publish_policy(policy(0, MOE))
    worker = Worker(exchange.url, "moe-bf16", tmp_path)
    try:
        registered = worker.wait_for("registered")["manifest"]
        trainer.enqueue(jobs(0, 3, suite="chains"))
        wait_done(trainer, 3)
        fetched = trainer.fetch(limit=10).groups
        assert len(fetched) == 3
        runs = [AgentTrajectory.model_validate_json(line) for line in worker.rollouts.read_text().splitlines()]
        by_task = {}
        for run in runs:
            by_task.setdefault(run.task_id, {})[run.sample_index] = run
        saw_tool_output = False
        for item in fetched:
            group = item.group
            assert group.engine_name == "rollmarket-hf" and group.precision_class == "bf16"
            assert group.engine_fingerprint == registered["engine_fingerprint"]
            assert group.checkpoint_digest == checkpoint_digest(MOE)
            assert group.tokenizer_hash == tokenizer_hash(MOE)
            assert len(group.trajectories) == 2
            for t in group.trajectories:
                run = by_task[group.task_id][t.sample_index]
                n = t.num_response_tokens
                assert t.logprobs.shape == (n,) and t.routed_experts.shape == (n, 4, 2)
                assert t.reward == run.verification.reward
                assert len(t.turn_boundaries) == len(run.steps)
                actions = t.action_mask.astype(bool)
                assert actions.sum() == sum(s.num_response_tokens for s in run.steps)
                np.testing.assert_array_equal(t.logprobs[actions], np.concatenate([s.logprobs for s in run.steps]))
                if run.tool_calls:
                    saw_tool_output = saw_tool_output or bool(t.tool_output_mask.any())
        assert saw_tool_output, "chain tasks call tools: their outputs sit in the response, masked"

        # A new checkpoint: the worker checks its digest, loads it and acks; the quorum activates it.
        v1 = resaved_checkpoint(tmp_path, 1)
        trainer.publish_policy(policy(1, v1))
        assert trainer.wait_for_quorum(1, timeout=120).active_version == 1
        acked = worker.wait_for("reload_acked", version=1)
        assert acked["aligned"] is True
        trainer.enqueue(jobs(1, 1, start=10))
        wait_done(trainer, 4)
        [latest] = trainer.fetch(limit=10).groups
        assert latest.group.policy_version == 1 and latest.group.checkpoint_digest == checkpoint_digest(v1)

        # A manifest whose digest is not what the checkpoint holds: refused, never acked.
        trainer.publish_policy(policy(2, v1, digest=sha("weights nobody has")))
        refused = worker.wait_for("reload_refused", version=2)
        assert "digest" in refused["error"]
        assert trainer.pool().active_version == 1
        assert not [e for e in trainer.audit(limit=1000).events if e.kind == "reload.violation"]
    finally:
        worker.stop()


@pytest.mark.slow
def test_a_worker_killed_mid_lease_has_its_job_finished_by_another(exchange, tmp_path):
    trainer = exchange.trainer()
    trainer.publish_policy(policy(0, MOE))
    [job] = jobs(0, 1, group_size=8, suite="chains", max_tokens=96)
    first = Worker(exchange.url, "doomed", tmp_path)
    try:
        first.wait_for("registered")
        trainer.enqueue([job])
        leased = first.wait_for("leased")
        first.proc.send_signal(signal.SIGKILL)  # dies holding the lease: no fail report, no heartbeat
        first.proc.wait(10)
    finally:
        first.stop()
    assert not [e for e in first.seen() if e["event"] == "submitted"]
    second = Worker(exchange.url, "rescuer", tmp_path)
    try:
        wait_done(trainer, 1, timeout=240)
        [fetched] = trainer.fetch(limit=5).groups
        assert fetched.group.job_id == job.job_id and fetched.group.worker_id == "rescuer"
        assert len(fetched.group.trajectories) == 8
        kinds = {(e.kind, e.subject) for e in trainer.audit(limit=2000).events}
        assert ("lease.expired", leased["lease_id"]) in kinds or ("lease.abandoned", leased["lease_id"]) in kinds
        # The rescuer sampled the job with the job's seed: the same samples the first worker would have.
        assert second.wait_for("submitted")["task_id"] == job.task.task_id
    finally:
        second.stop()
    assert trainer.pool().jobs.get("done") == 1


@pytest.mark.slow
def test_a_worker_on_a_model_server_elsewhere(exchange, tmp_path):
    """--model-url: the worker samples from a server it does not own; its identity comes from the
    server's /v1/engine, and it acks a policy only when the server runs that checkpoint."""
    trainer = exchange.trainer()
    trainer.publish_policy(policy(0, MOE))
    with served_model(MOE, tmp_path / "serve.log", precision="fp8") as model_url:
        worker = Worker(exchange.url, "remote-fp8", tmp_path, model_url=model_url)
        try:
            manifest = worker.wait_for("registered")["manifest"]
            assert manifest["precision_classes"] == ["fp8"]
            assert manifest["quantization_classes"] == ["fp8-e4m3-per-channel"]
            worker.wait_for("reload_acked", version=0)
            trainer.enqueue([job.model_copy(update={"required_precision": "fp8",
                                                    "required_quantization": "fp8-e4m3-per-channel"})
                             for job in jobs(0, 1, start=3, group_size=3)])
            wait_done(trainer, 1)
            [fetched] = trainer.fetch(limit=5).groups
            group = fetched.group
            assert group.worker_id == "remote-fp8" and group.precision_class == "fp8"
            assert group.engine_fingerprint == manifest["engine_fingerprint"]
            assert all(t.routed_experts is not None for t in group.trajectories)
            # It cannot load weights: a new checkpoint is refused until the server runs it.
            trainer.publish_policy(policy(1, resaved_checkpoint(tmp_path, 1)))
            assert "reload the server" in worker.wait_for("reload_refused", version=1)["error"]
        finally:
            worker.stop()


@pytest.mark.slow
def test_a_job_no_worker_can_run_fails_for_good_and_the_worker_goes_on(exchange, tmp_path):
    trainer = exchange.trainer()
    trainer.publish_policy(policy(0, MOE))
    [good] = jobs(0, 1, start=5)
    broken = good.model_copy(update={"job_id": "job-broken", "idempotency_key": "job-broken",
                                     "task": good.task.model_copy(update={"verifier": "no-such-verifier"}),
                                     "priority": 5})
    worker = Worker(exchange.url, "steady", tmp_path)
    try:
        worker.wait_for("registered")
        trainer.enqueue([broken, good])
        failed = worker.wait_for("failed")
        assert "no-such-verifier" in failed["message"] and failed["job_state"] == "failed"
        worker.wait_for("submitted", task_id=good.task.task_id)
        assert [j.job.job_id for j in trainer.jobs(state="failed")] == ["job-broken"]
        assert worker.proc.poll() is None
    finally:
        worker.stop()
