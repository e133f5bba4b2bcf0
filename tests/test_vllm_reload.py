"""Policy reload against a real vLLM: the server serves the new weights, the worker acks after checking.

What these tests protect: a `rollmarket worker --model-url … --server-reload vllm` in front of vLLM
(vLLM's CPU build, dev mode) must, when the trainer publishes a new checkpoint, get vLLM onto
those weights in place and ack the version only once two checks pass: the checkpoint files' digest
is the manifest's, and vLLM's logprobs on a canary are those files' logprobs. A server that says
"reloaded" and keeps its old weights must never be acked (a typed `reload_unverified` event).

The expected numbers come from outside the code under test: each checkpoint is scored here with
plain `transformers` at fp32, and acks are read from the exchange's audit log.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from helpers import ExchangeProcess, ServiceProcess
from rollmarket.engines.provenance import checkpoint_digest
from rollmarket.localhost import free_port
from test_worker import Worker, jobs, policy, wait_done
from vllm_server import MOE, SERVED_NAME, START_TIMEOUT_S, vllm_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(START_TIMEOUT_S + 300)]

TOLERANCE = 0.1
"""The worker's default canary tolerance (mean |Δlogp|); vLLM bf16 against fp32 sits far below it."""


def perturbed_checkpoint(target: Path, seed: int) -> Path:
    """tiny-moe with Gaussian noise (half each matrix's std) on every matrix: a policy a few bad
    training steps away, whose logprobs differ from the shipped model's by far more than bf16 noise."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(MOE, target)
    generator = torch.Generator().manual_seed(seed)
    weights = {name: (t + 0.5 * t.float().std() * torch.randn(t.shape, generator=generator)).to(t.dtype)
               if t.ndim >= 2 else t for name, t in load_file(str(MOE / "model.safetensors")).items()}
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def hf_logprobs(path: Path, prompt: list[int], response: list[int]) -> np.ndarray:
    """log π(response | prompt) of the checkpoint at `path`, by plain transformers at fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)[len(prompt) - 1:-1]
    return logp[torch.arange(len(response)), torch.tensor(response)].numpy()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-reload")


@pytest.fixture(scope="module")
def vllm(workdir) -> ServiceProcess:
    """One real vLLM server in dev mode (its in-place weight reload) for the module."""
    server = vllm_server(workdir / "vllm.log", dev_mode=True)
    started = time.monotonic()
    server.start(timeout=START_TIMEOUT_S)
    print(f"vLLM ready in {time.monotonic() - started:.0f}s")
    yield server
    server.stop(30)


@pytest.fixture
def shipped_vllm(vllm) -> ServiceProcess:
    """The module's vLLM serving the shipped weights again (a test before may have reloaded it)."""
    answer = httpx.post(vllm.url + "/collective_rpc", timeout=300,
                        json={"method": "reload_weights", "kwargs": {"weights_path": str(MOE)}})
    assert answer.status_code == 200, answer.text
    assert httpx.post(vllm.url + "/reset_prefix_cache", timeout=60).status_code == 200
    return vllm


@pytest.fixture
def exchange(tmp_path):
    ex = ExchangeProcess(tmp_path / "ex.db", tmp_path / "ex.log",
                         args=["--lease-ttl-s", "20", "--heartbeat-ttl-s", "10", "--reaper-interval-s", "0.2"]).start()
    yield ex
    ex.stop()


def reload_worker(exchange, tmp_path: Path, model_url: str, worker_id: str) -> Worker:
    return Worker(exchange.url, worker_id, tmp_path, model_url=model_url,
                  args=("--model-dir", str(MOE), "--server-reload", "vllm"))


def acked_versions(trainer, worker_id: str) -> list[int]:
    """Versions the exchange recorded acks of, from its audit log."""
    return [int(e.subject.split(":")[1]) for e in trainer.audit(kind="reload.acked", limit=100).events
            if e.actor == worker_id]


