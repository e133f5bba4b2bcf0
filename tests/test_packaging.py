"""The promise of `pip install rollmarket` (docs/layers.md): without extras it installs the
torch-free core, and the core runs.

The source tree is installed (not editable) into a fresh virtual environment with only the core's
dependencies, from the package index like a user's install (pip's cache keeps it quick; this is the
one test that reaches beyond loopback, through pip). There,
`import torch` fails; the exchange, the capture proxy, the resources server and the dashboard start
as processes and answer; `rollmarket --help` works; and a command of the ML layer answers with one
line naming `pip install 'rollmarket[ml]'`, not a traceback.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from rollmarket.localhost import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
ML_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "peft")
# The first test to run builds the install (about 30 s with pip's cache warm, minutes without it).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


class CoreInstall:
    """A virtual environment holding `pip install rollmarket` of this source tree, nothing more."""

    def __init__(self, venv: Path, home: Path):
        self.venv, self.home = venv, home
        # Nothing of the test's own environment may leak in: no PYTHONPATH, no active venv.
        self.env = {key: value for key, value in os.environ.items()
                    if key not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        self.env["PATH"] = f"{venv / 'bin'}:{self.env.get('PATH', '')}"

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(args, capture_output=True, text=True, cwd=self.home, env=self.env, timeout=timeout)

    def rollmarket(self, *args: str) -> subprocess.CompletedProcess:
        return self.run(self.bin("rollmarket"), *args)


@pytest.fixture(scope="module")
def core(tmp_path_factory) -> CoreInstall:
    base = tmp_path_factory.mktemp("core")
    source = base / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    home = base / "home"  # the working directory of every command: not the repository
    home.mkdir()
    install = CoreInstall(venv, home)
    done = install.run(install.bin("python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                       str(source), timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return install


def test_the_core_installs_without_the_ml_packages(core):
    for package in ML_PACKAGES:
        done = core.run(core.bin("python"), "-c", f"import {package}")
        assert done.returncode == 1 and f"No module named '{package}'" in done.stderr, (package, done.stderr)
    # The installed copy runs, not this checkout.
    done = core.run(core.bin("python"), "-c", "import rollmarket; print(rollmarket.__file__)")
    assert done.returncode == 0 and done.stdout.startswith(str(core.venv)), done.stdout + done.stderr


def test_help_and_the_commands_of_the_core_work(core):
    done = core.rollmarket("--help")
    assert done.returncode == 0, done.stderr
    for name in ("exchange", "proxy", "verifier", "dashboard", "train", "worker", "keys"):
        assert f"  {name} " in done.stdout
    done = core.rollmarket("train", "--help")
    assert done.returncode == 0 and "CONFIG" in done.stdout, done.stderr
    # Package data came along: the shipped suites.
    done = core.rollmarket("suites", "ls", "--json")
    assert done.returncode == 0 and '"agent"' in done.stdout, done.stderr
    # A remote worker's key is made where only the core is installed.
    done = core.rollmarket("keys", "generate", "--out", "worker.key")
    assert done.returncode == 0 and len(done.stdout.strip()) == 44, done.stderr


@pytest.mark.parametrize("args", [
    ["train", str(ROOT / "configs" / "train-lookup.toml")],
    ["serve-model", str(ROOT / "models" / "tiny-moe")],
    ["worker", "--model", str(ROOT / "models" / "tiny-moe")],
])
def test_a_command_of_the_ml_layer_names_the_extra(core, args):
    done = core.rollmarket(*args)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("error: ") and lines[0].endswith("pip install 'rollmarket[ml]'"), lines[0]


def test_the_services_of_the_core_start_and_answer(core):
    """Exchange, capture proxy, resources server and dashboard, side by side, each asked a real
    question beyond its health check."""
    ports = {name: free_port() for name in ("exchange", "proxy", "verifier", "dashboard")}
    (core.home / "runs").mkdir(exist_ok=True)
    commands = {
        "exchange": ["exchange", "serve", "--db", "x.db", "--trainer-token", "t"],
        "proxy": ["proxy", "--upstream", f"http://127.0.0.1:{free_port()}", "--store", "captures.db"],
        "verifier": ["verifier", "serve"],
        "dashboard": ["dashboard", "--runs", "runs"],
    }
    procs, logs = {}, {}
    try:
        for name, args in commands.items():
            logs[name] = core.home / f"{name}.log"
            procs[name] = subprocess.Popen([core.bin("rollmarket"), *args, "--port", str(ports[name])],
                                           cwd=core.home, env=core.env, stdout=open(logs[name], "wb"),
                                           stderr=subprocess.STDOUT)
        for name, proc in procs.items():
            wait_healthy(f"http://127.0.0.1:{ports[name]}", proc, log=logs[name], timeout=120)
        url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
        pool = httpx.get(url["exchange"] + "/v1/pool", headers={"authorization": "Bearer t"})
        assert pool.status_code == 200 and "jobs" in pool.json(), pool.text
        assert httpx.get(url["exchange"] + "/docs").status_code == 200  # the bundled Swagger UI
        page = httpx.get(url["dashboard"] + "/")
        assert page.status_code == 200 and "<html" in page.text.lower()
        task = {"task_id": "t1", "prompt": "2+2?", "verifier": "exact", "answer": "4"}
        for answer, reward in (("4", 1.0), ("5", 0.0)):
            verdict = httpx.post(url["verifier"] + "/verify", json={"task": task, "answer": answer, "tool_calls": []})
            assert verdict.status_code == 200 and verdict.json()["reward"] == reward, verdict.text
        # A tool that reads the shipped world (package data) answers inside a session.
        with httpx.Client(base_url=url["verifier"]) as session:
            seeded = session.post("/seed_session", json={"task": {**task, "tools": ["web_search"]}})
            assert seeded.status_code == 200, seeded.text
            found = session.post("/web_search", json={"query": "capital"})
            assert found.status_code == 200 and "Its capital is" in found.json()["content"], found.text
        # The proxy's upstream is down: it says so as an OpenAI-style error, it does not crash.
        failed = httpx.post(url["proxy"] + "/v1/chat/completions",
                            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
        assert failed.status_code in (502, 503, 504), failed.text
        assert all(proc.poll() is None for proc in procs.values())
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(timeout=30)


def test_a_remote_worker_runs_from_the_core_and_signs_its_groups(core, tmp_path):
    """`rollmarket worker --model-url` needs no torch: from the core install it samples from a model
    server elsewhere (here `serve-model` of the test environment), signs with a key made there, and
    an exchange that requires signatures stores its group."""
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    from helpers import ExchangeProcess, served_model
    from test_worker import MOE, jobs, policy

    assert core.rollmarket("keys", "generate", "--out", "remote.key").returncode == 0
    public = load_pem_private_key((core.home / "remote.key").read_bytes(), None).public_key()
    exchange = ExchangeProcess(tmp_path / "ex.db", tmp_path / "ex.log").start()
    try:
        trainer = exchange.trainer()
        trainer.publish_policy(policy(0, MOE).model_copy(update={"require_signatures": True}))
        trainer.enqueue(jobs(0, 1, max_tokens=16))
        with served_model(MOE, tmp_path / "serve.log") as model_url:
            done = core.run(core.bin("rollmarket"), "worker", "--model-url", model_url, "--exchange", exchange.url,
                            "--signing-key", "remote.key", "--max-groups", "1", timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        [served] = trainer.fetch(limit=5).groups
    finally:
        exchange.stop()
    group = served.group
    public.verify(base64.b64decode(group.signature), b"rollmarket.sample_group.sig.v1:" + group.content_hash.encode())
