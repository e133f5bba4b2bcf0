"""`serve-model --engine-process`: the model and its decode loop in a process of their own.

The same seeded requests through an in-process server and an engine-process server give the same
tokens, logprobs and routed experts, whole and streamed; a client that goes away frees its rows in
the other process; a killed engine process turns into 503s (new requests, /health) and a failed
request in flight, never a hang; a killed HTTP process takes its engine process with it; and
settings the engine refuses are refused before anything serves.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path

import httpx
import openai
import pytest

from helpers import ServiceProcess, model_server, rollmarket_command, wait_until

REPO = Path(__file__).resolve().parents[1]
MOE = REPO / "models" / "tiny-moe"
DENSE = REPO / "models" / "tiny-dense"
PROMPT = [{"role": "user", "content": "What is 17 * 23? Answer with a number."}]
RL_MOE = {"return_token_ids": True, "return_routed_experts": True}

pytestmark = pytest.mark.slow


def client(server: ServiceProcess, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120, **kw)


def engine(server: ServiceProcess) -> dict:
    return httpx.get(server.url + "/v1/engine", timeout=120).json()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ")[-1][:1] != "Z"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """tiny-moe at bf16 served twice: decoding in the HTTP process, and in an engine process."""
    logs = tmp_path_factory.mktemp("engine-process")
    servers = {"thread": model_server(MOE, logs / "thread.log").spawn(),
               "process": model_server(MOE, logs / "process.log", args=("--engine-process",)).spawn()}
    try:
        for server in servers.values():
            server.wait(300)
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def test_the_engine_process_decodes_in_another_process(pair):
    inside, outside = engine(pair["thread"]), engine(pair["process"])
    assert inside["engine_process"] is False and inside["engine_pid"] == pair["thread"].proc.pid
    assert outside["engine_process"] is True and outside["engine_pid"] != pair["process"].proc.pid
    assert alive(outside["engine_pid"])
    # The facts the engine process reports are the engine's: the same as the in-process server's.
    for key in ("engine_fingerprint", "checkpoint_digest", "tokenizer_hash", "kv_cache", "moe_layers", "precision"):
        assert outside[key] == inside[key], key


def _chat(server: ServiceProcess, **kw):
    return client(server).chat.completions.create(
        model="tiny-moe", messages=PROMPT, max_tokens=20, seed=11, temperature=1.0, logprobs=True,
        top_logprobs=2, extra_body={**RL_MOE, "ignore_eos": True}, **kw)


def test_seeded_requests_give_what_the_in_process_server_gives(pair):
    a, b = _chat(pair["thread"], n=2), _chat(pair["process"], n=2)
    assert len(a.choices) == len(b.choices) == 2
    for x, y in zip(a.choices, b.choices):
        assert x.model_extra["token_ids"] == y.model_extra["token_ids"] and len(x.model_extra["token_ids"]) == 20
        assert x.model_extra["routed_experts"] == y.model_extra["routed_experts"]
        assert x.message.content == y.message.content
        assert [e.logprob for e in x.logprobs.content] == pytest.approx([e.logprob for e in y.logprobs.content],
                                                                         abs=1e-6)
    # Streamed from the engine process: the same tokens, in pieces.
    streamed: list[int] = []
    for chunk in _chat(pair["process"], stream=True):
        for choice in chunk.choices:
            streamed += (choice.model_extra or {}).get("token_ids") or []
    assert streamed == a.choices[0].model_extra["token_ids"]
    # Not asked for, the experts stay in the engine process (they cross the pipe only when wanted):
    # the same tokens, no routed_experts field.
    plain = client(pair["process"]).chat.completions.create(
        model="tiny-moe", messages=PROMPT, max_tokens=20, seed=11, temperature=1.0, n=2,
        extra_body={"return_token_ids": True, "ignore_eos": True})
    for x, y in zip(a.choices, plain.choices, strict=True):
        assert y.model_extra["token_ids"] == x.model_extra["token_ids"]
        assert "routed_experts" not in (y.model_extra or {})


def test_a_client_that_goes_away_frees_its_rows_in_the_engine_process(pair):
    server = pair["process"]
    before = engine(server)["decode_steps"]
    stream = client(server).completions.create(model="tiny-moe", prompt="Count:", max_tokens=3000, stream=True,
                                               extra_body={"ignore_eos": True})
    for i, _chunk in enumerate(stream):
        if i == 3:
            break
    stream.close()

    # Its row leaves the batch long before the 3,000 tokens it asked for.
    wait_until("the engine process's batch to empty", lambda: engine(server)["running"] == 0, timeout=120, every=0.2)
    steps = engine(server)["decode_steps"] - before
    assert 3 <= steps < 3000
    assert _chat(server).choices[0].finish_reason == "length"


def test_a_killed_engine_process_turns_into_503s_not_a_hang(tmp_path):
    server = model_server(DENSE, tmp_path / "serve.log", args=("--engine-process",)).start(300)
    try:
        pid = engine(server)["engine_pid"]
        answers: list = []

        def long_request():
            try:
                answers.append(client(server).completions.create(model="tiny-dense", prompt="Count:", max_tokens=4000,
                                                                 extra_body={"ignore_eos": True}))
            except openai.APIStatusError as exc:
                answers.append(exc)

        caller = threading.Thread(target=long_request)
        caller.start()
        wait_until("the request to be decoding", lambda: engine(server)["decode_steps"] > 0, timeout=120)
        os.kill(pid, signal.SIGKILL)
        caller.join(120)
        assert not caller.is_alive(), "the request in flight hung"
        [failed] = answers
        assert isinstance(failed, openai.APIStatusError) and failed.status_code == 500
        assert "engine process exited" in str(failed)

        health = httpx.get(server.url + "/health", timeout=30)
        assert health.status_code == 503 and "engine process" in health.json()["status"]
        with pytest.raises(openai.APIStatusError) as refused:
            client(server).completions.create(model="tiny-dense", prompt="hi", max_tokens=2)
        assert refused.value.status_code == 503 and refused.value.body["code"] == "engine_unavailable"
        # The HTTP process itself still answers what needs no engine.
        assert client(server).models.list().data[0].id == "tiny-dense"
    finally:
        server.stop()


def test_a_killed_http_process_takes_its_engine_process_with_it(tmp_path):
    server = model_server(DENSE, tmp_path / "serve.log", args=("--engine-process",)).start(300)
    try:
        pid = engine(server)["engine_pid"]
        assert alive(pid)
        server.kill()
        wait_until("the engine process to exit", lambda: not alive(pid), timeout=60, every=0.2)
    finally:
        server.stop()
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_settings_the_engine_refuses_are_refused_before_serving(tmp_path):
    done = subprocess.run(rollmarket_command("serve-model", str(DENSE), "--engine-process", "--device", "cpu",
                                             "--decode-graphs", "--port", "0"),
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode != 0
    assert "CUDA" in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_the_engine_process_is_the_default_on_cuda_only():
    from rollmarket.serve.settings import ServeSettings, wants_engine_process

    unset = ServeSettings(model_path="m")
    assert wants_engine_process(unset, "cuda") and not wants_engine_process(unset, "cpu")
    off, on = ServeSettings(model_path="m", engine_process=False), ServeSettings(model_path="m", engine_process=True)
    assert not wants_engine_process(off, "cuda") and wants_engine_process(on, "cpu")
