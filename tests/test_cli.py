"""First contact with the `rollmarket` command: a mistake gets one line saying what and how to fix
it (never a traceback), a taken port fails before a model loads, a bad training config leaves no
run directory, and `--help` and the services that need no model never load torch.

Every command here runs as a real process (`python -m rollmarket ...`), judged from outside: its
exit code, its stderr, the files it left, and for servers the libraries mapped into the process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from contextlib import contextmanager
from pathlib import Path

import click
import pytest

from rollmarket.localhost import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "tiny-moe"
TORCH_LIBRARIES = ("libtorch", "torch/_C")

# Runs `python -m rollmarket ARGS` and, at exit (also after sys.exit), writes the heavy modules that
# were imported to the file named by $IMPORTED_OUT: what the process loaded, seen from outside.
WRAPPER = textwrap.dedent("""
    import atexit, json, os, runpy, sys

    def report():
        heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
        with open(os.environ["IMPORTED_OUT"], "w") as out:
            json.dump(heavy, out)

    atexit.register(report)
    sys.argv = ["rollmarket", *sys.argv[1:]]
    runpy.run_module("rollmarket", run_name="__main__")
""")


def rollmarket(*args: str, cwd: Path = ROOT, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollmarket", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, **(env or {})}, timeout=timeout)


def rollmarket_imports(tmp_path: Path, *args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run the command through WRAPPER: (the finished process, heavy modules it imported)."""
    wrapper, out = tmp_path / "wrapper.py", tmp_path / "imported.json"
    wrapper.write_text(WRAPPER)
    out.unlink(missing_ok=True)
    done = subprocess.run([sys.executable, str(wrapper), *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "IMPORTED_OUT": str(out)}, timeout=timeout)
    return done, json.loads(out.read_text())


def in_process(*args: str, monkeypatch) -> subprocess.CompletedProcess:
    """The same command through click's test runner, in this process (no interpreter start, no torch
    import per case): the error boundary is the same code. Judged like a process: exit code, stderr."""
    from click.testing import CliRunner

    from rollmarket.cli.main import main

    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("ROLLMARKET_DEBUG", raising=False)
    result = CliRunner().invoke(main, list(args), prog_name="rollmarket")
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)


