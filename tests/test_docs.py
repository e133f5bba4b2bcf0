"""Docs that tests keep honest: every route, setting, metric, reason, audit kind and error code a
user can meet is written down, the CLI reference matches --help, and the README quickstart runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rollmarket.cli.reference import render
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


def test_cli_reference_matches_help():
    """Regenerate with `python -m rollmarket.cli.reference > docs/cli.md`."""
    assert (DOCS / "cli.md").read_text() == render()


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
    source = (ROOT / "src/rollmarket/exchange/stores/sqlite.py").read_text()
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


def test_readme_serve_and_proxy_quickstart_runs(tmp_path):
    """The README's serve + proxy quickstart, verbatim but for the ports, against real processes:
    the client gets token ids and routed experts back, the proxy captured the call, and the
    engines snippet runs."""
    from rollmarket.localhost import free_port

    readme = read("README.md")
    shell = re.search(r"```bash\n(rollmarket serve-model.*?)```", readme, flags=re.S).group(1)
    serve_line, proxy_line = [line.rstrip(" &") for line in shell.strip().splitlines()]
    client_block, engines_block = [b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S)
                                   if "OpenAI(" in b or "RolloutEngine" in b][:2]
    serve_port, proxy_port = free_port(), free_port()
    store = tmp_path / "captures.db"
    serve_cmd = serve_line.replace("--port 8000", f"--port {serve_port}").split()
    proxy_cmd = (proxy_line.replace("127.0.0.1:8000", f"127.0.0.1:{serve_port}")
                 .replace("--port 8001", f"--port {proxy_port}")
                 .replace("captures.db", str(store)).split())
    assert serve_cmd[0] == proxy_cmd[0] == "rollmarket"
    procs = []
    try:
        procs.append(_start([sys.executable, "-m", "rollmarket", *serve_cmd[1:]], tmp_path / "serve.log",
                            f"http://127.0.0.1:{serve_port}"))
        procs.append(_start([sys.executable, "-m", "rollmarket", *proxy_cmd[1:]], tmp_path / "proxy.log",
                            f"http://127.0.0.1:{proxy_port}"))
        script = tmp_path / "client.py"
        script.write_text(client_block.replace("127.0.0.1:8001", f"127.0.0.1:{proxy_port}"))
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                              cwd=ROOT)
        assert done.returncode == 0, done.stderr
        assert "'role': 'assistant'" in done.stdout
        out = tmp_path / "captures.jsonl"
        export = subprocess.run([sys.executable, "-m", "rollmarket", "captures", "export", "--store", str(store),
                                 "--out", str(out)], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert export.returncode == 0, export.stderr
        import json

        [capture] = [json.loads(line) for line in out.read_text().splitlines()]
        assert capture["prompt_token_ids"] and capture["choices"][0]["response_token_ids"]
        assert len(capture["choices"][0]["routed_experts"]) == len(capture["choices"][0]["response_token_ids"])
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=20)
    script = tmp_path / "engines.py"
    script.write_text(engines_block)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("fp1:") == 2


def test_readme_agents_quickstart_runs(tmp_path):
    """The README's collect + profile quickstart against a real server, verbatim but for the port,
    the output paths and a task limit (the full suite takes minutes on a busy CPU)."""
    import json

    from rollmarket.localhost import free_port

    readme = read("README.md")
    block = next(b for b in re.findall(r"```bash\n(.*?)```", readme, flags=re.S) if "rollmarket collect" in b)
    serve_line, collect_line, profile_line = [line.rstrip(" &") for line in block.strip().splitlines()]
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
