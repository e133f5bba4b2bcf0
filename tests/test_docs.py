"""Docs that tests keep honest: every route, setting, metric, reason, audit kind and error code a
user can meet is written down, the CLI reference matches --help, and the README quickstart runs."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rollmarket.contracts import DecisionReason, ErrorCode, LeaseState, NoLeaseReason, RejectionReason
from rollmarket.exchange import ExchangeSettings, create_app
from rollmarket.exchange.metrics import ExchangeMetrics
from rollmarket.gate import GateConfig

from helpers import TRAINER_TOKEN

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def read(name: str) -> str:
    return (ROOT / name).read_text()


def test_readme_opens_with_the_two_commands():
    head = read("README.md")[:600]
    assert "make demo" in head and "make test" in head


def test_every_link_in_the_docs_resolves_inside_the_repository():
    """A reader of a fresh clone has only the repository: a relative link that leaves it, or points
    at nothing, is a dead end (the README once sent contributors to ../shared/)."""
    broken = []
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL or an anchor on the same page
            path = (page.parent / target.split("#", 1)[0]).resolve()
            if not path.is_relative_to(ROOT) or not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
        if "../shared/" in page.read_text():
            broken.append(f"{page.relative_to(ROOT)}: mentions ../shared/, outside the repository")
    assert not broken, broken


def test_cli_reference_matches_help():
    """Regenerate with `python -m rollmarket.cli.reference > docs/cli.md`. Rendered in a fresh
    process: click caches each command's help option the first time a context asks for it, so
    commands invoked in this process (CliRunner) could render differently from a user's --help."""
    done = subprocess.run([sys.executable, "-m", "rollmarket.cli.reference"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert (DOCS / "cli.md").read_text() == done.stdout


def test_every_route_is_documented():
    app = create_app(ExchangeSettings(trainer_token="x"))
    doc = (DOCS / "exchange.md").read_text()
    paths = {route.path for route in app.routes if route.path not in ("/docs/oauth2-redirect", "/redoc")}
    missing = [p for p in sorted(paths) if f"`{p}`" not in doc]
    assert not missing, f"routes missing from docs/exchange.md: {missing}"


@pytest.mark.parametrize("model,prefix", [(ExchangeSettings, ""), (GateConfig, "gate-")])
def test_every_setting_is_documented(model, prefix):
    doc = (DOCS / "exchange.md").read_text()
    flags = [f"--{prefix}{name.replace('_', '-')}" for name in model.model_fields if name != "gate"]
    missing = [f for f in flags if f"`{f}`" not in doc]
    assert not missing, f"settings missing from docs/exchange.md: {missing}"


def test_every_prometheus_metric_is_documented():
    doc = (DOCS / "metrics.md").read_text()
    missing = [name for name in ExchangeMetrics().names() if f"`{name}" not in doc]
    assert not missing, f"metrics missing from docs/metrics.md: {missing}"


def test_every_reason_and_error_code_is_documented():
    gate = (DOCS / "gate.md").read_text()
    exchange = (DOCS / "exchange.md").read_text()
    for reason in [*RejectionReason, *DecisionReason]:
        assert f"`{reason.value}`" in gate, reason
    for reason in RejectionReason:
        assert f"`{reason.value}`" in exchange, reason
    for code in ErrorCode:
        assert f"`{code.value}`" in exchange, code
    for reason in NoLeaseReason:
        assert reason.value in exchange or reason.value in (DOCS / "contracts.md").read_text(), reason


def test_every_audit_kind_is_documented():
    source = (ROOT / "src/rollmarket/exchange/stores/sql.py").read_text()
    kinds = set(re.findall(r'_audit\(conn, now, "([a-z_.]+)"', source))
    kinds |= {f"lease.{state.value}" for state in LeaseState if state not in (LeaseState.issued, LeaseState.submitted)}
    kinds |= {"lease.issued", "job.failed", "job.expired"}
    doc = (DOCS / "exchange.md").read_text()
    missing = sorted(k for k in kinds if f"`{k}`" not in doc)
    assert not missing, f"audit kinds missing from docs/exchange.md: {missing}"


def test_readme_quickstart_runs_against_a_served_exchange(start_exchange, tmp_path):
    """The README's Python block, verbatim, against a real exchange."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", read("README.md"), flags=re.S)
              if "TrainerClient" in b]
    assert blocks, "README has no exchange quickstart"
    script = tmp_path / "quickstart.py"
    script.write_text(blocks[0])
    server = start_exchange()
    env = {**os.environ, "ROLLMARKET_URL": server.url, "ROLLMARKET_TRAINER_TOKEN": TRAINER_TOKEN}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "stored in tier fresh" in done.stdout
    assert re.search(r"grp_\w+ train \['within_budget'\]", done.stdout), done.stdout
    status = server.trainer().pool()
    assert status.groups.get("fresh", 0) == 0  # consumed by the train decision
    assert status.jobs == {"done": 1}


def test_every_serve_route_and_setting_is_documented():
    from types import SimpleNamespace

    from rollmarket.serve import ServeSettings, create_serve_app

    # The route table needs no model: the app is built but never started.
    engine = SimpleNamespace(info=SimpleNamespace(name="m", eos_token_ids=(0,)), tokenizer=None)
    app = create_serve_app(engine, ServeSettings(model_path="m"))
    doc = (DOCS / "serve.md").read_text()
    paths = {r.path for r in app.routes if r.path not in ("/docs", "/docs/oauth2-redirect", "/redoc",
                                                          "/openapi.json")}
    assert "/v1/chat/completions" in paths
    missing = [p for p in sorted(paths) if f"{p}`" not in doc]
    assert not missing, f"routes missing from docs/serve.md: {missing}"
    flags = [f"--{name.replace('_', '-')}" for name in ServeSettings.model_fields if name != "model_path"]
    missing = [f for f in flags if f"`{f}`" not in doc]
    assert not missing, f"settings missing from docs/serve.md: {missing}"


def _start(cmd: list[str], log: Path, url: str) -> subprocess.Popen:
    from rollmarket.localhost import wait_healthy

    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    wait_healthy(url, proc, log=log, timeout=120)
    return proc


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:] if end == -1 else text[start:end]


@pytest.mark.timeout(660)  # its own waits outlast the suite's 300 s on a loaded box
def test_readme_first_quickstart_runs_as_pasted(tmp_path):
    """The README's first quickstart as a new user pastes it after `make demo`: a fresh shell whose
    PATH lacks the virtualenv runs the bash block (which puts .venv/bin on the PATH and waits for
    the servers), the Python block and the captures export, in a directory laid out like the
    repository root (.venv and models/). Only the ports change: 8000 and 8001 may be taken on a
    shared machine. The tiny model must call the calculator and answer 391, the proxy must have
    captured both turns of the conversation, and the engines snippet must run."""
    from rollmarket.localhost import free_port

    section = _section(read("README.md"), "## Quickstart: serve a model")
    [shell] = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    client_block, engines_block = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    [export_line] = re.findall(r"`(rollmarket captures export [^`]*)`", section)
    assert "activate" in shell and "rollmarket serve-model" in shell and "rollmarket proxy" in shell
    serve_port, proxy_port = free_port(), free_port()

    def local(text: str) -> str:
        return text.replace("8000", str(serve_port)).replace("8001", str(proxy_port))

    venv = Path(sys.prefix)
    assert (venv / "bin" / "activate").is_file(), f"tests must run in the project's virtualenv, not {venv}"
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / ".venv").symlink_to(venv)
    (checkout / "models").symlink_to(ROOT / "models")
    (checkout / "client.py").write_text(local(client_block))
    # The background servers end with the script; `set -e` stops at the first failing command.
    (checkout / "quickstart.sh").write_text("trap 'kill $(jobs -p) 2>/dev/null; wait' EXIT\nset -e\n" + local(shell)
                                            + "python client.py\n" + export_line + "\n")
    env = {"HOME": str(tmp_path), "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
           "OMP_NUM_THREADS": "1"}  # one torch thread: the 2-core test machine is shared
    proc = subprocess.Popen(["bash", "quickstart.sh"], cwd=checkout, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert 'tool call calculator {"expression": "17 * 23"} -> 391' in out, out
    assert "answer: 391" in out.splitlines(), out
    captures = [json.loads(line) for line in (checkout / "captures.jsonl").read_text().splitlines()]
    assert [c["turn_index"] for c in captures] == [0, 1]
    assert len({c["conversation_id"] for c in captures}) == 1
    for capture in captures:
        choice = capture["choices"][0]
        assert capture["prompt_token_ids"] and choice["response_token_ids"]
        assert len(choice["routed_experts"]) == len(choice["response_token_ids"])
    script = tmp_path / "engines.py"
    script.write_text(engines_block)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("fp1:") == 2


def test_readme_python_needs_only_runtime_dependencies():
    """`pip install rollmarket` must be enough for every Python snippet in the README (`openai` is a
    runtime dependency because the first quickstart uses it)."""
    import ast
    import tomllib
    from importlib.metadata import packages_distributions

    def canonical(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    runtime = {canonical(re.split(r"[<>=!~\[ ;]", dep, maxsplit=1)[0])
               for dep in tomllib.loads(read("pyproject.toml"))["project"]["dependencies"]}
    owners = packages_distributions()
    for block in re.findall(r"```python\n(.*?)```", read("README.md"), flags=re.S):
        for node in ast.walk(ast.parse(block)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            for module in {n.split(".")[0] for n in names} - set(sys.stdlib_module_names) - {"rollmarket"}:
                dists = {canonical(d) for d in owners.get(module, [module])}
                assert dists & runtime, f"the README imports {module}, which no runtime dependency provides"


def test_readme_agents_quickstart_runs(tmp_path):
    """The README's collect + profile quickstart against a real server, verbatim but for the port,
    the output paths and a task limit (the full suite takes minutes on a busy CPU)."""
    import json

    from rollmarket.localhost import free_port

    readme = read("README.md")
    block = next(b for b in re.findall(r"```bash\n(.*?)```", readme, flags=re.S) if "rollmarket collect" in b)
    serve_line, collect_line, profile_line = [line.rstrip(" &") for line in block.strip().splitlines()
                                              if line.startswith("rollmarket ")]  # the test waits itself
    port = free_port()
    out = tmp_path / "rollouts.jsonl"

    def local(line: str) -> list[str]:
        words = (line.replace("--port 8000", f"--port {port}").replace("127.0.0.1:8000", f"127.0.0.1:{port}")
                 .replace("rollouts.jsonl", str(out)).split())
        assert words[0] == "rollmarket"
        return [sys.executable, "-m", "rollmarket", *words[1:]]

    proc = _start(local(serve_line), tmp_path / "serve.log", f"http://127.0.0.1:{port}")
    try:
        done = subprocess.run(local(collect_line) + ["--limit", "6", "--runs-dir", str(tmp_path / "runs")],
                              capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert done.returncode == 0, done.stderr[-3000:]
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    runs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(runs) == 24 and {r["sample_index"] for r in runs} == {0, 1, 2, 3}
    assert all(r["verification"] is not None for r in runs)
    done = subprocess.run(local(profile_line), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.with_name("rollouts.profile.json").read_text())
    by_task: dict = {}
    for r in runs:
        by_task.setdefault(r["task_id"], []).append(r["verification"]["passed"])
    # pass@1 with the unbiased estimator is the mean over tasks of each task's pass rate.
    expected = sum(sum(v) / len(v) for v in by_task.values()) / len(by_task)
    assert report["overall"]["pass_at_k"]["1"] == pytest.approx(expected)
