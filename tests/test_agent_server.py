"""`rollmarket agent serve` as a real process between a model server and a resources server.

The plumbing tests use tests/scripted_model.py (it calls read_file on demand, which the tiny real
models cannot be made to do); the end-to-end test runs the real chain: serve-model (tiny-moe),
verifier serve, agent serve, an exchange and `rollmarket worker --agent-url`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from helpers import ExchangeProcess, ServiceProcess, rollmarket_command, served_model, wait_until

from rollmarket.contracts import AgentTrajectory, TaskSpec
from rollmarket.localhost import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPTED = Path(__file__).with_name("scripted_model.py")


def start(cmd: list[str], log: Path, port: int, timeout: float = 90) -> ServiceProcess:
    return ServiceProcess(cmd, log, port, cwd=ROOT).start(timeout)


def resources_server(tmp: Path) -> ServiceProcess:
    port = free_port()
    return start(rollmarket_command("verifier", "serve", "--port", str(port), "--log-level", "warning"),
                 tmp / "resources.log", port)


def agent_server(tmp: Path, model_url: str, resources_url: str, *args: str) -> ServiceProcess:
    port = free_port()
    return start(rollmarket_command("agent", "serve", "--model-url", model_url, "--resources-url", resources_url,
                                    "--port", str(port), "--log-level", "warning", *args),
                 tmp / f"agent-{port}.log", port)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agent-stack")
    port = free_port()
    started = []
    try:
        model = start([sys.executable, str(SCRIPTED), "--port", str(port)], tmp / "model.log", port)
        started.append(model)
        resources = resources_server(tmp)
        started.append(resources)
        agent = agent_server(tmp, model.url + "/v1", resources.url)
        started.append(agent)
        yield model, resources, agent
    finally:
        for service in reversed(started):
            service.stop()


def secret_task(i: int, **overrides) -> TaskSpec:
    fields = dict(task_id=f"secret-{i}", prompt="What does secret.txt say?", tools=["read_file"], verifier="exact",
                  answer=f"word-{i}", files={"secret.txt": f"word-{i}\n"})
    return TaskSpec(**{**fields, **overrides})


def sessions(resources: ServiceProcess) -> int:
    return httpx.get(resources.url + "/healthz").json()["sessions"]


def completions(model: ServiceProcess) -> int:
    return httpx.get(model.url + "/stats").json()["completions"]


def test_concurrent_runs_keep_their_sessions_apart(stack):
    """Eight runs at once, each task with its own secret file: every run reads its own file
    through its own resources session, is scored 1, and no session is left open."""
    model, resources, agent = stack
    tasks = [secret_task(i) for i in range(8)]

    def run(task: TaskSpec) -> dict:
        answer = httpx.post(agent.url + "/run", json={"task": task.model_dump(mode="json"),
                                                      "sampling": {"max_tokens": 64, "seed": 7}}, timeout=120)
        assert answer.status_code == 200, answer.text
        return answer.json()

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(run, tasks))
    for task, answer in zip(tasks, answers):
        run_ = AgentTrajectory.model_validate(answer["trajectory"])
        expected = task.files["secret.txt"].rstrip("\n")
        assert [c.result.content for c in run_.tool_calls] == [expected]
        assert run_.final_answer == expected and answer["reward"] == 1.0 and answer["loop"] == "tool"
        # Every turn's ids and logprobs come back as the model server sent them.
        assert [s.response_token_ids.tolist() for s in run_.steps][-1] == [b + 3 for b in expected.encode()]
        assert all(s.logprobs.tolist() == [-0.5] * len(s.response_token_ids) for s in run_.steps)
    wait_until("every session closed", lambda: sessions(resources) == 0, timeout=30)


def test_bad_bodies_are_typed_errors_and_change_nothing(stack):
    model, resources, agent = stack
    before = completions(model)
    bad = [
        (b"{not json", 400, "malformed_body"),
        (b"[1, 2]", 422, "invalid_request"),
        (json.dumps({"sampling": {}}).encode(), 422, "invalid_request"),
        (json.dumps({"task": secret_task(0).model_dump(mode="json"), "extra": 1}).encode(), 422, "invalid_request"),
        # The resources server refuses a tool it does not have: refused before the model is called.
        (json.dumps({"task": {**secret_task(0).model_dump(mode="json"), "tools": ["no_such_tool"]}}).encode(),
         422, "invalid_request"),
        (json.dumps({"task": {**secret_task(0).model_dump(mode="json"), "verifier": "no_such_verifier"}}).encode(),
         422, "invalid_request"),
        (json.dumps({"responses_create_params": {"input": 3}, "verifier": "exact"}).encode(), 422, "invalid_request"),
    ]
    for body, status, code in bad:
        answer = httpx.post(agent.url + "/run", content=body, headers={"content-type": "application/json"})
        assert (answer.status_code, answer.json()["error"]["code"]) == (status, code), (body, answer.text)
    assert completions(model) == before
    assert sessions(resources) == 0


def test_an_upstream_failure_is_a_502(stack):
    model, resources, agent = stack
    task = secret_task(0, prompt="FAIL-UPSTREAM please")
    answer = httpx.post(agent.url + "/run", json={"task": task.model_dump(mode="json")}, timeout=60)
    assert answer.status_code == 502
    error = answer.json()["error"]
    assert error["code"] == "upstream_error" and "scripted failure" in error["message"]
    wait_until("the run's session closed", lambda: sessions(resources) == 0, timeout=30)


def test_a_model_server_that_is_down_is_a_502(stack, tmp_path):
    _, resources, _ = stack
    dead = agent_server(tmp_path, f"http://127.0.0.1:{free_port()}/v1", resources.url)
    try:
        answer = httpx.post(dead.url + "/run", json={"task": secret_task(0).model_dump(mode="json")}, timeout=60)
    finally:
        dead.stop()
    assert answer.status_code == 502 and answer.json()["error"]["code"] == "upstream_error"
    assert "model server" in answer.json()["error"]["message"]
    wait_until("the run's session closed", lambda: sessions(resources) == 0, timeout=30)


def test_a_gym_run_request_gets_a_gym_verify_response(stack):
    """NeMo Gym's /run body (written from its published BaseRunRequest: responses_create_params
    beside the task's fields) is answered with its BaseVerifyResponse shape, ours beside it."""
    model, resources, agent = stack
    body = {
        "responses_create_params": {
            "input": [{"role": "developer", "content": "Answer with the file's text."},
                      {"role": "user", "content": [{"type": "input_text", "text": "Read secret.txt."}]}],
            "tools": [{"type": "function", "name": "read_file", "strict": True,
                       "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}],
            "temperature": 0.0, "max_output_tokens": 64,
        },
        "verifier": "exact", "expected_answer": "gym-word", "files": {"secret.txt": "gym-word"},
    }
    answer = httpx.post(agent.url + "/run", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    data = answer.json()
    assert data["reward"] == 1.0 and data["expected_answer"] == "gym-word"
    assert data["responses_create_params"] == body["responses_create_params"]
    output = data["response"]["output"]
    assert [o["type"] for o in output] == ["function_call", "function_call_output", "message"]
    assert output[0]["name"] == "read_file" and json.loads(output[0]["arguments"]) == {"path": "secret.txt"}
    assert output[2]["content"][0]["text"] == "gym-word"
    assert output[2]["generation_token_ids"] == [b + 3 for b in b"gym-word"]
    ours = AgentTrajectory.model_validate(data["rollmarket"]["trajectory"])
    assert ours.messages[0] == {"role": "system", "content": "Answer with the file's text."}
    # The same request asking for rollmarket's shape gets only ours.
    plain = httpx.post(agent.url + "/run", params={"shape": "rollmarket"}, json=body, timeout=60).json()
    assert set(plain) == {"trajectory", "reward", "loop"} and plain["reward"] == 1.0
    # And a rollmarket request asking for Gym's shape gets its task written as a Gym row.
    task = secret_task(5)
    gym = httpx.post(agent.url + "/run", params={"shape": "gym"}, json={"task": task.model_dump(mode="json")},
                     timeout=60).json()
    assert gym["responses_create_params"]["input"] == [{"role": "user", "content": task.prompt}]
    assert gym["task_id"] == task.task_id and gym["reward"] == gym["rollmarket"]["reward"] == 1.0
    assert gym["response"]["output"][-1]["content"][0]["text"] == "word-5"


def test_a_gym_dataset_row_runs_without_our_task_fields(stack):
    """A /run body that is a Gym dataset row (mcqa's options + expected_answer, code_gen's unit tests)
    is scored by the matching family; code rows get Gym's all-or-nothing reward, ours the fraction."""
    model, resources, agent = stack
    params = {"input": [{"role": "user", "content": "Read secret.txt."}],
              "tools": [{"type": "function", "name": "read_file",
                         "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}]}
    mcqa = {"responses_create_params": params, "options": [{"A": "Lyon"}, {"B": "Paris"}], "expected_answer": "B",
            "files": {"secret.txt": "\\boxed{B}"}}
    code = {"responses_create_params": params, "files": {"secret.txt": "print(5)"},
            "verifier_metadata": {"unit_tests": {"inputs": ["2 3", "1 1"], "outputs": ["5", "2"], "fn_name": None}}}
    picked = httpx.post(agent.url + "/run", json=mcqa, timeout=60).json()
    assert picked["reward"] == 1.0 and picked["rollmarket"]["trajectory"]["verification"]["passed"], picked
    half = httpx.post(agent.url + "/run", json=code, timeout=60).json()
    assert (half["reward"], half["rollmarket"]["reward"]) == (0.0, 0.5), half
    bad = httpx.post(agent.url + "/run", json={**mcqa, "expected_answer": "Q"}, timeout=60)
    assert bad.status_code == 422 and "expected_answer" in bad.json()["error"]["message"]


def test_the_single_call_loop_offers_no_tools_and_verifies(stack, tmp_path):
    model, resources, _ = stack
    single = agent_server(tmp_path, model.url + "/v1", resources.url, "--loop", "single")
    try:
        task = secret_task(3, answer="tools=0: What does secret.txt say?")
        data = httpx.post(single.url + "/run", json={"task": task.model_dump(mode="json")}, timeout=60).json()
    finally:
        single.stop()
    run_ = AgentTrajectory.model_validate(data["trajectory"])
    assert len(run_.steps) == 1 and run_.tool_calls == [] and data["loop"] == "single"
    assert run_.final_answer == task.answer and data["reward"] == 1.0


@pytest.mark.slow
def test_a_worker_runs_its_jobs_through_an_agent_server(tmp_path):
    """serve-model + verifier serve + agent serve + exchange + `rollmarket worker --agent-url`: the
    exchange accepts the group, whose tokens and experts are those of the agent server's runs. A
    worker whose agent server samples from another model submits nothing."""
    from test_worker import MOE, jobs, policy

    from rollmarket.verifiers import verify_trajectory

    exchange = ExchangeProcess(tmp_path / "ex.db", tmp_path / "ex.log").start()
    resources = resources_server(tmp_path)
    port = free_port()
    scripted = start([sys.executable, str(SCRIPTED), "--port", str(port)], tmp_path / "scripted.log", port)
    try:
        trainer = exchange.trainer()
        trainer.publish_policy(policy(0, MOE))
        first, second = jobs(0, 2, max_tokens=16)
        trainer.enqueue([first])
        with served_model(MOE, tmp_path / "serve.log") as model_url:
            agent = agent_server(tmp_path, model_url, resources.url)
            try:
                done = subprocess.run(
                    rollmarket_command("worker", "--model-url", model_url, "--agent-url", agent.url,
                                       "--exchange", exchange.url, "--max-groups", "1",
                                       "--rollouts", str(tmp_path / "runs.jsonl")),
                    capture_output=True, text=True, timeout=300, cwd=ROOT)
            finally:
                agent.stop()
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
            [served] = trainer.fetch(limit=5).groups

            # The same worker on an agent server that samples from another model server.
            trainer.enqueue([second])
            foreign = agent_server(tmp_path, scripted.url + "/v1", resources.url)
            events = tmp_path / "foreign-events.jsonl"
            worker = subprocess.Popen(
                rollmarket_command("worker", "--model-url", model_url, "--agent-url", foreign.url,
                                   "--exchange", exchange.url, "--events", str(events)),
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
            try:
                wait_until("the foreign runs' job failed", lambda: events.exists() and any(
                    json.loads(line)["event"] == "failed" for line in events.read_text().splitlines()), timeout=120)
            finally:
                worker.terminate()
                worker.wait(30)
                foreign.stop()
        assert trainer.fetch(limit=5).groups == []
    finally:
        scripted.stop()
        resources.stop()
        exchange.stop()
    failed = [json.loads(line) for line in events.read_text().splitlines() if '"failed"' in line]
    assert "runs sampled from scripted" in failed[0]["message"]
    assert not any(json.loads(line)["event"] == "submitted" for line in events.read_text().splitlines())

    group = served.group
    runs = [AgentTrajectory.model_validate_json(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert len(runs) == len(group.trajectories) == first.group_size
    assert group.job_id == first.job_id and group.policy_version == 0
    assert group.checkpoint_digest == policy(0, MOE).checkpoint_digest and group.engine_name != ""
    for run_, trajectory in zip(sorted(runs, key=lambda r: r.sample_index), group.trajectories):
        # The rewards are the verifier's on each run, computed again here.
        assert trajectory.reward == verify_trajectory(first.task, run_).reward
        response = [t for s in run_.steps for t in s.response_token_ids.tolist()]
        tokens = trajectory.response_token_ids.tolist()
        mask = [1] * len(tokens) if trajectory.action_mask is None else trajectory.action_mask.tolist()
        assert [t for t, m in zip(tokens, mask) if m] == response
        assert trajectory.routed_experts is not None
