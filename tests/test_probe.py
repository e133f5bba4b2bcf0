"""`rollmarket probe`: against real servers on loopback whose capabilities are known from their code.

Our `serve-model` on tiny-moe and the capture proxy in front of it implement vLLM's extensions
(return_token_ids, return_routed_experts, logprobs, seeds) but not prompt_logprobs, set no
system_fingerprint, and parse tool calls without forcing a named tool_choice. tests/probe_stub.py
is a plain chat server with none of it. The expected verdicts below come from those facts; the
evidence is checked against the server itself (its /tokenize, the model's config.json).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from dashboard_browser import dashboard_process
from helpers import ServiceProcess, model_server, rollmarket_command
from rollmarket.dashboard import export_static
from rollmarket.agents.probe import (
    CAPABILITIES,
    PROMPT,
    AuthRejected,
    EndpointUnreachable,
    NotOpenAICompatible,
    UnknownModel,
    probe,
)
from rollmarket.localhost import free_port

ROOT = Path(__file__).resolve().parents[1]
MOE = ROOT / "models" / "tiny-moe"
STUB = Path(__file__).with_name("probe_stub.py")

OUR_SERVER = {
    "chat": "yes", "completions": "yes", "prompt_token_ids": "yes", "response_token_ids": "yes",
    "sampled_logprobs": "yes", "top_logprobs": "yes", "routed_experts": "yes", "seed_reproducible": "yes",
    "streaming": "yes",  # the stream carries token_ids and logprobs per chunk (serve/app.py)
    "prompt_logprobs": "no",  # not implemented by serve-model (serve/protocol.py has no such field)
    "system_fingerprint": "no",  # never set by serve-model
    "tool_calls": "partial",  # accepted, parsed from the text, never forced: tiny-moe writes no call
}
"""What serve-model on tiny-moe is known to give (and the proxy passes through unchanged)."""

PLAIN_STUB = {
    "chat": "yes", "completions": "no", "prompt_token_ids": "no", "response_token_ids": "no",
    "sampled_logprobs": "no", "top_logprobs": "no", "routed_experts": "no", "prompt_logprobs": "no",
    "seed_reproducible": "no",  # random words whatever the seed: equal by chance with p = 1e-6
    "tool_calls": "partial", "system_fingerprint": "no",
    "streaming": "partial",  # streams text only
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("probe")


@pytest.fixture(scope="module")
def model(workdir):
    server = model_server(MOE, workdir / "model.log", precision="fp32")
    server.start(timeout=180)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def proxy(model, workdir):
    port = free_port()
    server = ServiceProcess(rollmarket_command("proxy", "--upstream", model.url, "--port", str(port),
                                               "--store", str(workdir / "captures.db"), "--log-level", "warning"),
                            workdir / "proxy.log", port)
    server.start(timeout=60)
    yield server
    server.stop()


def _stub(workdir: Path, *args: str) -> ServiceProcess:
    port = free_port()
    return ServiceProcess([sys.executable, str(STUB), str(port), *args], workdir / f"stub-{port}.log", port).start()


@pytest.fixture(scope="module")
def stub(workdir):
    server = _stub(workdir)
    yield server
    server.stop()


def _check_against_server(report, model_url: str) -> None:
    """The evidence is the server's own: prompt ids as its /tokenize renders the probe's chat,
    experts shaped [tokens][moe_layers][top_k] as config.json says."""
    prompt_ids = httpx.post(model_url + "/tokenize", json={"messages": PROMPT}, timeout=60).json()["tokens"]
    assert report.get("prompt_token_ids").evidence["token_ids"] == prompt_ids
    config = json.loads((MOE / "config.json").read_text())
    tokens, layers, top_k = report.get("routed_experts").evidence["shape"]
    assert (layers, top_k) == (config["num_hidden_layers"], config["num_experts_per_tok"])
    assert 1 <= tokens <= 8
    first = report.get("seed_reproducible").evidence
    assert first["first"] == first["second"] and len(first["first"]) >= 1


def test_our_model_server_gives_everything_but_prompt_logprobs(model):
    report = probe(model.url)
    assert report.statuses() == OUR_SERVER
    assert [c.name for c in report.capabilities] == list(CAPABILITIES)
    assert report.model == "tiny-moe" and report.url == model.url + "/v1"
    _check_against_server(report, model.url)


def test_the_capture_proxy_passes_everything_through(proxy, model):
    report = probe(proxy.url + "/v1")
    assert report.statuses() == OUR_SERVER
    _check_against_server(report, model.url)


def test_a_plain_server_gets_real_noes(stub):
    report = probe(stub.url)
    assert report.statuses() == PLAIN_STUB
    assert report.get("completions").evidence["error"].startswith("NotFoundError")
    assert report.get("streaming").evidence["chunks"] == 6


def test_a_strict_server_refuses_extensions_and_the_chat_still_counts(workdir):
    """A server that 400s every field beyond plain chat: the refusals are the "no"s' evidence, and the
    chat, the seed check and the stream are asked again without the refused fields."""
    strict = _stub(workdir, "--strict")
    try:
        report = probe(strict.url)
    finally:
        strict.stop()
    assert report.statuses() == PLAIN_STUB
    assert "BadRequestError" in report.get("sampled_logprobs").evidence["error"]
    for name in ("response_token_ids", "routed_experts"):
        assert report.get(name).evidence["error"].startswith("HTTP 400"), name
    assert report.get("streaming").evidence["refused"].startswith("HTTP 400")
    assert "without logprobs" in report.get("chat").detail


def test_unreachable_not_openai_and_bad_key_are_typed_errors(workdir):
    with pytest.raises(EndpointUnreachable):
        probe(f"http://127.0.0.1:{free_port()}")
    port = free_port()
    files = ServiceProcess([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                           workdir / "http.log", port, health="/", cwd=workdir).start()
    try:
        with pytest.raises(NotOpenAICompatible):
            probe(files.url)
    finally:
        files.stop()
    keyed = _stub(workdir, "--key", "sesame")
    try:
        with pytest.raises(AuthRejected):
            probe(keyed.url, api_key="wrong")
        assert probe(keyed.url, api_key="sesame").get("chat").status == "yes"
        with pytest.raises(UnknownModel):
            probe(keyed.url, api_key="sesame", model="gpt-9")
    finally:
        keyed.stop()


def test_cli_json_out_and_exit_codes(stub, workdir):
    out = workdir / "runs" / "probes" / "stub.json"
    done = subprocess.run(rollmarket_command("probe", stub.url, "--json", "--out", str(out)),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    assert printed == json.loads(out.read_text())
    assert {c["name"]: c["status"] for c in printed["capabilities"]} == PLAIN_STUB
    table = subprocess.run(rollmarket_command("probe", stub.url), capture_output=True, text=True, timeout=120)
    assert table.returncode == 0 and "streaming" in table.stdout and "partial" in table.stdout
    dead = subprocess.run(rollmarket_command("probe", f"http://127.0.0.1:{free_port()}"),
                          capture_output=True, text=True, timeout=120)
    assert dead.returncode == 1
    assert dead.stderr.strip().startswith("error: ") and len(dead.stderr.strip().splitlines()) == 1


def test_dashboard_shows_a_saved_report(stub, workdir):
    """The report `rollmarket probe --out RUNS/probes/NAME.json` saved is /probe/NAME and its twin."""
    runs = workdir / "dash"
    saved = runs / "probes" / "stub.json"
    done = subprocess.run(rollmarket_command("probe", stub.url, "--out", str(saved)), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    (runs / "probes" / "broken.json").write_text('{"url": "x"}')
    with dashboard_process(runs, workdir / "dashboard.log") as url:
        twin = httpx.get(f"{url}/probe/stub.json", timeout=30)
        assert twin.status_code == 200
        assert twin.json()["report"] == json.loads(saved.read_text())
        html = httpx.get(f"{url}/probe/stub", timeout=30).text
        for name, status in PLAIN_STUB.items():
            assert f'data-capability="{name}" data-status="{status}"' in html
        for name, status, reason in (("nothing", 404, "unknown_probe"), ("broken", 500, "unreadable_probe"),
                                     ("..", 404, "unknown_probe")):
            answer = httpx.get(f"{url}/probe/{name}.json", timeout=30)
            assert answer.status_code == status and answer.json()["error"]["reasons"] == [reason], answer.text
        assert httpx.get(f"{url}/probe/nothing", timeout=30).status_code == 404
    site = workdir / "site"
    export_static(runs, site)
    assert json.loads((site / "probe" / "stub.json").read_text())["report"] == json.loads(saved.read_text())
    assert 'data-capability="streaming" data-status="partial"' in (site / "probe" / "stub.html").read_text()
    assert not (site / "probe" / "broken.html").exists()
