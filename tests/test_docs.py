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
    blocks = re.findall(r"```python\n(.*?)```", read("README.md"), flags=re.S)
    assert blocks, "README has no python quickstart"
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
