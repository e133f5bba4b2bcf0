"""The resources server (`rollmarket verifier serve`) as a real process on loopback.

Covers sessions under concurrency (each session sees only its own task's files, its own tool
calls and its own python_eval), /verify scoring the calls a session recorded, the cookie and the
header, typed errors for bad requests that change nothing, workspace deletion on close, expiry
and eviction, and ResourcesClient. No mocks: every request goes over HTTP to the served app.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from rollmarket.contracts import TaskSpec, ToolOutcome, ToolResult, VerifyResult
from helpers import ServiceProcess

from rollmarket.localhost import free_port
from rollmarket.verifiers import ResourcesClient, ResourcesError

ROOT = Path(__file__).resolve().parents[1]


def _serve_command() -> list[str]:
    """`rollmarket verifier serve` through the main command once it is registered there, else the group itself."""
    from rollmarket.cli.main import main

    if "verifier" in main.commands:
        return [sys.executable, "-m", "rollmarket", "verifier"]
    return [sys.executable, "-c", "from rollmarket.cli.verifier import verifier; verifier()"]


@dataclass
class Served:
    proc: subprocess.Popen
    url: str
    tmp: Path
    """The server's TMPDIR: session workspaces are its rollmarket-task-* directories."""

    def workspaces(self) -> list[Path]:
        return sorted(self.tmp.glob("rollmarket-task-*"))

    def healthz(self) -> dict:
        return httpx.get(self.url + "/healthz").json()

    service: ServiceProcess | None = None

    def stop(self) -> None:
        """SIGTERM (the server deletes every workspace on shutdown), SIGKILL after 20 s."""
        self.service.stop(20)


def start_server(tmp: Path, *flags: str) -> Served:
    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    service = ServiceProcess([*_serve_command(), "serve", "--port", str(port), "--log-level", "warning", *flags],
                             tmp.parent / f"{tmp.name}.log", port, env={"TMPDIR": str(tmp)}, cwd=ROOT).start(60)
    return Served(service.proc, service.url, tmp, service)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    served = start_server(tmp_path_factory.mktemp("resources") / "tmp")
    yield served
    served.stop()


@pytest.fixture(scope="module")
def tight(tmp_path_factory):
    """A server with a short TTL, room for two sessions, a 1 s python_eval limit and 2 KiB bodies."""
    served = start_server(tmp_path_factory.mktemp("tight") / "tmp", "--session-ttl-s", "1", "--reap-interval-s",
                          "0.2", "--max-sessions", "2", "--python-eval-timeout-s", "1", "--max-body-bytes", "2048")
    yield served
    served.stop()


def file_task(i: int, **overrides) -> TaskSpec:
    fields = dict(task_id=f"files-{i}", prompt="What does your file say?", tools=["read_file", "python_eval"],
                  files={f"mine-{i}.txt": f"secret {i}", "shared/name.txt": f"task {i}"}, verifier="compound",
                  answer=f"secret {i}",
                  verifier_args={"components": [
                      {"name": "answer", "verifier": "exact", "weight": 0.5},
                      {"name": "tools", "verifier": "tool_use", "weight": 0.5, "args": {"required": ["read_file"]}}],
                      "pass": "answer"})
    fields.update(overrides)
    return TaskSpec(**fields)


def post(url: str, path: str, body=None, *, session: str | None = None, content: bytes | None = None) -> httpx.Response:
    headers = {"x-rollmarket-session": session} if session else {}
    if content is None:
        content = json.dumps({} if body is None else body).encode()
    return httpx.post(url + path, content=content, headers={"content-type": "application/json", **headers}, timeout=60)


def seed(url: str, task: TaskSpec | None = None) -> str:
    response = post(url, "/seed_session", {} if task is None else {"task": task.model_dump(mode="json")})
    assert response.status_code == 200, response.text
    return response.json()["session_id"]


