"""Every route of the five HTTP services, fuzzed from their OpenAPI documents (issue 12, section 2).

The exchange, the capture proxy (in front of the real model server), the model server
(`serve-model models/tiny-moe`) and the resources server (`verifier serve`) run as real processes
on loopback. schemathesis generates valid and invalid calls for every operation of each service's
`/openapi.json` (its examples, coverage and fuzzing phases; `tests/fuzzing.py` has the settings and
the checks): no call may get a 5xx, every 4xx must carry the service's typed error body, responses
must fit the schema, and a refused call must leave the service's state as it was. Each service has
its own test function, so one service's failures do not hide another's.

Then, per service, one keep-alive connection: hostile requests (bad JSON, deep nesting, integers
beyond 64 bits, the wrong content type, a body that is not an object) and a valid request on the
same socket, which must be reused and answered.

And one regression test per 5xx the fuzzing found, each a single hand-written request.

Run longer: `ROLLMARKET_FUZZ_EXAMPLES=200 .venv/bin/python -m pytest tests/test_fuzz.py`.
"""

from __future__ import annotations

import http.client
import http.cookiejar
import json
import sqlite3
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from fuzzing import FUZZ_TIMEOUT_S, Target, exchange_error, load_schema, openai_error
from helpers import (
    TRAINER_TOKEN,
    ExchangeProcess,
    ServiceProcess,
    job,
    model_server,
    policy,
    ready_worker,
    rollmarket_command,
)

from rollmarket.localhost import free_port

ROOT = Path(__file__).resolve().parents[1]
MOE = ROOT / "models" / "tiny-moe"
MAX_GENERATED_TOKENS = 4
"""Generation calls ask for at most this many tokens (see `ModelTarget.prepare`)."""
MAX_GENERATED_CHOICES = 4


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@pytest.fixture(autouse=True)
def _schemathesis_node_id(request):
    """schemathesis' lazy schemas (4.32) rename the test node through `_nodeid`, which pytest 9.2
    replaced with `_id`; give the node the attribute it reads (the names it writes go unused)."""
    if not hasattr(request.node, "_nodeid"):
        request.node._nodeid = request.node.nodeid


# == the resources server ========================================================================

@pytest.fixture(scope="module")
def resources(workdir):
    tmp = workdir / "resources-tmp"
    tmp.mkdir()
    port = free_port()
    server = ServiceProcess(rollmarket_command("verifier", "serve", "--port", str(port), "--log-level", "warning",
                                               "--python-eval-timeout-s", "2"),
                            workdir / "resources.log", port, env={"TMPDIR": str(tmp)}, cwd=ROOT)
    server.start(timeout=60)
    server.tmp = tmp
    yield server
    server.stop()


class ResourcesTarget(Target):
    """The resources server's state: its open sessions, the fuzz session's record, the workspaces."""

    def __init__(self, server: ServiceProcess):
        super().__init__(server.url, exchange_error)
        self.tmp = server.tmp
        # The session travels in the header; the cookie seed_session sets is not kept, so that a
        # call without the header really has no session.
        self.session.cookies.set_policy(http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))
        self.client = httpx.Client(base_url=self.url, timeout=30)
        self.session_id = self._seed()

    def _seed(self) -> str:
        task = {"task_id": "fuzz-task", "prompt": "What is in notes.txt?", "verifier": "exact",
                "answer": "42", "files": {"notes.txt": "42\n"}}
        return self.client.post("/seed_session", json={"task": task}).json()["session_id"]

    def _state(self) -> httpx.Response:
        return self.client.get("/session", headers={"x-rollmarket-session": self.session_id})

    def headers(self, case) -> dict[str, str]:
        if self._state().status_code != 200:  # a generated /close_session closed it
            self.session_id = self._seed()
        return {"x-rollmarket-session": self.session_id}

    def requires_auth(self, case) -> bool:
        return case.operation.path not in ("/healthz", "/tools", "/seed_session", "/verify")

    def snapshot(self) -> Any:
        state = self._state()
        return {"sessions": self.client.get("/healthz").json()["sessions"],
                "session": state.json() if state.status_code == 200 else state.status_code,
                "workspaces": sorted(p.name for p in self.tmp.glob("rollmarket-task-*"))}


