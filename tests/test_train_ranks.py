"""`trainer.learner_ranks`: the trainer loop's learner over N processes (train/ranks.py), gloo on the CPU.

The equivalence case runs the real launch in this process (rank 0) with one spawned rank, and one
plain Learner beside it on the same rows: π_old scores, two steps (one of them with a rank left a
padding row), the checkpoint files, and a resume that restores the gathered optimizer state, all
against the single process. The failure case is a real `rollmarket train --local` whose rank 1 is
killed with SIGKILL after its first step: the trainer exits non-zero with a message naming it, its
local exchange and workers stop, and `--resume` finishes the run (held-out evaluation included).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rollmarket.train.batch import Datum
from rollmarket.train.config import resolve

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "tiny-dense"
RESPONSES = ["wait let me check: 3 + 4 = 7", "the answer is 12", "let me think about 5 and 6, notice that",
             "12 + 30 is 42", "done: 77"]
ADVANTAGES = [1.0, -1.0, 0.5, -0.5, 1.5]
ARGS = [f"model.path={json.dumps(str(MODEL))}", "optim.lr=1e-3", "algorithm.updates_per_batch=2", "model.threads=1"]
ATOL = 4.1e-3
"""Adam moves a weight by about lr·sign(g): where g is ~0, summation order over ranks can flip the sign."""


def _close_tensors(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for name, tensor in want.items():
        assert got[name].shape == tensor.shape, (what, name)
        torch.testing.assert_close(got[name], tensor, atol=ATOL, rtol=0, msg=lambda m: f"{what} {name}: {m}")
        # ATOL is about a step's move: most elements must agree far more closely than that
        assert float((got[name] - tensor).abs().le(1e-5).double().mean()) > 0.99, (what, name)


def _same_checkpoint(got: Path, want: Path) -> None:
    """The same files (names and layout), the same weights, the same optimizer state and counters."""
    files = lambda root: sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())  # noqa: E731
    assert files(got) == files(want)
    weights = load_file(want / "model.safetensors")
    _close_tensors(load_file(got / "model.safetensors"), weights, "weights")
    base = load_file(MODEL / "model.safetensors")
    moved = sum(int((weights[k] != base[k]).sum()) for k in weights)
    assert moved > 0.5 * sum(t.numel() for t in weights.values())  # the steps did update the weights
    got_opt, want_opt = (torch.load(p / "trainer" / "optimizer.pt", weights_only=True) for p in (got, want))
    # torch.distributed.checkpoint hands AdamW's betas back as a list: the same values
    tuples = lambda groups: [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in groups]  # noqa: E731
    assert tuples(got_opt["param_groups"]) == tuples(want_opt["param_groups"])
    assert got_opt["state"].keys() == want_opt["state"].keys()
    for index, state in want_opt["state"].items():
        for key, value in state.items():
            # Adam's second moment is g²: compare it on the gradient's scale
            scale = value.abs().max().clamp(min=1e-12) if key == "exp_avg_sq" else 1.0
            torch.testing.assert_close(got_opt["state"][index][key] / scale, value / scale, atol=ATOL, rtol=1e-3,
                                       msg=lambda m: f"optimizer {index} {key}: {m}")
    got_state, want_state = (json.loads((p / "trainer" / "state.json").read_text()) for p in (got, want))
    assert got_state["steps_done"] == want_state["steps_done"] and got_state["step"] == want_state["step"]


def _batch(single):
    """(pairs, the single learner's π_old scores of them, datums with π_old a little off the policy)."""
    tok = single.loaded.tokenizer
    prompt = np.asarray(tok("Q: add the numbers.", add_special_tokens=False)["input_ids"])
    pairs = [(prompt, np.asarray(tok(r, add_special_tokens=False)["input_ids"])) for r in RESPONSES]
    scores = single.score(pairs, temperature=0.8)
    rng = np.random.default_rng(0)
    data = []
    for (p, r), s, adv in zip(pairs, scores, ADVANTAGES):
        action_T = np.ones(len(r), dtype=np.float32)
        action_T[-1] = 0.0
        old_T = s.logprobs_T + rng.normal(0, 0.3, len(r)).astype(np.float32)
        data.append(Datum(p, r, s.logprobs_T.copy(), action_T, advantage=adv, old_logprobs_T=old_T))
    return pairs, scores, data


@pytest.mark.slow
def test_two_ranks_score_step_save_and_resume_as_one_process(tmp_path):
    from rollmarket.train.learner import Learner
    from rollmarket.train.ranks import learner_ranks

    single = Learner(resolve(None, ARGS))
    ranked_config = resolve(None, [*ARGS, "trainer.learner_ranks=2"])
    pairs, want_scores, data = _batch(single)
    # Three rows in two mini-batches ([2, 1]): rank 1 holds a padding row in the second.
    second = [replace(d, old_logprobs_T=None) for d in data[:3]]
    state = {"step": 2, "seen": 0, "solved": 0, "base_version": 0}

    with learner_ranks(ranked_config) as ranked:
        got_scores = ranked.score(pairs, temperature=0.8)
        ranked_metrics = [ranked.step(data, 0.8), ranked.step(second, 0.8)]
        ranked.save(tmp_path / "ranks" / "v0002", version=2, extra_state=state)
    want_metrics = [single.step(data, 0.8), single.step(second, 0.8)]
    single.save(tmp_path / "one" / "v0002", version=2, extra_state=state)

    assert len(got_scores) == len(want_scores)
    for got, want in zip(got_scores, want_scores):
        np.testing.assert_allclose(got.logprobs_T, want.logprobs_T, atol=1e-5)
    for got, want in zip(ranked_metrics, want_metrics):  # the whole batch's figures, not rank 0's rows'
        assert got["actor/num_minibatches"] == want["actor/num_minibatches"] == 2
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert got[key] == (None if value is None else pytest.approx(value, rel=1e-3, abs=1e-5)), key
    _same_checkpoint(tmp_path / "ranks" / "v0002", tmp_path / "one" / "v0002")

    # Resume: every rank restores the checkpoint's optimizer state, and the next step is one process's.
    state["step"] = 3
    with learner_ranks(ranked_config, resume_from=tmp_path / "ranks" / "v0002") as ranked:
        ranked.step(data, 0.8)
        ranked.save(tmp_path / "ranks" / "v0003", version=3, extra_state=state)
    single.step(data, 0.8)
    single.save(tmp_path / "one" / "v0003", version=3, extra_state=state)
    _same_checkpoint(tmp_path / "ranks" / "v0003", tmp_path / "one" / "v0003")


@pytest.mark.slow
def test_two_ranks_train_lora_adapters_as_one_process(tmp_path):
    """LoRA under ranks: the adapters and the merged weights (gathered from sharded A, B) of one step."""
    from rollmarket.train.learner import Learner
    from rollmarket.train.ranks import learner_ranks

    args = [*ARGS, "lora.enabled=true", "optim.lr=1e-2"]
    single = Learner(resolve(None, args))
    _, _, data = _batch(single)
    state = {"step": 1, "seen": 0, "solved": 0, "base_version": 0}
    with learner_ranks(resolve(None, [*args, "trainer.learner_ranks=2"])) as ranked:
        ranked.step(data, 0.8)
        ranked.step(data, 0.8)  # LoRA's B starts at 0: the second step moves the merged weights
        ranked.save(tmp_path / "ranks" / "v0001", version=1, extra_state=state)
    single.step(data, 0.8)
    single.step(data, 0.8)
    single.save(tmp_path / "one" / "v0001", version=1, extra_state=state)
    adapters = load_file(tmp_path / "one" / "v0001" / "trainer" / "adapters.safetensors")
    assert any(float(t.abs().max()) > 0 for k, t in adapters.items() if "lora_B" in k)  # the adapters trained
    _close_tensors(load_file(tmp_path / "ranks" / "v0001" / "trainer" / "adapters.safetensors"), adapters, "adapters")
    merged = load_file(tmp_path / "one" / "v0001" / "model.safetensors")
    base = load_file(MODEL / "model.safetensors")
    assert any(not torch.equal(merged[k], base[k]) for k in merged)  # the merge is in the published weights
    _close_tensors(load_file(tmp_path / "ranks" / "v0001" / "model.safetensors"), merged, "merged weights")


QUICK = [f"model.path={json.dumps(str(MODEL))}", "rollout.suite=arithmetic", "rollout.groups_per_step=2",
         "rollout.group_size=2", "rollout.temperature=2.0", "rollout.max_tokens=32", "agent.max_turns=2",
         "rollout.precisions=['bf16']", "eval.tasks=1", "eval.samples=1", "optim.lr=1e-4", "loop.fetch_timeout_s=120",
         "loop.quorum_timeout_s=120", "local.lease_ttl_s=8", "local.workers=['bf16']", "model.threads=1",
         "trainer.learner_ranks=2"]
STOP_S = 90.0
"""Longest the trainer may take to exit once a rank is dead (ranks.GRACE_S plus teardown of the local cluster)."""


def _children(pid: int) -> dict[int, str]:
    """The live child processes of `pid`: their command lines."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                out[int(stat.parent.name)] = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return out


def _wait_for(condition, timeout: float, what: str, process: subprocess.Popen | None = None):
    """`condition()`'s first true value, polled; fails after `timeout` or when `process` ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := condition()):
            return value
        assert process is None or process.poll() is None, f"the trainer exited before {what}: {process.communicate()}"
        time.sleep(0.2)
    raise AssertionError(f"no {what} within {timeout:.0f}s")


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="NCCL ranks: run where two GPUs exist (benchmarks/gpu_run.sh ranks-kill)"))])
def test_a_killed_rank_stops_the_trainer_and_the_run_resumes(tmp_path, device):
    """On the CPU rank 0's next gloo collective fails by itself; with NCCL on two GPUs it may wait
    forever, so the watcher interrupts the loop (or exits after ranks.GRACE_S): either way the
    trainer stops within STOP_S, and the run resumes."""
    from test_train_resume import check_run, jsonl

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("ROLLMARKET_FAILPOINTS", None)
    trainer = subprocess.Popen(
        [sys.executable, "-m", "rollmarket", "train", "--local", *QUICK, "loop.steps=3",
         f"model.device={device}", f"runs_root={json.dumps(str(tmp_path))}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        run_dir = _wait_for(lambda: next(tmp_path.iterdir(), None), 120, "run directory", trainer)
        _wait_for(lambda: any(r["step"] == 1 for r in jsonl(run_dir / "metrics.jsonl")), 300, "step 1", trainer)
        ranks = {pid: cmd for pid, cmd in _children(trainer.pid).items() if "spawn_main" in cmd}
        assert len(ranks) == 1, _children(trainer.pid)
        (rank1,) = ranks
        others = {pid: cmd for pid, cmd in _children(trainer.pid).items() if pid != rank1}  # exchange, workers
        os.kill(rank1, signal.SIGKILL)
        killed_at = time.monotonic()
        out, err = trainer.communicate(timeout=STOP_S)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.communicate()
    assert trainer.returncode != 0
    stopped_s = time.monotonic() - killed_at
    assert stopped_s < STOP_S
    print(f"stopped {stopped_s:.1f}s after the kill: {err.strip().splitlines()[-1]}")
    assert f"learner rank 1 (pid {rank1}) was killed by signal 9" in out + err, (out, err)
    # Nothing is left behind: the local exchange and workers were stopped with the trainer.
    _wait_for(lambda: all(_state(pid) == "Z" for pid in others), 30, "the trainer's children to exit")
    done = {r["step"] for r in jsonl(run_dir / "metrics.jsonl")}
    assert 1 in done and 3 not in done, done

    resumed = subprocess.run([sys.executable, "-m", "rollmarket", "train", "--resume", str(run_dir), "--local"],
                             capture_output=True, text=True, env=env, timeout=300)
    assert resumed.returncode == 0, (resumed.stdout, resumed.stderr)
    # Evaluated before and after (rank 0 serves the checkpoint): one row per step, step 0 too.
    check_run(run_dir, run_dir / "exchange.db", steps=3, groups_per_step=2, group_size=2, evaluated=True)


def _state(pid: int) -> str:
    """A process's state letter; "Z" for one that is gone too."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"