def assert_error(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["message"]
    return error


def test_healthz_and_tools(server):
    health = server.healthz()
    assert health["status"] == "ok" and "sessions" in health
    names = [t["function"]["name"] for t in httpx.get(server.url + "/tools").json()["tools"]]
    assert {"calculator", "python_eval", "read_file", "web_search"} <= set(names)


def test_concurrent_sessions_see_only_their_own_files_calls_and_scores(server):
    n = 8
    barrier = threading.Barrier(n)

    def one(i: int) -> dict:
        with ResourcesClient(server.url) as client:
            barrier.wait()
            client.seed_session(file_task(i))
            barrier.wait()  # every session exists before any reads
            own = client.call_tool("read_file", {"path": f"mine-{i}.txt"})
            other = client.call_tool("read_file", {"path": f"mine-{(i + 1) % n}.txt"})
            shared = client.call_tool("read_file", {"path": "shared/name.txt"})
            listing = client.call_tool("python_eval", {"code": "import os; print(sorted(os.listdir('.')))"})
            printed = client.call_tool("python_eval", {"code": f"print(open('mine-{i}.txt').read().upper())"})
            verdict = client.verify(None, f"secret {i}")      # task and tool calls from the session
            wrong = client.verify(None, f"secret {(i + 1) % n}")
            return dict(own=own, other=other, shared=shared, listing=listing, printed=printed, verdict=verdict,
                        wrong=wrong)

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(n)))
    for i, r in enumerate(results):
        assert r["own"].ok and r["own"].content == f"secret {i}"
        assert r["other"].outcome is ToolOutcome.error and "no such file" in r["other"].content
        assert r["shared"].content == f"task {i}"
        assert r["listing"].ok and r["listing"].content == str(sorted([f"mine-{i}.txt", "shared"]))
        assert r["printed"].content == f"SECRET {i}"
        # the 5 calls recorded in this session alone, one of them failed (the other task's file):
        # tools = mean(required_called 1, no_forbidden 1, no_failed_calls 4/5)
        verdict = r["verdict"]
        tools = verdict.info["parts"]["tools"]
        assert tools["info"]["calls"] == ["read_file", "read_file", "read_file", "python_eval", "python_eval"]
        assert tools["components"]["no_failed_calls"] == pytest.approx(4 / 5)
        assert verdict.passed and verdict.reward == pytest.approx(0.5 + 0.5 * 2.8 / 3), verdict.info
        assert not r["wrong"].passed and r["wrong"].components["answer"] == 0
    assert server.healthz()["sessions"] == 0  # every client closed its session


def test_python_eval_runs_in_parallel_sessions(server):
    """Eight 0.5 s programs in eight sessions finish well before 4 s: the server runs them side by side."""
    sessions = [seed(server.url, file_task(i, task_id=f"sleep-{i}")) for i in range(8)]
    code = {"code": "import time; time.sleep(0.5); print('done')"}
    started = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda s: post(server.url, "/python_eval", code, session=s), sessions))
    elapsed = time.perf_counter() - started
    assert all(ToolResult.model_validate_json(r.content).content == "done" for r in results)
    assert elapsed < 3.5, elapsed
    for session in sessions:
        assert post(server.url, "/close_session", session=session).status_code == 200


def test_verify_uses_the_sessions_calls_unless_given(server):
    task = TaskSpec(task_id="calc", prompt="17*23?", tools=["calculator"], verifier="tool_use",
                    verifier_args={"required": ["calculator"]})
    a, b = seed(server.url, task), seed(server.url, task)
    assert ToolResult.model_validate_json(post(server.url, "/calculator", {"expression": "17*23"}, session=a).content).content == "391"
    body = {"task": task.model_dump(mode="json"), "answer": "391"}
    with_calls = post(server.url, "/verify", body, session=a)
    assert with_calls.headers["x-rollmarket-tool-calls"] == "session"
    assert VerifyResult.model_validate_json(with_calls.content).passed
    assert not VerifyResult.model_validate_json(post(server.url, "/verify", body, session=b).content).passed
    explicit = post(server.url, "/verify", {**body, "tool_calls": []}, session=a)   # given: used as given
    assert explicit.headers["x-rollmarket-tool-calls"] == "request"
    assert not VerifyResult.model_validate_json(explicit.content).passed
    sessionless = post(server.url, "/verify", {"task": file_task(0).model_dump(mode="json"), "answer": "secret 0"})
    assert VerifyResult.model_validate_json(sessionless.content).components == {"answer": 1.0, "tools": pytest.approx(2 / 3)}
    for session in (a, b):
        post(server.url, "/close_session", session=session)