@pytest.fixture(scope="module")
def resources_schema(resources):
    return load_schema(resources.url)


@pytest.fixture(scope="module")
def resources_target(resources) -> ResourcesTarget:
    return ResourcesTarget(resources)


resources_fuzz = schemathesis.pytest.from_fixture("resources_schema")


@resources_fuzz.parametrize()
@pytest.mark.timeout(FUZZ_TIMEOUT_S)
def test_fuzz_resources_server(case, resources_target):
    resources_target.exercise(case)



# == the model server ============================================================================

@pytest.fixture(scope="module")
def model(workdir):
    # A request without max_tokens gets --default-max-tokens: keep that small too.
    server = model_server(MOE, workdir / "model.log", args=("--default-max-tokens", str(MAX_GENERATED_TOKENS)))
    server.start(timeout=180)
    yield server
    server.stop()


def bound_generation(body: Any, context: int) -> None:
    """Keep generated calls fast: `max_tokens` the model would honour becomes at most
    `MAX_GENERATED_TOKENS`, and `n` at most `MAX_GENERATED_CHOICES`. Values the server refuses
    (zero, negative, beyond the context, beyond 64 bits, not numbers) stay as generated."""
    if not isinstance(body, dict):
        return
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = body.get(name)
        if type(value) is int and MAX_GENERATED_TOKENS < value <= context:
            body[name] = MAX_GENERATED_TOKENS
    n = body.get("n")
    if type(n) is int and MAX_GENERATED_CHOICES < n <= 64:
        body["n"] = MAX_GENERATED_CHOICES


class ModelTarget(Target):
    """The model server's state: the batcher's counters (a refused call must start no generation)."""

    def __init__(self, server: ServiceProcess):
        super().__init__(server.url, openai_error)
        self.client = httpx.Client(base_url=self.url, timeout=60)
        self.context = self.client.get("/v1/models").json()["data"][0]["max_model_len"]

    def prepare(self, case) -> None:
        bound_generation(case.body, self.context)

    def snapshot(self) -> Any:
        engine = self.client.get("/v1/engine").json()
        return {"batches": engine["batches"], "sequences": engine["sequences"]}


@pytest.fixture(scope="module")
def model_schema(model):
    return load_schema(model.url)


@pytest.fixture(scope="module")
def model_target(model) -> ModelTarget:
    return ModelTarget(model)


model_fuzz = schemathesis.pytest.from_fixture("model_schema")


@model_fuzz.parametrize()
@pytest.mark.timeout(FUZZ_TIMEOUT_S)
def test_fuzz_model_server(case, model_target):
    model_target.exercise(case)


# == the capture proxy, in front of the model server =============================================

@pytest.fixture(scope="module")
def proxy(model, workdir):
    port = free_port()
    store = workdir / "captures.db"
    server = ServiceProcess(rollmarket_command("proxy", "--upstream", model.url, "--port", str(port),
                                               "--store", str(store), "--log-level", "warning"),
                            workdir / "proxy.log", port)
    server.start(timeout=60)
    server.store = store
    yield server
    server.stop()


GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


class ProxyTarget(Target):
    """The proxy's state is its capture store. Every generation call, refused or not, adds exactly
    one capture with the status the client got (refusals are recorded as `upstream_error`: that is
    the proxy's contract); nothing else ever changes what is stored."""

    def __init__(self, server: ServiceProcess, context: int):
        super().__init__(server.url, openai_error)
        self.store = server.store
        self.context = context

    def prepare(self, case) -> None:
        bound_generation(case.body, self.context)

    def snapshot(self) -> Any:
        conn = sqlite3.connect(f"file:{self.store}?mode=ro", uri=True)
        try:
            captures = conn.execute("SELECT seq, capture_id, status_code, outcome FROM captures ORDER BY seq").fetchall()
            links = conn.execute("SELECT * FROM links ORDER BY reply_key").fetchall()
        finally:
            conn.close()
        return {"captures": captures, "links": links}

    def _recorded_once(self, before: Any, after: Any, case, response) -> list:
        assert after["captures"][:len(before["captures"])] == before["captures"], "stored captures changed"
        new = after["captures"][len(before["captures"]):]
        if case.method.upper() == "POST" and case.operation.path in GENERATION_ROUTES:
            assert len(new) == 1, f"{len(new)} captures for one generation call"
            assert new[0][2] == response.status_code, (new[0], response.status_code)
        else:
            assert new == [], f"a call that is not a generation call was recorded: {new}"
        return new

    def assert_unchanged(self, before: Any, after: Any, case, response) -> None:
        new = self._recorded_once(before, after, case, response)
        assert all(row[3] == "upstream_error" for row in new), new
        assert after["links"] == before["links"], "a refused call changed how conversations link"

    def after_accepted(self, before: Any, after: Any, case, response) -> None:
        self._recorded_once(before, after, case, response)