def assert_one_line_error(done: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    """Exit `code`, and stderr is exactly one line `error: what — how to fix` holding every needle."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode == code, (done.returncode, done.stderr)
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    line = lines[0]
    assert line.startswith("error: ") and " — " in line, line
    for needle in needles:
        assert needle in line, (needle, line)
    return line


@contextmanager
def listener():
    """A port some other process is already listening on."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


# --- help and imports ---------------------------------------------------------------------------


def test_help_loads_neither_torch_nor_transformers(tmp_path):
    done, heavy = rollmarket_imports(tmp_path, "--help")
    assert done.returncode == 0, done.stderr
    assert heavy == []
    for name in ("exchange", "serve-model", "train", "worker", "observe", "demo"):
        assert f"  {name} " in done.stdout  # the listing stays complete


def test_the_listing_says_what_each_command_says_of_itself():
    """`rollmarket --help` lists commands without loading them, from the table in cli/main.py; each
    entry must give the same short help as the command it loads."""
    from rollmarket.cli.main import COMMANDS, main

    ctx = click.Context(main)
    assert sorted(COMMANDS) == main.list_commands(ctx)
    for name, lazy in COMMANDS.items():
        command = main.get_command(ctx, name)
        for limit in (30, 45, 60, 80, 300):
            assert lazy.short_help(limit) == command.get_short_help_str(limit), name


def test_python_dash_m_cli_main_reaches_every_command():
    """REVIEW: `python -m rollmarket.cli.main train` said "No such command"."""
    done = subprocess.run([sys.executable, "-m", "rollmarket.cli.main", "train", "--help"], capture_output=True,
                          text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Train a policy through the exchange" in done.stdout


@pytest.mark.parametrize("args", [
    ["suites", "ls", "--json"],
    ["schema", "--out", "{tmp}/schema"],
    ["captures", "export", "--store", "{tmp}/captures.db", "--out", "{tmp}/captures.jsonl"],
    ["profile", "{tmp}/rollouts.jsonl"],
    ["models", "info", "models/tiny-moe"],
    ["keys", "generate", "--out", "{tmp}/worker.key"],
    ["exchange", "serve", "--help"],
    ["serve-model", "--help"],
    ["train", "--help"],
])
def test_commands_that_need_no_model_never_import_torch(tmp_path, args):
    from rollmarket.proxy.store import CaptureStore

    store = CaptureStore(tmp_path / "captures.db")
    store.open()
    store.close()
    (tmp_path / "rollouts.jsonl").write_text("")
    done, heavy = rollmarket_imports(tmp_path, *[a.format(tmp=tmp_path) for a in args])
    assert done.returncode == 0, done.stderr
    assert heavy == [], args


def _mapped_libraries(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.parametrize("service", ["exchange", "proxy", "verifier", "dashboard"])
def test_services_that_need_no_model_run_without_torch_mapped(tmp_path, service):
    """The real server process, once it answers /healthz, has no torch library mapped."""
    port = free_port()
    args = {
        "exchange": ["exchange", "serve", "--db", str(tmp_path / "x.db"), "--trainer-token", "t"],
        "proxy": ["proxy", "--upstream", f"http://127.0.0.1:{free_port()}", "--store", str(tmp_path / "c.db")],
        "verifier": ["verifier", "serve"],
        "dashboard": ["dashboard", "--runs", str(tmp_path)],
    }[service]
    log = tmp_path / "log"
    proc = subprocess.Popen([sys.executable, "-m", "rollmarket", *args, "--port", str(port)], cwd=ROOT,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, log=log, timeout=120)
        maps = _mapped_libraries(proc.pid)
        assert "site-packages" in maps or "python" in maps  # the maps were read
        assert not [lib for lib in TORCH_LIBRARIES if lib in maps], service
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# --- one-line errors ----------------------------------------------------------------------------


@pytest.mark.parametrize("args,code,needles", [
    (["serve-model", "models/no-such-model"], 2, ["models/no-such-model", "models/tiny-moe"]),
    (["serve-model", "docs"], 2, ["no config.json"]),
    (["serve-model", "models/tiny-moe", "--precision", "fp9"], 2, ["fp9", "fp32, bf16, fp16, fp8"]),
    (["serve-model", "models/tiny-dense", "--device", "cpu", "--decode-graphs", "--port", "0"], 2,
     ["CUDA graphs need a CUDA device", "--device cuda"]),
    (["worker", "--model", "models/no-such-model"], 2, ["models/no-such-model"]),
    (["observe", "--model", "models/no-such-model"], 2, ["models/no-such-model"]),
    (["observe", "--model", "models/tiny-moe", "--suite", "agnt", "--runs-dir", "{tmp}/runs"], 2,
     ["unknown suite 'agnt'", "did you mean 'agent'", "rollmarket suites ls"]),
    (["observe", "--model", "models/tiny-moe", "--split", "nosuchsplit", "--runs-dir", "{tmp}/runs"], 2,
     ["unknown split 'nosuchsplit'", "train, heldout"]),
    (["collect", "--tasks", "agent:nosuchsplit", "--model-url", "http://127.0.0.1:9/v1", "--out", "{tmp}/o.jsonl",
      "--runs-dir", "{tmp}/runs"], 2, ["unknown split 'nosuchsplit' of suite 'agent'"]),
    (["collect", "--tasks", "agnt", "--model-url", "http://127.0.0.1:9/v1", "--out", "{tmp}/o.jsonl",
      "--runs-dir", "{tmp}/runs"], 2, ["'agnt'", "arithmetic, lookup, chains, agent"]),
    (["collect", "--tasks", "agent", "--model-url", "http://127.0.0.1:9/v1", "--out", "{tmp}/o.jsonl",
      "--runs-dir", "{tmp}/runs"], 1, ["127.0.0.1:9", "rollmarket serve-model"]),
    (["demo", "--suite", "agnt", "--runs-dir", "{tmp}/runs"], 2, ["unknown suite 'agnt'"]),
    (["demo", "--model", "models/no-such-model", "--runs-dir", "{tmp}/runs"], 2, ["models/no-such-model"]),
    (["demo", "paths", "--suite", "agnt", "--runs-dir", "{tmp}/runs"], 2, ["unknown suite"]),
    (["demo", "paths", "--model", "none", "--runs-dir", "{tmp}/runs"], 2, ["none: no such directory"]),
    (["models", "info", "models"], 2, ["no config.json"]),
    (["profile", "{tmp}/no-such-rollouts.jsonl"], 2, ["no-such-rollouts.jsonl", "does not exist"]),
    (["schema", "--out", "/dev/null/schemas"], 1, ["/dev/null/schemas", "Not a directory"]),
    (["suites", "show", "agnt"], 2, ["'agnt'", "rollmarket suites show --help"]),
    (["trian"], 2, ["did you mean 'train'"]),
    (["train", "loop.stepz=3"], 2, ["unknown key loop.stepz", "did you mean loop.steps?",
                                    "rollmarket train --list-keys"]),
    (["train", "lop.steps=3"], 2, ["unknown key lop.steps", "did you mean loop.steps?"]),
    (["train", "loop.steps=many"], 2, ["loop.steps", "many", "integer"]),
    (["train", "{tmp}/missing.toml"], 2, ["missing.toml", "No such file", "configs/train-lookup.toml"]),
    (["train", "--resume", "{tmp}", "--local"], 2, ["not a training run directory"]),
    (["train", "--resume", "{tmp}", "--run-dir", "{tmp}"], 2, ["--run-dir", "--resume"]),
    (["train", "--run-dir", "{tmp}/no-such-dir", "exchange.url='http://127.0.0.1:9'"], 2, ["no-such-dir", "does not exist"]),
    (["worker", "--model", "models/tiny-moe", "--signing-key", "{tmp}/no.key"], 1, ["no.key", "No such file"]),
    (["worker", "--model", "models/tiny-moe", "--signing-key", "README.md"], 1,
     ["README.md", "open to other users", "chmod 600 README.md"]),
    (["keys", "generate", "--out", "/dev/null/worker.key"], 1, ["/dev/null/worker.key", "Not a directory"]),
    (["keys", "public", "{tmp}/no.key"], 2, ["no.key", "does not exist"]),
])
def test_a_mistake_gets_one_line_and_no_traceback(tmp_path, monkeypatch, args, code, needles):
    done = in_process(*[a.format(tmp=tmp_path) for a in args], monkeypatch=monkeypatch)
    assert_one_line_error(done, code, *needles)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize("args,needles", [
    (["serve-model", "models/no-such-model"], ["models/no-such-model", "models/tiny-moe"]),
    (["collect", "--tasks", "agent:nosuchsplit", "--model-url", "http://127.0.0.1:9/v1", "--out", "{tmp}/o.jsonl"],
     ["unknown split 'nosuchsplit' of suite 'agent'", "rollmarket suites ls"]),
    (["train", "loop.stepz=3"], ["unknown key loop.stepz", "did you mean loop.steps?", "rollmarket train --list-keys"]),
])
def test_a_real_process_prints_one_line_and_no_traceback(tmp_path, args, needles):
    done = rollmarket(*[a.format(tmp=tmp_path) for a in args], env={"ROLLMARKET_DEBUG": ""})
    assert_one_line_error(done, 2, *needles)


def test_a_config_file_with_an_unknown_key_names_it(tmp_path, monkeypatch):
    config = tmp_path / "mine.toml"
    config.write_text("[loop]\nsteps = 3\n[optim]\nlearning_rate = 1e-4\n")
    done = in_process("train", str(config), "--print-config", monkeypatch=monkeypatch)
    assert_one_line_error(done, 2, "unknown key optim.learning_rate", "mine.toml", "--list-keys")


def test_debug_shows_the_traceback(tmp_path):
    args = ["collect", "--tasks", "agent:nosuchsplit", "--model-url", "http://127.0.0.1:9/v1", "--out",
            str(tmp_path / "o.jsonl")]
    flag = rollmarket("--debug", *args)
    env = rollmarket(*args, env={"ROLLMARKET_DEBUG": "1"})
    for done in (flag, env):
        assert done.returncode != 0
        assert "Traceback" in done.stderr and "UnknownSuite" in done.stderr, done.stderr


def test_a_wrong_token_for_the_exchange_is_one_line(start_exchange, monkeypatch):
    server = start_exchange()
    done = in_process("exchange", "status", "--url", server.url, "--token", "not-the-token", monkeypatch=monkeypatch)
    assert_one_line_error(done, 1, "401", "ROLLMARKET_TRAINER_TOKEN")


def test_an_unexpected_error_is_a_bug_and_keeps_its_traceback(monkeypatch):
    """Only expected errors are shortened: anything else propagates out of the boundary."""
    from click.testing import CliRunner

    from rollmarket.cli.main import RollmarketGroup
    from rollmarket.train.config import TrainConfigError

    @click.command("explode")
    def explode() -> None:
        {}["missing"]

    @click.command("refuse")
    def refuse() -> None:
        raise TrainConfigError("unknown key a.b", fix="list them")

    group = RollmarketGroup("rollmarket", commands=[explode, refuse])
    monkeypatch.delenv("ROLLMARKET_DEBUG", raising=False)
    bug = CliRunner().invoke(group, ["explode"])
    assert isinstance(bug.exception, KeyError) and bug.exit_code == 1
    expected = CliRunner().invoke(group, ["refuse"])
    assert expected.exit_code == 2 and expected.stderr == "error: unknown key a.b — list them\n"


# --- ports: taken ports fail first --------------------------------------------------------------


def test_claim_port_refuses_a_taken_port_with_a_typed_error():
    from rollmarket.localhost import PortInUse, claim_port

    with listener() as port:
        with pytest.raises(PortInUse) as info:
            claim_port("127.0.0.1", port)
    assert info.value.port == port and isinstance(info.value, OSError)
    sock = claim_port("127.0.0.1", 0)  # a free one is bound and handed back
    assert sock.getsockname()[1] > 0
    sock.close()


@pytest.mark.parametrize("service", ["serve-model", "exchange", "proxy", "verifier", "dashboard"])
def test_a_taken_port_fails_at_once_with_one_line(tmp_path, service):
    """Before anything is loaded or created: serve-model never imports torch, the exchange makes no
    database, the proxy no capture store."""
    args = {
        "serve-model": ["serve-model", "models/tiny-moe"],
        "exchange": ["exchange", "serve", "--db", str(tmp_path / "x.db"), "--trainer-token", "t"],
        "proxy": ["proxy", "--upstream", "http://127.0.0.1:9", "--store", str(tmp_path / "c.db")],
        "verifier": ["verifier", "serve"],
        "dashboard": ["dashboard", "--runs", str(tmp_path)],
    }[service]
    with listener() as port:
        done, heavy = rollmarket_imports(tmp_path, *args, "--port", str(port))
    assert_one_line_error(done, 1, f"127.0.0.1:{port}", "--port")
    assert heavy == []
    assert not (tmp_path / "x.db").exists() and not (tmp_path / "c.db").exists()


# --- rollmarket train: keys, validation, no run directory on failure ----------------------------


def test_list_keys_prints_every_key_with_type_default_and_help(monkeypatch):
    from rollmarket.train.config import TrainConfig

    done = in_process("train", "--list-keys", monkeypatch=monkeypatch)
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line for line in done.stdout.splitlines()}
    expected = []
    for section, field in TrainConfig.model_fields.items():
        model = field.annotation
        if isinstance(model, type) and hasattr(model, "model_fields"):
            expected += [(f"{section}.{name}", sub) for name, sub in model.model_fields.items()]
        else:
            expected.append((section, field))
    assert sorted(rows) == sorted(key for key, _ in expected)
    steps = rows["loop.steps"]
    assert "int = 20" in steps and "Optimizer steps" in steps
    assert '"grpo"' in rows["algorithm.advantage"] and "dr_grpo" in rows["algorithm.advantage"]
    assert "unset" in rows["exchange.url"]


@pytest.mark.parametrize("override,needle", [
    ("model.path=models/no-such-model", "model.path"),
    ("rollout.suite=agnt", "unknown suite 'agnt'"),
    ("rollout.precisions=['fp9']", "fp9"),
    ("local.workers=['fp9']", "fp9"),
    ("rollout.precisions=['fp32']", "local.workers"),
    ("exchange.require_signatures=true", "no signing keys"),
])
def test_a_bad_training_config_leaves_no_run_directory(tmp_path, monkeypatch, override, needle):
    runs = tmp_path / "runs"
    done = in_process("train", str(ROOT / "configs" / "train-lookup.toml"), override, f"runs_root='{runs}'",
                      "--local", monkeypatch=monkeypatch)
    assert_one_line_error(done, 2, needle)
    assert not runs.exists() or not any(runs.iterdir())


def test_a_real_train_process_with_a_bad_model_leaves_no_run_directory(tmp_path):
    runs = tmp_path / "runs"
    done = rollmarket("train", str(ROOT / "configs" / "train-lookup.toml"), "model.path=models/no-such-model",
                      f"runs_root='{runs}'", "--local", timeout=300)
    assert_one_line_error(done, 2, "model.path models/no-such-model")
    assert not runs.exists() or not any(runs.iterdir())


def test_without_local_a_missing_exchange_is_refused_before_the_run_directory(tmp_path, monkeypatch):
    from rollmarket.train.config import TrainConfigError, resolve
    from rollmarket.train.loop import Trainer

    monkeypatch.delenv("ROLLMARKET_TRAINER_TOKEN", raising=False)
    runs = tmp_path / "runs"
    for overrides, needle in ([[], "exchange.url"], [["exchange.url='http://127.0.0.1:9'"], "ROLLMARKET_TRAINER_TOKEN"]):
        cfg = resolve(None, [f"model.path='{MODEL}'", f"runs_root='{runs}'", *overrides])
        with pytest.raises(TrainConfigError, match=needle):
            Trainer(cfg).run()
        assert not runs.exists()


@pytest.mark.parametrize("missing,extra", [("torch", "ml"), ("transformers.models.qwen3", "ml"), ("peft", "ml"),
                                           ("psycopg", "postgres"), ("ray", "ray"), ("wandb", "trackers")])
def test_a_package_of_a_missing_extra_names_the_extra(missing, extra):
    """In a core install (tests/test_packaging.py runs one) an ML command fails to import torch: one
    line naming the pip command. Any other missing module stays a bug with its traceback."""
    from rollmarket.cli.errors import FAILURE, explain

    line, code = explain(ModuleNotFoundError(f"No module named {missing!r}", name=missing))
    assert code == FAILURE and line.startswith("error: ") and line.endswith(f"pip install 'rollmarket[{extra}]'")
    assert explain(ModuleNotFoundError("No module named 'torchvision'", name="torchvision")) is None