def test_worker_reloads_vllm_in_place_and_acks_after_the_canary(shipped_vllm, exchange, tmp_path):
    vllm = shipped_vllm
    trainer = exchange.trainer()
    v1, v2 = perturbed_checkpoint(tmp_path / "ckpt-v1", 1), perturbed_checkpoint(tmp_path / "ckpt-v2", 2)
    trainer.publish_policy(policy(0, MOE))
    worker = reload_worker(exchange, tmp_path, vllm.url + "/v1", "vllm-reloader")
    try:
        # v0 is what vLLM already runs: no reload, but the canary is checked before the ack.
        first = worker.wait_for("reload_acked", version=0, timeout=180)
        assert first["canary"]["mean_abs_delta"] <= TOLERANCE
        for version, path in ((1, v1), (2, v2)):
            trainer.publish_policy(policy(version, path))
            acked = worker.wait_for("reload_acked", version=version, timeout=300)
            assert acked["canary"]["mean_abs_delta"] <= TOLERANCE and acked["canary"]["tokens"] > 10
        trainer.enqueue(jobs(2, 1, group_size=2, max_tokens=24))
        wait_done(trainer, 1, timeout=300)
    finally:
        worker.stop()
    assert acked_versions(trainer, "vllm-reloader") == [0, 1, 2]
    [item] = trainer.fetch(limit=10).groups
    group = item.group
    assert group.policy_version == 2 and group.checkpoint_digest == checkpoint_digest(v2)
    # The group's behaviour logprobs were sampled from v2's weights: plain transformers scoring
    # v2 gives the same numbers (up to bf16), and v1 or the shipped model far other ones.
    t = group.trajectories[0]
    prompt, response = t.prompt_token_ids.tolist(), t.response_token_ids.tolist()
    actions = t.action_mask.astype(bool)
    sampled = t.logprobs[actions]
    gaps = {name: float(np.abs(sampled - hf_logprobs(path, prompt, response)[actions]).mean())
            for name, path in (("v2", v2), ("v1", v1), ("v0", MOE))}
    assert gaps["v2"] < TOLERANCE, gaps
    assert gaps["v1"] > 5 * TOLERANCE and gaps["v0"] > 5 * TOLERANCE, gaps


class IgnoringFront:
    """A loopback server in front of vLLM that answers its reload endpoints with 200 and does
    nothing, and passes everything else through: a server that claims a reload it never did."""

    def __init__(self, upstream: str):
        self.upstream = upstream
        self.port = free_port()

        async def ignore(request: Request) -> Response:
            return JSONResponse({"results": [None]})

        async def forward(request: Request) -> Response:
            async with httpx.AsyncClient(timeout=300) as client:
                answer = await client.request(request.method, self.upstream + request.url.path,
                                              content=await request.body(),
                                              headers={"content-type": request.headers.get("content-type", "")})
            return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))

        app = Starlette(routes=[Route("/collective_rpc", ignore, methods=["POST"]),
                                Route("/reset_prefix_cache", ignore, methods=["POST"]),
                                Route("/{path:path}", forward, methods=["GET", "POST"])])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "IgnoringFront":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the front did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def test_a_server_that_ignores_the_reload_is_never_acked(shipped_vllm, exchange, tmp_path):
    trainer = exchange.trainer()
    v1 = perturbed_checkpoint(tmp_path / "ckpt-v1", 1)
    trainer.publish_policy(policy(0, MOE))
    with IgnoringFront(shipped_vllm.url) as front:
        worker = reload_worker(exchange, tmp_path, f"http://127.0.0.1:{front.port}/v1", "vllm-liar")
        try:
            worker.wait_for("reload_acked", version=0, timeout=180)
            trainer.publish_policy(policy(1, v1))
            trainer.enqueue(jobs(1, 1, group_size=2, max_tokens=24))
            # The digest of v1's files is right, so the worker asks for the reload; the front
            # swallows it, vLLM still runs v0, and the canary says so. The worker tries again.
            first = worker.wait_for("reload_unverified", version=1, timeout=300)
            assert first["canary"]["mean_abs_delta"] > 5 * TOLERANCE
            deadline = time.monotonic() + 300
            while sum(e["event"] == "reload_unverified" for e in worker.seen()) < 2:
                assert time.monotonic() < deadline, worker.seen()[-3:]
                time.sleep(0.2)
        finally:
            worker.stop()
    events = worker.seen()
    assert not any(e["event"] == "reload_acked" and e["version"] == 1 for e in events)
    assert not any(e["event"] == "leased" for e in events)
    assert acked_versions(trainer, "vllm-liar") == [0]
    assert trainer.jobs(state="queued", limit=10) and not trainer.jobs(state="done", limit=10)
    # vLLM itself still serves the shipped weights: the front never passed the reload on.
    prompt, response = [5, 6, 7, 8], [9, 10, 11]
    scored = httpx.post(shipped_vllm.url + "/v1/completions", timeout=120, json={
        "model": SERVED_NAME, "prompt": prompt + response, "max_tokens": 1, "temperature": 0,
        "prompt_logprobs": 0}).json()["choices"][0]["prompt_logprobs"]
    served = np.array([scored[len(prompt) + i][str(tok)]["logprob"] for i, tok in enumerate(response)])
    np.testing.assert_allclose(served, hf_logprobs(MOE, prompt, response), atol=0.1)