@pytest.fixture(scope="module")
def proxy_schema(proxy):
    return load_schema(proxy.url)


@pytest.fixture(scope="module")
def proxy_target(proxy, model_target) -> ProxyTarget:
    return ProxyTarget(proxy, model_target.context)


proxy_fuzz = schemathesis.pytest.from_fixture("proxy_schema")


@proxy_fuzz.parametrize()
@pytest.mark.timeout(FUZZ_TIMEOUT_S)
def test_fuzz_proxy(case, proxy_target):
    proxy_target.exercise(case)


# == the exchange ================================================================================

CALM = ("--heartbeat-ttl-s", "3600", "--lease-ttl-s", "3600", "--reaper-interval-s", "3600",
        "--max-lease-wait-s", "0.2")
"""The reaper changes nothing while the fuzzing runs (an accepted fuzzed job may carry a deadline
that passes during a later, refused call); long polls are short."""
ALLOWED_AUDIT = {"submission.rejected", "reload.violation"}
"""Refusals that leave an audit trace on purpose (docs/dev-notes.md, tests/test_api_bad_input.py)."""


@pytest.fixture(scope="module")
def exchange_fuzzed(workdir):
    server = ExchangeProcess(db=workdir / "exchange.db", log=workdir / "exchange.log", args=list(CALM)).start()
    trainer = server.trainer()
    trainer.publish_policy(policy(0))
    worker = ready_worker(server.url, "fuzz-worker")
    trainer.enqueue([job(i) for i in range(4)])
    server.worker_token = worker.http.token
    yield server
    server.stop()


class ExchangeTarget(Target):
    """The exchange's state is its SQLite file: every table, read from outside the server. A refusal
    may add only the audit events in `ALLOWED_AUDIT`, and a rejected submission may lower the
    fuzz worker's quality and raise its rejected_count (dispatch learns from it, on purpose)."""

    def __init__(self, server: ExchangeProcess):
        super().__init__(server.url, exchange_error)
        self.db = server.db
        self.worker_token = server.worker_token

    def headers(self, case) -> dict[str, str]:
        if case.operation.path == "/v1/workers/register":
            return {}
        token = self.worker_token if "workers" in case.operation.tags else TRAINER_TOKEN
        return {"authorization": f"Bearer {token}"}

    def requires_auth(self, case) -> bool:
        return case.operation.path not in ("/healthz", "/metrics", "/v1/workers/register")

    def snapshot(self) -> Any:
        conn = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True)
        conn.row_factory = sqlite3.Row
        try:
            names = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table' "
                                                "AND name NOT LIKE 'sqlite_%' ORDER BY name")]
            return {name: [dict(r) for r in conn.execute(f'SELECT * FROM "{name}" ORDER BY rowid')] for name in names}
        finally:
            conn.close()

    def assert_unchanged(self, before: Any, after: Any, case, response) -> None:
        audit_before, audit_after = before.pop("audit", []), after.pop("audit", [])
        assert audit_after[:len(audit_before)] == audit_before, "existing audit events changed"
        new_kinds = {row["kind"] for row in audit_after[len(audit_before):]}
        assert new_kinds <= ALLOWED_AUDIT, f"a refusal left audit events {new_kinds}"
        if "submission.rejected" in new_kinds:
            keep = ("quality", "rejected_count")
            after["workers"] = [{**row, **{k: old[k] for k in keep}} if row["worker_id"] == "fuzz-worker" else row
                                for row, old in zip(after["workers"], before["workers"])]
        for name in before:
            assert after.get(name) == before[name], f"table {name} changed after a {response.status_code}"


