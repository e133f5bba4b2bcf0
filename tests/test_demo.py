"""The fault-path demo: `rollmarket demo paths` runs real processes, `rollmarket train` among them, and
every path fires.

The paths are recounted from the run's audit log, not taken from the demo's own summary."""

from __future__ import annotations

import fnmatch
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_demo_fires_every_path_and_writes_its_run_directory(tmp_path):
    # Generous limits: on a loaded 2-core box (CI beside two training runs) every path took more
    # than 200 s to fire; the demo stops by itself at --timeout and the test waits past that (the
    # suite's 300 s pytest-timeout cut it once, at 300 s, on a box running three workers and more).
    done = subprocess.run(
        [sys.executable, "-m", "rollmarket", "demo", "paths", "--runs-dir", str(tmp_path), "--timeout", "420"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [run_dir] = list(tmp_path.iterdir())
    for name in ("demo.json", "config.json", "summary.json", "metrics.jsonl", "audit.jsonl", "exchange.db"):
        assert (run_dir / name).exists(), name
    assert any((run_dir / "logs").iterdir()) and any((run_dir / "workers").iterdir())

    events = [json.loads(line) for line in (run_dir / "audit.jsonl").read_text().splitlines()]
    kinds = Counter(e["kind"] for e in events)
    decided = Counter(e["data"]["status"] for e in events if e["kind"] == "group.decided")
    arrived = Counter(e["data"]["tier"] for e in events if e["kind"] == "group.accepted")
    assert decided["train"] > 0
    assert decided["train_with_correction"] > 0
    assert decided["replay"] + arrived["replay"] > 0
    assert decided["quarantine"] + arrived["quarantine"] > 0
    assert kinds["submission.rejected"] > 0
    assert kinds["lease.expired"] > 0
    assert kinds["lease.abandoned"] > 0 and kinds["worker.dead"] > 0
    assert kinds["policy.activated"] >= 2
    assert kinds["reload.violation"] > 0

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["all_paths_fired"] is True
    assert summary["workers"]["honest-a"]["rejected"] == 0
    assert summary["workers"]["no-logprobs"]["rejection_reasons"].get("missing_logprobs", 0) > 0
    assert summary["workers"]["crashing"]["status"] == "dead"
    # Dispatch learned from feedback: honest workers end ranked above the ones that send garbage.
    quality = {w: row["quality"] for w, row in summary["workers"].items()}
    assert min(quality["honest-a"], quality["honest-b"]) > max(quality["toxic-tokenizer"], quality["no-logprobs"])

    # The real workers ran the agent on suite tasks at three precisions; their groups went through
    # teacher forcing at fp32. fp32 rollouts agree with the fp32 trainer almost exactly, bf16 and
    # fp8 less so, and routing was compared.
    engines = summary["engines"]
    assert set(engines) == {"tiny-moe-fp32", "tiny-moe-bf16", "tiny-moe-fp8"}
    for worker_id, row in engines.items():
        assert row["groups_accepted"] > 0 and row["runs"] >= 4, (worker_id, row)
        assert 0.0 <= row["reward_mean"] <= 1.0 and 0.0 <= row["pass_at_k"]["1"] <= 1.0
        assert row["groups_scored"] > 0, (worker_id, row)
        assert 0.9 < row["token_ess_mean"] <= 1.0
        assert row["router_flip_rate"] is not None and 0.0 <= row["router_flip_rate"] < 0.5
    assert engines["tiny-moe-fp32"]["mean_abs_delta"] < engines["tiny-moe-fp8"]["mean_abs_delta"]
    # The arithmetic suite is what the tiny MoE does best: it gets a fair share right.
    assert max(row["reward_mean"] for row in engines.values()) > 0.3
    rollouts = list((run_dir / "workers").glob("*.rollouts.jsonl"))
    assert len(rollouts) == 3 and all(p.stat().st_size for p in rollouts)
    assert any((run_dir / "checkpoints").iterdir())

    # It ends with the observatory matrix over the real workers' runs.
    from rollmarket.contracts import ObservatoryMatrix

    matrix = ObservatoryMatrix.model_validate_json((run_dir / "matrix.json").read_text())
    assert sorted(matrix.rollout_engines) == ["bf16", "fp32", "fp8"] and matrix.trainer_engines == ["fp32", "bf16"]
    assert len(matrix.cells) == 6 and all(c.n >= 4 and c.token_ess.mean is not None for c in matrix.cells)
    assert {p.max_tokens for p in matrix.length_scaling} == {64, 256}
    assert matrix.divergence, "same tasks, same seeds on three precisions: the runs were compared"
    assert "rollmarket dashboard --runs" in done.stdout + done.stderr

    metrics_doc = (ROOT / "docs/metrics.md").read_text()
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert lines, "no trainer steps recorded"
    patterns = re.findall(r"`([^`\s]+\*)`", metrics_doc)  # e.g. `rollout_corr/rollout_is_*`

    def documented(key: str) -> bool:
        parts = key.split("/")
        generic = "/".join(parts[:1] + ["<precision>"] + parts[2:]) if len(parts) == 3 else key
        return (f"`{key}`" in metrics_doc or f"`{generic}`" in metrics_doc
                or any(fnmatch.fnmatchcase(key, p) for p in patterns))

    undocumented = {key for line in lines for key in line if not documented(key)}
    assert not undocumented, f"metrics.jsonl keys missing from docs/metrics.md: {undocumented}"

    # The trainer was `rollmarket train` (train/loop.py): its config and checkpoints (with the optimizer
    # state and step counters) are in the run directory, and every decision a written step counts
    # reached the exchange under the trainer's id (the step it was stopped in may have reported its
    # decisions before writing its row, never the other way round).
    trainer = json.loads((run_dir / "config.json").read_text())["config"]
    assert trainer["loop"]["mode"] == "async" and trainer["model"]["path"].endswith("tiny-moe")
    assert any((c / "trainer" / "state.json").exists() for c in (run_dir / "checkpoints").iterdir())
    trainer_id = json.loads((run_dir / "start.json").read_text())["trainer_id"]
    by_trainer = sum(1 for e in events if e["kind"] == "group.decided" and e["actor"] == trainer_id)
    counted = sum(line["num_groups"] for line in lines)
    assert [line["step"] for line in lines] == list(range(1, len(lines) + 1))
    assert counted <= by_trainer <= counted + trainer["rollout"]["groups_per_step"]
    assert by_trainer == sum(decided.values()), "only the trainer decides groups"