def test_verify_a_trajectory(server):
    from rollmarket.contracts import AgentTrajectory, TerminalReason

    task = TaskSpec(task_id="n", prompt="?", verifier="numeric", answer=391)
    run = AgentTrajectory(task_id="n", messages=[], final_answer="391", terminal_reason=TerminalReason.final_answer)
    unfinished = run.model_copy(update={"terminal_reason": TerminalReason.max_steps})
    for trajectory, reward in [(run, 1.0), (unfinished, 0.0)]:
        response = post(server.url, "/verify", {"task": task.model_dump(mode="json"),
                                                "trajectory": trajectory.model_dump(mode="json")})
        assert VerifyResult.model_validate_json(response.content).reward == reward


def test_cookie_and_header(server):
    task_a, task_b = file_task(100), file_task(200)
    with httpx.Client(base_url=server.url) as browser:
        seeded = browser.post("/seed_session", json={"task": task_a.model_dump(mode="json")})
        assert seeded.cookies.get("rollmarket_session") == seeded.json()["session_id"]
        by_cookie = browser.post("/read_file", json={"path": "mine-100.txt"})   # the jar sends the cookie
        assert by_cookie.json()["content"] == "secret 100"
        b = seed(server.url, task_b)
        by_header = browser.post("/read_file", json={"path": "mine-200.txt"}, headers={"x-rollmarket-session": b})
        assert by_header.json()["content"] == "secret 200"                  # the header wins over the cookie
        assert browser.post("/close_session").json()["closed"] is True
        browser.cookies.set("rollmarket_session", seeded.json()["session_id"])
        assert_error(browser.post("/read_file", json={"path": "mine-100.txt"}), 404, "not_found")
    post(server.url, "/close_session", session=b)


def test_bad_requests_are_typed_errors_and_change_nothing(server):
    before, dirs = server.healthz()["sessions"], server.workspaces()
    url = server.url
    assert_error(post(url, "/read_file", {"path": "x"}), 401, "unauthorized")
    assert_error(post(url, "/read_file", {"path": "x"}, session="no-such-session"), 404, "not_found")
    assert_error(post(url, "/close_session"), 401, "unauthorized")
    assert_error(post(url, "/seed_session", content=b"{not json"), 400, "malformed_body")
    assert_error(post(url, "/seed_session", content=b"[1, 2]"), 422, "invalid_request")
    assert_error(post(url, "/seed_session", {"task": {"task_id": "x"}}), 422, "invalid_request")
    assert_error(post(url, "/seed_session", {"task": {"task_id": "x", "prompt": "?", "verifier": "v"}, "extra": 1}),
                 422, "invalid_request")
    bad_verifier = file_task(1, verifier="no_such_verifier", verifier_args={})
    assert "unknown verifier" in assert_error(post(url, "/seed_session", {"task": bad_verifier.model_dump(mode="json")}),
                                              422, "invalid_request")["message"]
    bad_args = file_task(1, verifier="numeric", answer=1, verifier_args={"rel_tol": "loose"})
    assert_error(post(url, "/seed_session", {"task": bad_args.model_dump(mode="json")}), 422, "invalid_request")
    bad_tool = file_task(1, tools=["read_file", "rm_rf"])
    assert "rm_rf" in assert_error(post(url, "/seed_session", {"task": bad_tool.model_dump(mode="json")}), 422,
                                   "invalid_request")["message"]
    escape = file_task(1, files={"../outside.txt": "x"})
    assert_error(post(url, "/seed_session", {"task": escape.model_dump(mode="json")}), 422, "invalid_request")
    task = file_task(1).model_dump(mode="json")
    assert_error(post(url, "/verify", {"answer": "1"}), 422, "invalid_request")     # no task, no session
    assert_error(post(url, "/verify", {"task": task, "answer": "1", "trajectory": {}}), 422, "invalid_request")
    assert_error(post(url, "/verify", {"task": {**task, "verifier": "nope"}, "answer": "1"}), 422, "invalid_request")
    assert_error(post(url, "/verify", {"task": task, "answer": 7}), 422, "invalid_request")
    assert_error(httpx.get(url + "/no/such/route"), 404, "not_found")
    assert server.healthz()["sessions"] == before and server.workspaces() == dirs


