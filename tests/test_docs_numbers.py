"""Evidence kept with its numbers (issue 13 §5): every measured number in docs/benchmarks.md and
docs/experiments.md is written by docs/render.py from a raw result committed in the repository, and
these tests fail when a doc and its results disagree, or a result is committed that no doc uses."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def renderer():
    """docs/render.py as a fresh module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("docs_render", ROOT / "docs" / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_match_their_raw_results():
    """The check a contributor runs: exits 0 only when every generated block is what the results give."""
    done = subprocess.run([sys.executable, "docs/render.py", "--check"], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_changed_number_is_caught_and_restored():
    """Edit one digit of a table by hand: the renderer writes the result's number back, so --check fails."""
    render = renderer()
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| 16 | msgpack |"))
    tampered_row = row.replace("| 16 | msgpack | ", "| 16 | msgpack | 9", 1)
    tampered = text.replace(row, tampered_row)
    assert tampered != text
    assert render.render(tampered) == text


def test_check_fails_when_a_result_changes_and_the_rewrite_follows(tmp_path, monkeypatch):
    """A copy of the repository's docs and results where one raw number moved: --check exits 1 and
    changes nothing; the plain run rewrites the doc to the new number; --check then passes."""
    import shutil

    for folder in ("docs", "benchmarks/results", "experiments/results"):
        shutil.copytree(ROOT / folder, tmp_path / folder)
    (tmp_path / "models/tiny-start").mkdir(parents=True)
    shutil.copy(ROOT / "models/tiny-start/build_report.json", tmp_path / "models/tiny-start")
    path = tmp_path / "benchmarks/results/agent_collect.json"
    data = json.loads(path.read_text())
    data["rows"][2]["runs_per_s"] = 99.5
    path.write_text(json.dumps(data))
    doc = tmp_path / "docs/benchmarks.md"
    before = doc.read_text()

    def run(*args: str) -> int:
        render = renderer()
        monkeypatch.setattr(render, "ROOT", tmp_path)
        return render.main(list(args))

    assert run("--check") == 1
    assert doc.read_text() == before
    assert run() == 0
    row = next(line for line in doc.read_text().splitlines() if line.startswith("| 32 | 96 |"))
    assert "| 99.50 |" in row
    assert run("--check") == 0


def test_a_table_number_comes_from_the_json():
    """An independent read of one raw result: the exchange's 16-worker msgpack rate, in millions."""
    results = json.loads((ROOT / "benchmarks/results/exchange_throughput.json").read_text())["results"]
    rate = next(r["tokens_per_s"] for r in results if r["workers"] == 16 and r["mode"] == "msgpack")
    row = next(line for line in (ROOT / "docs/benchmarks.md").read_text().splitlines()
               if line.startswith("| 16 | msgpack |"))
    assert f"**{rate / 1e6:.2f}M**" in row


def test_experiment_a_gain_is_recomputed_from_the_raw_per_task_evals():
    """The doc's pass@1 gain, t interval and exact p against a computation here from each run's
    evals.jsonl alone (per task: correct samples / samples, at step 0 and at the last step)."""
    from scipy import stats as sps

    gains = []
    for evals in sorted((ROOT / "experiments/results/exp-a/runs").glob("*/*/evals.jsonl")):
        rows = [json.loads(line) for line in evals.read_text().splitlines() if line.strip()]
        last = max(r["step"] for r in rows)
        mean = {step: sum(sum(r["sampled_passed"]) / len(r["sampled_passed"]) for r in rows if r["step"] == step)
                / sum(r["step"] == step for r in rows) for step in (0, last)}
        assert {len(r["sampled_passed"]) for r in rows} == {16}
        gains.append(mean[last] - mean[0])
    assert len(gains) == 8
    lo, hi = sps.ttest_1samp(gains, 0).confidence_interval(0.95)
    # Exact sign-flip p: the share of the 2^8 sign patterns whose |sum| reaches the observed one.
    sums = [abs(sum(g if (k >> i) & 1 else -g for i, g in enumerate(gains))) for k in range(256)]
    p = sum(s >= abs(sum(gains)) - 1e-12 for s in sums) / 256
    text = (ROOT / "docs/experiments.md").read_text()
    row = f"| 8 | {sum(gains) / 8:+.3f} | [{lo:+.3f}, {hi:+.3f}]".replace("-", "−")
    assert row in text and f"| {p:.4f} (" in text


def test_an_unknown_block_is_an_error():
    render = renderer()
    with pytest.raises(render.RenderError, match="no-such-block"):
        render.render("<!-- generated: no-such-block -->\nx\n<!-- /generated -->\n")


def test_every_committed_result_is_used_by_a_doc():
    """A raw result no doc renders is evidence for nothing; a doc block without a renderer fails above."""
    render = renderer()
    for doc in render.DOCS:
        render.render((ROOT / doc).read_text())
    committed = {str(p.relative_to(ROOT)) for folder in ("benchmarks/results", "experiments/results")
                 for p in (ROOT / folder).rglob("*.json")}
    assert committed - render.LOADED == set()


def test_every_result_keeps_its_machine_and_date():
    """Each generated block that names a raw result also names the machine and the date it ran."""
    for doc in ("docs/benchmarks.md", "docs/experiments.md"):
        blocks = re.findall(r"<!-- generated: [a-z0-9-]+ -->\n(.*?)<!-- /generated -->", (ROOT / doc).read_text(), re.S)
        named = [b for b in blocks if re.search(r"(?i)raw results?:? `", b)]
        assert named, doc
        for text in named:
            assert re.search(r"Machine: \S", text) and re.search(r"Date: 2\d{3}-\d\d-\d\d", text), text