@pytest.fixture(scope="module")
def exchange_schema(exchange_fuzzed):
    return load_schema(exchange_fuzzed.url)


@pytest.fixture(scope="module")
def exchange_target(exchange_fuzzed) -> ExchangeTarget:
    return ExchangeTarget(exchange_fuzzed)


exchange_fuzz = schemathesis.pytest.from_fixture("exchange_schema")


@exchange_fuzz.parametrize()
@pytest.mark.timeout(FUZZ_TIMEOUT_S)
def test_fuzz_exchange(case, exchange_target):
    exchange_target.exercise(case)


# == keep-alive after errors =====================================================================

DEEP = b"[" * 100_000 + b"]" * 100_000
HOSTILE: list[tuple[str, bytes]] = [
    ("application/json", b"{not json"),
    ("application/json", DEEP),
    ("application/json", b'{"a": ' + b"[" * 80 + b"]" * 80 + b"}"),
    ("application/json", b'{"model": "tiny-moe", "n": 1' + b"0" * 40 + b', "max_tokens": -' + b"9" * 30 + b"}"),
    ("application/json", b'{"model": "tiny-moe", "messages": [{"role": "user", "content": "\\ud800 \\u0000"}], '
                         b'"task": {"task_id": "t", "prompt": "\\udfff", "verifier": "exact"}}'),
    ("application/json", b"[1, 2, 3]"),
    ("application/json", b"null"),
    ("text/plain", b"hello"),
    ("application/msgpack", b"\xc1\xc1\xc1"),
    ("application/json", b"\xff\xfe\x00"),
]


def assert_keeps_serving(url: str, hostile_path: str, valid: tuple[str, str, bytes | None, dict],
                         parse_error, *, expect_ok: int = 200) -> None:
    """Hostile requests then a valid one on ONE connection: each hostile one gets a typed 4xx, the
    socket stays the same (same local port, never reconnected), and the valid call succeeds."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.connect()
    sock = conn.sock
    local = sock.getsockname()
    try:
        for content_type, body in HOSTILE:
            conn.request("POST", hostile_path, body=body, headers={"content-type": content_type, **valid[3]})
            response = conn.getresponse()
            data = response.read()
            assert 400 <= response.status < 500, (content_type, body[:60], response.status, data[:300])
            parse_error(json.loads(data))
            assert not response.will_close, f"the server closed the connection after {body[:60]!r}"
            assert conn.sock is sock and sock.getsockname() == local, "the connection was not reused"
        method, path, body, headers = valid
        conn.request(method, path, body=body, headers={"content-type": "application/json", **headers})
        response = conn.getresponse()
        data = response.read()
        assert response.status == expect_ok, (response.status, data[:500])
        assert conn.sock is sock and sock.getsockname() == local, "the valid call needed a new connection"
    finally:
        conn.close()


def test_resources_server_keeps_the_connection_after_errors(resources_target):
    session = {"x-rollmarket-session": resources_target.session_id}
    assert_keeps_serving(resources_target.url, "/seed_session",
                         ("POST", "/calculator", b'{"expression": "6 * 7"}', session), exchange_error)


def test_model_server_keeps_the_connection_after_errors(model_target):
    chat = json.dumps({"model": "tiny-moe", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert_keeps_serving(model_target.url, "/v1/chat/completions", ("POST", "/v1/chat/completions", chat.encode(), {}),
                         openai_error)


def test_proxy_keeps_the_connection_after_errors(proxy_target):
    chat = json.dumps({"model": "tiny-moe", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert_keeps_serving(proxy_target.url, "/v1/chat/completions", ("POST", "/v1/chat/completions", chat.encode(), {}),
                         openai_error)


def test_exchange_keeps_the_connection_after_errors(exchange_target):
    auth = {"authorization": f"Bearer {TRAINER_TOKEN}"}
    assert_keeps_serving(exchange_target.url, "/v1/jobs", ("GET", "/v1/pool", None, auth), exchange_error)


# == the agent server ============================================================================

@pytest.fixture(scope="module")
def agent_stack(workdir):
    """`agent serve` between tests/scripted_model.py and a resources server (all real processes)."""
    started = []
    try:
        port = free_port()
        model = ServiceProcess([sys.executable, str(ROOT / "tests" / "scripted_model.py"), "--port", str(port)],
                               workdir / "scripted.log", port, cwd=ROOT).start(60)
        started.append(model)
        port = free_port()
        resources = ServiceProcess(rollmarket_command("verifier", "serve", "--port", str(port), "--log-level",
                                                      "warning"), workdir / "agent-resources.log", port,
                                   cwd=ROOT).start(60)
        started.append(resources)
        port = free_port()
        agent = ServiceProcess(rollmarket_command("agent", "serve", "--model-url", model.url + "/v1",
                                                  "--resources-url", resources.url, "--port", str(port),
                                                  "--log-level", "warning"), workdir / "agent.log", port,
                               cwd=ROOT).start(60)
        started.append(agent)
        yield model, resources, agent
    finally:
        for service in reversed(started):
            service.stop()


class AgentTarget(Target):
    """The agent server's effects: completions asked of the model server, sessions left open."""

    def __init__(self, model: ServiceProcess, resources: ServiceProcess, agent: ServiceProcess):
        super().__init__(agent.url, exchange_error)
        self.model_url, self.resources_url = model.url, resources.url

    def snapshot(self) -> Any:
        return {"completions": httpx.get(self.model_url + "/stats").json()["completions"],
                "sessions": httpx.get(self.resources_url + "/healthz").json()["sessions"]}