def test_bad_tool_calls_are_data_and_recorded(server):
    task = TaskSpec(task_id="calc-only", prompt="?", tools=["calculator"], verifier="tool_use",
                    verifier_args={"required": ["calculator"]})
    session = seed(server.url, task)

    def tool(name: str, content: bytes) -> ToolResult:
        response = post(server.url, f"/{name}", content=content, session=session)
        assert response.status_code == 200, response.text
        return ToolResult.model_validate_json(response.content)

    assert tool("python_eval", b'{"code": "print(1)"}').outcome is ToolOutcome.unknown_tool   # not offered
    assert tool("no_such_tool", b"{}").outcome is ToolOutcome.unknown_tool
    assert tool("calculator", b"{oops").outcome is ToolOutcome.bad_arguments
    assert tool("calculator", b"[1, 2]").outcome is ToolOutcome.bad_arguments
    assert tool("calculator", b'{"expression": 5}').outcome is ToolOutcome.bad_arguments
    assert tool("calculator", b'{"expression": "1/0"}').outcome is ToolOutcome.error
    assert tool("calculator", b'{"expression": "2+2"}').content == "4"
    verdict = VerifyResult.model_validate_json(post(server.url, "/verify", {"answer": "4"}, session=session).content)
    assert verdict.info["calls"] == ["python_eval", "no_such_tool", "calculator", "calculator", "calculator",
                                     "calculator", "calculator"]
    assert verdict.components["no_failed_calls"] == pytest.approx(1 / 7)
    assert verdict.components["no_forbidden"] == 0 and verdict.components["required_called"] == 1
    post(server.url, "/close_session", session=session)


def test_calls_beyond_the_contract_limits_are_typed_or_recorded_raw(server):
    """Merging the contract limits made these 500s (a record that could not hold the call): a name
    no tool can have, a call id no record holds and arguments too long to keep are typed errors that
    record nothing; arguments nested deeper than the JSON limits are a call recorded with its raw text."""
    session = seed(server.url, TaskSpec(task_id="limits", prompt="?", tools=["calculator"], verifier="tool_use",
                                        verifier_args={"required": ["calculator"]}))
    assert_error(post(server.url, "/" + "t" * 129, {}, session=session), 404, "not_found")
    too_long_id = httpx.post(server.url + "/calculator", content=b'{"expression": "1+1"}',
                             headers={"content-type": "application/json", "x-rollmarket-session": session,
                                      "x-rollmarket-call-id": "c" * 257}, timeout=60)
    assert_error(too_long_id, 422, "invalid_request")
    padded = b'{"expression": "1+1", "pad": "' + b"x" * 1_000_001 + b'"}'
    assert_error(post(server.url, "/calculator", content=padded, session=session), 413, "payload_too_large")
    deep = b'{"expression": ' + b'{"a": ' * 40 + b"1" + b"}" * 40 + b"}"
    result = post(server.url, "/calculator", content=deep, session=session)
    assert result.status_code == 200, result.text
    assert ToolResult.model_validate_json(result.content).outcome is ToolOutcome.bad_arguments
    state = httpx.get(server.url + "/session", headers={"x-rollmarket-session": session}, timeout=60).json()
    assert state["recorded_calls"] == 1  # only the deep call: the refused ones left no trace
    verdict = VerifyResult.model_validate_json(post(server.url, "/verify", {"answer": "2"}, session=session).content)
    assert verdict.info["calls"] == ["calculator"]
    post(server.url, "/close_session", session=session)


def test_closing_a_session_deletes_its_workspace(server):
    before = set(server.workspaces())
    session = seed(server.url, file_task(7))
    [created] = set(server.workspaces()) - before
    assert (created / "mine-7.txt").read_text() == "secret 7"
    closed = post(server.url, "/close_session", session=session)
    assert closed.json() == {"session_id": session, "closed": True}
    assert not created.exists()
    assert_error(post(server.url, "/read_file", {"path": "mine-7.txt"}, session=session), 404, "not_found")
    assert_error(post(server.url, "/close_session", session=session), 404, "not_found")


