"""Evidence kept with its numbers (issue 13 §5): every measured number in docs/benchmarks.md and
docs/experiments.md is written by docs/render.py from a raw result committed in the repository, and
these tests fail when a doc and its results disagree, or a result is committed that no doc uses."""

from __future__ import annotations

import importlib.util
import json
import math
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


def test_experiment_a_interval_is_the_t_interval_of_the_seed_gains():
    """The renderer's t interval against one worked here from the per-seed files. With 3 seeds the t
    distribution has 2 degrees of freedom, whose quantile has a closed form:
    t_p = (2p - 1) * sqrt(2 / (4 p (1 - p))), 4.3027 at p = 0.975."""
    seeds = [json.loads(p.read_text()) for p in sorted((ROOT / "experiments/results/exp-a").glob("seed*.json"))]
    gains = [s["pass@1"][1] - s["pass@1"][0] for s in seeds]
    assert len(gains) == 3
    p = 0.975
    t = (2 * p - 1) * math.sqrt(2 / (4 * p * (1 - p)))
    mean = sum(gains) / 3
    sem = math.sqrt(sum((g - mean) ** 2 for g in gains) / 2) / math.sqrt(3)
    lo, hi = mean - t * sem, mean + t * sem
    assert (round(lo, 3), round(hi, 3)) == (0.002, 0.074)  # gains 0.030, 0.055, 0.030 by hand
    text = (ROOT / "docs/experiments.md").read_text()
    assert f"[{lo:+.3f}, {hi:+.3f}]".replace("-", "−") in text


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