@pytest.fixture(scope="module")
def agent_schema(agent_stack):
    return load_schema(agent_stack[2].url)


@pytest.fixture(scope="module")
def agent_target(agent_stack) -> AgentTarget:
    return AgentTarget(*agent_stack)


agent_fuzz = schemathesis.pytest.from_fixture("agent_schema")


@agent_fuzz.parametrize()
@pytest.mark.timeout(FUZZ_TIMEOUT_S)
def test_fuzz_agent_server(case, agent_target):
    agent_target.exercise(case)


# == regressions: one request per 5xx the fuzzing found (each answered 500 before) ===============

def post_raw(url: str, path: str, body: bytes, **headers: str) -> httpx.Response:
    return httpx.post(url + path, content=body, headers={"content-type": "application/json", **headers}, timeout=120)


def chat_body(**fields) -> bytes:
    return json.dumps({"model": "tiny-moe", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                       **fields}).encode()


def assert_openai_400(response: httpx.Response, code: str | None = None, param: str | None = None) -> None:
    assert response.status_code == 400, response.text
    openai_error(response.json())
    if code:
        assert response.json()["error"]["code"] == code, response.text
    if param:
        assert response.json()["error"]["param"] == param, response.text


def test_model_server_refuses_deep_nesting(model):
    for body in (DEEP, chat_body(extra=json.loads("[" * 500 + "]" * 500))):
        assert_openai_400(post_raw(model.url, "/v1/chat/completions", body), code="too_deep")


def test_model_server_refuses_tool_calls_that_are_not_objects(model):
    for calls in (5, ["a"], [{"function": "f"}]):
        messages = [{"role": "assistant", "content": "x", "tool_calls": calls}, {"role": "user", "content": "Hi"}]
        assert_openai_400(post_raw(model.url, "/v1/chat/completions", chat_body(messages=messages)), param="messages")
        assert_openai_400(post_raw(model.url, "/tokenize", json.dumps({"messages": messages}).encode()),
                          param="messages")


def test_model_server_refuses_lone_surrogates(model):
    for path, body in (("/tokenize", b'{"prompt": "\\ud800"}'),
                       ("/v1/completions", b'{"model": "tiny-moe", "prompt": "a\\udfff", "max_tokens": 2}'),
                       ("/v1/chat/completions", b'{"model": "tiny-moe", "messages": [{"role": "user", "content": '
                                                b'"\\ud800"}], "max_tokens": 2}')):
        assert_openai_400(post_raw(model.url, path, body), code="lone_surrogate")


def test_model_server_reads_content_parts_whose_text_is_not_a_string(model):
    messages = [{"role": "user", "content": [{"type": "text", "text": 17}, {"type": "text", "text": " apples"}]}]
    response = post_raw(model.url, "/v1/chat/completions", chat_body(messages=messages))
    assert response.status_code == 200, response.text