def test_resources_client_and_remote_toolbox(server):
    from rollmarket.agents.toolbox import RemoteToolbox

    task = file_task(3)
    before = set(server.workspaces())
    client = ResourcesClient(server.url)
    session = client.seed_session(task)
    assert session and set(client.tools) == {"read_file", "python_eval"} and len(server.workspaces()) == len(before) + 1
    assert client.call_tool("read_file", '{"path": "mine-3.txt"}', call_id="call-1").content == "secret 3"
    assert client.call_tool("read_file", "not json").outcome is ToolOutcome.bad_arguments
    verdict = client.verify(task, "secret 3")
    assert verdict.components == {"answer": 1.0, "tools": pytest.approx(2.5 / 3)}   # one of two calls failed
    client.close()
    assert set(server.workspaces()) == before
    with pytest.raises(ResourcesError) as error:
        ResourcesClient(server.url).seed_session(file_task(1, verifier="nope"))
    assert error.value.status == 422 and error.value.code == "invalid_request"
    with RemoteToolbox(server.url).session(task) as tools:
        assert tools.call("read_file", '{"path": "mine-3.txt"}').content == "secret 3"
    assert set(server.workspaces()) == before


def test_sessions_expire_and_the_oldest_is_evicted(tight):
    first = seed(tight.url, file_task(1))
    second = seed(tight.url, file_task(2))
    assert len(tight.workspaces()) == 2
    third = seed(tight.url, file_task(3))               # max_sessions 2: the least recently used goes
    assert_error(post(tight.url, "/read_file", {"path": "mine-1.txt"}, session=first), 404, "not_found")
    assert len(tight.workspaces()) == 2
    assert post(tight.url, "/read_file", {"path": "mine-3.txt"}, session=third).json()["content"] == "secret 3"
    deadline = time.monotonic() + 10
    while tight.workspaces() and time.monotonic() < deadline:   # idle TTL 1 s, reaped every 0.2 s
        time.sleep(0.1)
    assert tight.workspaces() == [] and tight.healthz()["sessions"] == 0
    assert_error(post(tight.url, "/read_file", {"path": "mine-2.txt"}, session=second), 404, "not_found")


def test_python_eval_timeout_setting(tight):
    session = seed(tight.url, file_task(1))
    started = time.perf_counter()
    result = ToolResult.model_validate_json(post(tight.url, "/python_eval", {"code": "while True: pass"},
                                                 session=session).content)
    assert result.outcome is ToolOutcome.timeout and time.perf_counter() - started < 5
    post(tight.url, "/close_session", session=session)


def test_shutdown_deletes_every_workspace(tmp_path):
    served = start_server(tmp_path / "tmp")
    try:
        for i in range(3):
            seed(served.url, file_task(i))
        assert len(served.workspaces()) == 3
    finally:
        served.stop()
    # uvicorn shuts down gracefully, then re-raises the SIGTERM it caught
    assert served.proc.returncode in (0, -signal.SIGTERM) and served.workspaces() == []


@pytest.mark.parametrize("streamed", [False, True], ids=["content-length", "chunked"])
def test_an_oversized_body_is_refused(tight, streamed):
    body = json.dumps({"task": file_task(1, files={"big.txt": "x" * 4096}).model_dump(mode="json")}).encode()
    content = (body[i:i + 512] for i in range(0, len(body), 512)) if streamed else body
    before = tight.healthz()["sessions"]
    with httpx.Client(timeout=30) as http:
        response = http.post(tight.url + "/seed_session", content=content, headers={"content-type": "application/json"})
    assert_error(response, 413, "payload_too_large")
    assert tight.healthz()["sessions"] == before


def test_every_route_and_setting_is_documented():
    from rollmarket.verifiers import ResourcesSettings, create_resources_app

    app = create_resources_app(ResourcesSettings())
    doc = (ROOT / "docs" / "verifiers.md").read_text()
    paths = {r.path for r in app.routes} - {"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"}
    assert {"/seed_session", "/verify", "/close_session", "/{tool_name}"} <= paths
    missing = [p for p in sorted(paths) if f"{p}`" not in doc]
    assert not missing, f"routes missing from docs/verifiers.md: {missing}"
    flags = [f"--{name.replace('_', '-')}" for name in ResourcesSettings.model_fields]
    missing = [f for f in flags if f"`{f}`" not in doc]
    assert not missing, f"settings missing from docs/verifiers.md: {missing}"
