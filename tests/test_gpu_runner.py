"""The device runner's test summary: pytest's junit XML → benchmarks/gpu_test_summary.py → the raw
result → the "GPU tests" block of docs/benchmarks.md (docs/render.py), on a real pytest run of a
small test file with one case of each outcome."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CASES = '''
import pytest

def test_passes():
    assert True

@pytest.mark.parametrize("x", [1, 2])
def test_fails_once(x):
    assert x == 1, "two is not one"

@pytest.mark.skip(reason="needs CUDA: run on the device")
def test_skipped():
    pass
'''


def test_the_summary_counts_what_pytest_ran_and_the_docs_say_so(tmp_path, monkeypatch):
    (tmp_path / "test_cases.py").write_text(CASES)
    junit = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", str(tmp_path / "test_cases.py"), "--noconftest", "-q",
                    "-p", "no:cacheprovider", "-o", "addopts=", f"--junitxml={junit}", f"--rootdir={tmp_path}"],
                   cwd=tmp_path, capture_output=True, timeout=120)
    out = tmp_path / "benchmarks" / "results" / "gpu_tests-cuda.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_test_summary.py"), str(junit), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = {r["test"]: r for r in json.loads(out.read_text())["rows"]}
    assert {name: r["outcome"] for name, r in rows.items()} == {
        "test_passes": "passed", "test_fails_once[1]": "passed", "test_fails_once[2]": "failed",
        "test_skipped": "skipped"}
    assert "two is not one" in rows["test_fails_once[2]"]["message"]
    assert rows["test_skipped"]["message"] == "needs CUDA: run on the device"

    spec = importlib.util.spec_from_file_location("docs_render_gpu", ROOT / "docs" / "render.py")
    render = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render)
    monkeypatch.setattr(render, "ROOT", tmp_path)
    text = render.BLOCKS["gpu-tests"]()
    assert "**2 passed, 1 failed, 1 skipped** of 4 cases" in text
    assert "| `test_fails_once` | 2 | 1 | 1 | 0 |" in text
    assert "- `test_fails_once[2]`: " in text and "two is not one" in text
    out.unlink()
    assert render.BLOCKS["gpu-tests"]().startswith("Not run yet")


def test_a_missing_junit_file_is_an_error_that_writes_nothing(tmp_path):
    out = tmp_path / "summary.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_test_summary.py"),
                           str(tmp_path / "absent.xml"), "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "no test result to summarize" in done.stderr
    assert not out.exists()