def test_model_server_bounds_every_integer(model):
    """Integers beyond 64 bits (and beyond what each field means) are refused by name, not taken in."""
    for field, value in (("top_k", 2**70), ("seed", 2**64), ("stop_token_ids", [2**70]), ("max_tokens", 2**70)):
        assert_openai_400(post_raw(model.url, "/v1/chat/completions", chat_body(**{field: value})))
    assert_openai_400(post_raw(model.url, "/detokenize", json.dumps({"tokens": [2**70]}).encode()))


def test_model_server_framework_refusals_are_openai_errors(model):
    for response, status in ((httpx.get(model.url + "/no-such-route"), 404),
                             (httpx.request("TRACE", model.url + "/v1/models"), 405),
                             (httpx.get(model.url + "/v1/chat/completions"), 405)):
        assert response.status_code == status
        openai_error(response.json())


def _captures_since(store: Path, seq: int) -> list:
    from rollmarket.proxy.store import CaptureStore

    return [capture for _, capture in CaptureStore(store).iter_captures(since_seq=seq)]


def _last_seq(store: Path) -> int:
    with sqlite3.connect(f"file:{store}?mode=ro", uri=True) as conn:
        return conn.execute("SELECT coalesce(max(seq), 0) FROM captures").fetchone()[0]


def test_proxy_forwards_and_records_bodies_it_cannot_read(proxy):
    """Deep nesting and lone surrogates went 500 in the proxy itself; now the upstream judges them
    (its typed 400 reaches the client) and the call is recorded with a note, without its request."""
    for body, code in ((DEEP, "too_deep"),
                       (b'{"model": "tiny-moe", "messages": [{"role": "user", "content": "\\ud800"}]}', "lone_surrogate")):
        mark = _last_seq(proxy.store)
        assert_openai_400(post_raw(proxy.url, "/v1/chat/completions", body), code=code)
        [capture] = _captures_since(proxy.store, mark)
        assert capture.status_code == 400 and capture.outcome.value == "upstream_error"
        assert capture.messages is None and any("request not recorded" in note for note in capture.notes)


def test_proxy_records_calls_the_capture_contract_cannot_hold_as_sent(proxy):
    """Messages or tools that are not objects, and integers beyond 64 bits, made the capture's write
    fail: the client got its answer and the call was lost. Now each is recorded, with a note."""
    cases = [chat_body(messages=[1, {"role": "user", "content": "Hi"}]), chat_body(tools=[None]),
             chat_body(seed=2**70), chat_body(user_tag=2**70)]
    for body in cases:
        mark = _last_seq(proxy.store)
        response = post_raw(proxy.url, "/v1/chat/completions", body)
        assert response.status_code in (200, 400), response.text
        [capture] = _captures_since(proxy.store, mark)
        assert capture.status_code == response.status_code
    mark = _last_seq(proxy.store)
    ok = post_raw(proxy.url, "/v1/chat/completions", chat_body(user_tag=2**70))
    assert ok.status_code == 200
    [capture] = _captures_since(proxy.store, mark)
    assert capture.outcome.value == "ok" and capture.choices[0].response_token_ids is not None


def test_proxy_own_refusals_are_openai_errors(proxy):
    for response, status in ((httpx.get(proxy.url + "/no-such-route"), 404),
                             (httpx.post(proxy.url + "/healthz"), 405)):
        assert response.status_code == status, response.text
        openai_error(response.json())
    assert httpx.get(proxy.url + "/openapi.json").json()["paths"]["/v1/chat/completions"]["post"]["requestBody"]


def test_resources_server_refuses_a_numeric_answer_beyond_floats(resources):
    task = {"task_id": "t", "prompt": "p", "verifier": "numeric", "answer": 10**400}
    response = post_raw(resources.url, "/verify", json.dumps({"task": task, "answer": "1"}).encode())
    assert response.status_code == 422, response.text
    assert exchange_error(response.json()) == "invalid_request"


def test_resources_server_refuses_lone_surrogates(resources):
    body = b'{"task": {"task_id": "t", "prompt": "p", "verifier": "exact", "answer": "x"}, "answer": "\\ud800"}'
    response = post_raw(resources.url, "/verify", body)
    assert response.status_code == 400, response.text
    assert exchange_error(response.json()) == "malformed_body"
