"""The resources server's /verify with NeMo Gym's bodies, against a real `rollmarket verifier serve`.

The bodies are written from Gym's published schema (`BaseVerifyRequest`: `responses_create_params`
and `response`, a Responses object whose `output` holds the run) and checked against the official
`openai` package's Responses types, so that a body the test sends is one a Gym agent could send.
Expected rewards are known by hand (391 is 17 * 23; the tool_use task wants a calculator call) and
cross-checked against our own body form with the same answer and calls.
"""

from __future__ import annotations

import json

import httpx
import pytest
from openai.types.responses import Response
from test_resources_server import assert_error, post, seed, start_server

from rollmarket.contracts import TaskSpec, VerifyResult

NUMERIC = TaskSpec(task_id="mul", prompt="What is 17 * 23?", verifier="numeric", answer=391)
TOOL_USE = TaskSpec(task_id="calc", prompt="What is 17 * 23?", tools=["calculator"], verifier="tool_use",
                    verifier_args={"required": ["calculator"]})
PARAMS = {"input": [{"role": "user", "content": "What is 17 * 23?"}],
          "tools": [{"type": "function", "name": "calculator", "strict": False,
                     "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}]}
CALL = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "calculator",
        "arguments": json.dumps({"expression": "17 * 23"}), "status": "completed"}
CALL_OUTPUT = {"type": "function_call_output", "call_id": "call_1", "output": "391"}


def message(text: str) -> dict:
    return {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def response(*items: dict) -> dict:
    body = {"id": "resp_1", "object": "response", "created_at": 1.0, "model": "policy", "output": list(items),
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": PARAMS["tools"]}
    Response.model_validate({k: v for k, v in body.items() if k != "output"} | {
        "output": [i for i in items if i["type"] != "function_call_output"]})  # a well-formed Responses object
    return body


def gym(task: TaskSpec | None, *items: dict, **extra) -> dict:
    body = {"responses_create_params": PARAMS, "response": response(*items), **extra}
    if task is not None:
        body["task"] = task.model_dump(mode="json")
    return body


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    served = start_server(tmp_path_factory.mktemp("gym") / "tmp")
    yield served
    served.stop()


@pytest.mark.parametrize("text, reward", [("391", 1.0), ("It is 390.", 0.0)])
def test_a_gym_rollout_is_scored_and_answered_in_gyms_shape(server, text, reward):
    body = gym(NUMERIC, CALL, CALL_OUTPUT, message(text), _ng_task_index=3)
    answered = post(server.url, "/verify", body)
    assert answered.status_code == 200, answered.text
    out = answered.json()
    assert out["reward"] == reward
    # Gym's BaseVerifyResponse echoes the request, per-task fields included.
    assert {k: out[k] for k in body} == body
    assert VerifyResult.model_validate(out["verification"]).reward == reward
    assert answered.headers["x-rollmarket-tool-calls"] == "response"
    # The same answer in our own body form gets the same verdict.
    ours = post(server.url, "/verify", {"task": NUMERIC.model_dump(mode="json"), "answer": text})
    assert VerifyResult.model_validate_json(ours.content) == VerifyResult.model_validate(out["verification"])


def test_function_calls_in_the_response_are_the_runs_tool_calls(server):
    with_call = post(server.url, "/verify", gym(TOOL_USE, CALL, CALL_OUTPUT, message("391"))).json()
    without = post(server.url, "/verify", gym(TOOL_USE, message("391"))).json()
    assert with_call["reward"] == 1.0 and with_call["verification"]["passed"]
    assert not without["verification"]["passed"] and without["reward"] < 1.0
    # No calls in a sessionless Gym body is our body with no calls.
    ours = post(server.url, "/verify", {"task": TOOL_USE.model_dump(mode="json"), "answer": "391", "tool_calls": []})
    assert VerifyResult.model_validate_json(ours.content) == VerifyResult.model_validate(without["verification"])
    # A call in the request's input (an earlier turn) counts too.
    earlier = gym(TOOL_USE, message("391"))
    earlier["responses_create_params"] = {**PARAMS, "input": [*PARAMS["input"], CALL, CALL_OUTPUT]}
    assert post(server.url, "/verify", earlier).json()["reward"] == 1.0


def test_the_sessions_task_and_recorded_calls_stand_in(server):
    session = seed(server.url, TOOL_USE)
    assert post(server.url, "/calculator", {"expression": "17*23"}, session=session).json()["content"] == "391"
    answered = post(server.url, "/verify", gym(None, message("391")), session=session)
    assert answered.status_code == 200, answered.text
    assert answered.json()["reward"] == 1.0 and answered.headers["x-rollmarket-tool-calls"] == "session"
    post(server.url, "/close_session", session=session)


def test_malformed_gym_bodies_are_typed_errors_and_change_nothing(server):
    before = server.healthz()["sessions"]
    good = gym(NUMERIC, message("391"))
    bad = [
        {"responses_create_params": PARAMS, "task": good["task"]},                      # no response
        {**good, "response": {**good["response"], "output": "391"}},                    # output not a list
        {**good, "response": {k: v for k, v in good["response"].items() if k != "output"}},
        {**good, "response": {**good["response"], "output": [1, 2]}},                   # items not objects
        {**good, "responses_create_params": "What is 17 * 23?"},                        # params not an object
        {**good, "answer": "391"},                                                      # both shapes at once
        {k: v for k, v in good.items() if k != "task"},                                 # no task, no session
        {**good, "response": {**good["response"], "output": [{**CALL, "arguments": {"x": 1}}]}},  # not a string
    ]
    for body in bad:
        assert_error(post(server.url, "/verify", body), 422, "invalid_request")
    assert_error(post(server.url, "/verify", content=b'{"response": '), 400, "malformed_body")
    assert server.healthz()["sessions"] == before


def test_the_gym_body_is_in_the_openapi_document(server):
    schemas = httpx.get(server.url + "/openapi.json").json()["components"]["schemas"]
    assert {"responses_create_params", "response"} <= set(schemas["GymVerifyRequest"]["properties"])
