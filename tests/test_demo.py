"""The main job: `rollmarket demo` runs real processes and every path fires.

The paths are recounted from the run's audit log, not taken from the demo's own summary."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_fires_every_path_and_writes_its_run_directory(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "rollmarket", "demo", "--runs-dir", str(tmp_path), "--timeout", "200"],
        capture_output=True, text=True, timeout=280, cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [run_dir] = list(tmp_path.iterdir())
    for name in ("config.json", "summary.json", "metrics.jsonl", "audit.jsonl", "exchange.db"):
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

    # The real engine worker's groups went through teacher forcing: bf16 sampling vs fp32 scoring
    # of the same tiny MoE agree closely but not exactly, and routing was compared.
    engine = summary["engine"]
    assert engine["groups"] > 0, summary["workers"]["engine-bf16"]
    assert 0.9 < engine["token_ess_mean"] <= 1.0
    assert 0.0 < engine["mean_abs_delta"] < 0.5
    assert engine["router_flip_rate"] is not None and 0.0 <= engine["router_flip_rate"] < 0.5

    metrics_doc = (ROOT / "docs/metrics.md").read_text()
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert lines, "no trainer steps recorded"
    undocumented = {key for line in lines for key in line} - {
        key for key in {k for line in lines for k in line} if f"`{key}`" in metrics_doc}
    assert not undocumented, f"metrics.jsonl keys missing from docs/metrics.md: {undocumented}"
