"""NeMo Gym dataset rows scored without our task: a real `rollmarket verifier serve` reads the row's
own fields (math_with_judge's expected_answer, mcqa's options, code_gen's unit tests,
instruction_following's instruction ids and kwargs) the way Gym's resources servers do.

The bodies are written from Gym's published request models (`LibraryJudgeMathVerifyRequest`,
`MCQAVerifyRequest`, `CompCodingVerifyRequest` with LiveCodeBench's `UnitTests`,
`InstructionFollowingVerifyRequest`) and their Responses objects checked against the official
`openai` types. Expected rewards are known by hand from each row.
"""

from __future__ import annotations

import base64
import json
import subprocess
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Thread

import httpx
import pytest
from fastapi.testclient import TestClient
from helpers import rollmarket_command
from test_gym_verify import message, response
from test_resources_server import assert_error, post, start_server

from rollmarket.contracts import TaskSpec
from rollmarket.verifiers import ResourcesSettings, create_resources_app, verify
from rollmarket.verifiers.client import ResourcesClient, ResourcesError
from rollmarket.verifiers.gym_rows import GymRowError, task_from_row


def params(text: str) -> dict:
    return {"input": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]}


def row(text: str, **fields) -> dict:
    return {"responses_create_params": params(text), **fields}


def body(row_: dict, answer: str) -> dict:
    return {**row_, "response": response(message(answer))}


def packed(inputs: list[str], outputs: list[str]) -> dict:
    blob = zlib.compress(json.dumps({"inputs": inputs, "outputs": outputs}).encode())
    return {"packed": base64.b64encode(blob).decode(), "fn_name": None}


MATH = row("What is 1/4 + 1/4?", question="What is 1/4 + 1/4?", expected_answer="\\frac{1}{2}")
MCQA = row("Capital of France? A) Lyon B) Paris C) Nice", uuid="q-7",
           options=[{"A": "Lyon"}, {"B": "Paris"}, {"C": "Nice"}], expected_answer="B",
           grading_mode="strict_single_letter_boxed")
CODE_IO = row("Read a and b, print a+b.", verifier_metadata={"unit_tests": {
    "inputs": ["2 3\n", "10 -4\n"], "outputs": ["5\n", "6\n"], "fn_name": None}})
CODE_PACKED = row("Read a and b, print a+b.", verifier_metadata={"unit_tests": packed(["1 1\n", "7 8\n"],
                                                                                   ["2\n", "15\n"])})
CODE_CALL = row("Solution.twoSum", verifier_metadata={"unit_tests": {
    "inputs": ["[2, 7, 11, 15]\n9", "[3, 2, 4]\n6"], "outputs": ["[0, 1]", "[1, 2]"], "fn_name": "twoSum"},
    "difficulty": "easy"})
IFEVAL = row("Write about the sea in lower case, under 6 words, no commas.", id=1001,
             prompt="Write about the sea in lower case, under 6 words, no commas.",
             instruction_id_list=["change_case:english_lowercase", "length_constraints:number_words",
                                  "punctuation:no_comma"],
             kwargs=[{}, {"relation": "less than", "num_words": 6, "num_sentences": None}, None])

SUM = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
TWO_SUM = ("```python\nclass Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n"
           "        for i, n in enumerate(nums):\n            if target - n in seen:\n"
           "                return [seen[target - n], i]\n            seen[n] = i\n```")

# (row, answer, Gym's reward, our verdict's reward, our verifier): Gym's code_gen and
# instruction_following give 1 only when all hold; our verdict keeps the fraction.
CASES = [
    (MATH, "Adding, \\boxed{\\frac{2}{4}}", 1.0, 1.0, "math"),
    (MATH, "\\boxed{1/3}", 0.0, 0.0, "math"),
    (MCQA, "The answer is \\boxed{B}.", 1.0, 1.0, "multiple_choice"),
    (MCQA, "\\boxed{A}", 0.0, 0.0, "multiple_choice"),
    (CODE_IO, SUM, 1.0, 1.0, "code"),
    (CODE_IO, "```python\nprint(5)\n```", 0.0, 0.5, "code"),
    (CODE_PACKED, SUM, 1.0, 1.0, "code"),  # Gym's code_gen at 07d6b0d does not read `packed` (its 500)
    (CODE_CALL, TWO_SUM, 1.0, 1.0, "code"),
    (CODE_CALL, "```python\ndef twoSum(nums, target):\n    return [0, 1]\n```", 0.0, 0.5, "code"),
    (IFEVAL, "the sea is wide", 1.0, 1.0, "instructions"),
    (IFEVAL, "the sea so wide and deep and blue", 0.0, 2 / 3, "instructions"),
    (IFEVAL, "The sea, so wide and deep and blue", 0.0, 0.0, "instructions"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    served = start_server(tmp_path_factory.mktemp("gymrows") / "tmp")
    yield served
    served.stop()


def test_gym_rows_are_scored_by_the_matching_family(server):
    for row_, answer, reward, ours_reward, verifier in CASES:
        sent = body(row_, answer)
        answered = post(server.url, "/verify", sent)
        assert answered.status_code == 200, answered.text
        out = answered.json()
        assert out["reward"] == pytest.approx(reward), (row_, answer, out["verification"])
        assert out["verification"]["reward"] == pytest.approx(ours_reward)
        assert {k: out[k] for k in sent} == sent  # Gym's answer echoes the request, row fields included
        if verifier == "multiple_choice":  # what Gym's servers add: the answer as read
            assert out["extracted_answer"] == ("B" if reward else "A")
        if verifier == "math":  # fields Gym's math_with_judge response (LibraryJudgeMathVerifyResponse) requires
            assert (out["library_reward"], out["judge_evaluations"]) == (reward, None)
        if verifier == "code":
            assert out["extracted_model_code"] == answer.split("```python\n")[1].split("```")[0].strip()
        # The row's task, given as our own task, gets the same verdict: the row was read, not guessed.
        task = task_from_row(row_)
        assert task.verifier == verifier
        # The row's conversation (a system prompt, then the question) is the task's, its last user text the prompt.
        assert task.messages == [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": row_["responses_create_params"]["input"][1]["content"]}]
        assert task.prompt == task.messages[1]["content"]
        ours = post(server.url, "/verify", {"task": task.model_dump(mode="json"), "answer": answer})
        assert ours.json()["reward"] == pytest.approx(ours_reward)


BAD_ROWS = [
    ({**MCQA, "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}, "several Gym datasets"),
    ({**MCQA, "options": [{"A": "Lyon"}, {"C": "Paris"}]}, "options.1"),
    ({**MCQA, "options": [{"A": "Lyon", "B": "Paris"}, {"C": "x"}]}, "options.0"),
    ({**MCQA, "expected_answer": "D"}, "expected_answer"),
    ({**MATH, "expected_answer": "  "}, "expected_answer"),
    ({**IFEVAL, "instruction_id_list": ["detectable_content:postscript", "punctuation:no_comma",
                                        "punctuation:no_comma"]}, "instruction_id_list.0"),
    ({**IFEVAL, "kwargs": [{}]}, "same length"),
    ({**IFEVAL, "kwargs": [{}, {"relation": "about", "num_words": 6}, {}]}, "kwargs.1"),
    (row("x", verifier_metadata={"unit_tests": {"inputs": ["1"], "outputs": [], "fn_name": None}}), "1 inputs"),
    (row("x", verifier_metadata={"unit_tests": {"packed": "not base64!", "fn_name": None}}), "packed"),
    (row("x", verifier_metadata={"unit_tests": {"inputs": ["1"], "outputs": ["2"], "fn_name": "a b"}}), "fn_name"),
    (row("x", verifier_metadata={"unit_tests": {"inputs": ["{"], "outputs": ["2"], "fn_name": "f"}}), "JSON"),
    (row("x", verifier_metadata={}), "unit_tests"),
    ({**MCQA, "grading_mode": "lenient_answer_colon_md"}, "grading_mode"),
    ({**MCQA, "template_metadata": {"output_regex": "(["}}, "not a regular expression"),
    ({**MCQA, "template_metadata": {"output_regex": "(a)(b)"}}, "2 groups"),
    ({**MCQA, "template_metadata": {"output_regex": 3}}, "output_regex"),
    ({"responses_create_params": {"input": []}, "expected_answer": "2"}, "user message"),
]


@pytest.mark.parametrize("bad, says", BAD_ROWS)
def test_bad_rows_are_typed_errors(bad, says):
    with pytest.raises(GymRowError, match=says):
        task_from_row(bad)


def test_bad_rows_over_http_are_422_and_change_nothing(server):
    before = server.healthz()["sessions"]
    for bad, says in BAD_ROWS:
        error = assert_error(post(server.url, "/verify", body(bad, "\\boxed{B}")), 422, "invalid_request")
        assert says in error["message"] and error["details"]["shape"] == "nemo_gym", error
    assert server.healthz()["sessions"] == before


def test_a_named_dataset_reads_rows_as_that_dataset_only():
    """--gym-dataset mcqa: a math-looking row is an mcqa row without options (422), an mcqa row is scored."""
    with TestClient(create_resources_app(ResourcesSettings(gym_dataset="mcqa"))) as client:
        math_row = client.post("/verify", json=body(MATH, "\\boxed{\\frac{1}{2}}"))
        assert math_row.status_code == 422 and "options" in math_row.json()["error"]["message"]
        assert client.post("/verify", json=body(MCQA, "\\boxed{B}")).json()["reward"] == 1.0
        documented = client.get("/openapi.json").json()["components"]["schemas"]["GymVerifyRequest"]["properties"]
        assert {"expected_answer", "options", "verifier_metadata", "instruction_id_list", "kwargs"} <= set(documented)


def test_an_explicit_task_wins_over_the_rows_fields(server):
    task = TaskSpec(task_id="t", prompt="?", verifier="exact", answer="Paris")
    answered = post(server.url, "/verify", {**body(MCQA, "Paris"), "task": task.model_dump(mode="json")})
    assert answered.json()["reward"] == 1.0  # exact "Paris", not mcqa's letter B


def test_import_gym_writes_tasks_that_score_like_the_server(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps(r) for r in (MATH, MCQA, CODE_IO, IFEVAL, MCQA)) + "\n")
    out = tmp_path / "tasks" / "gym.jsonl"
    done = subprocess.run(rollmarket_command("verifier", "import-gym", str(rows), "--out", str(out)),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    tasks = [TaskSpec.model_validate_json(line) for line in out.read_text().splitlines()]
    assert [t.verifier for t in tasks] == ["math", "multiple_choice", "code", "instructions", "multiple_choice"]
    assert len({t.task_id for t in tasks}) == 5 and tasks[1].task_id == "gym-q-7"  # the repeated row kept apart
    assert [verify(t, a).reward for t, a in zip(tasks, ["\\boxed{0.5}", "\\boxed{B}", SUM, "the sea"],
                                                strict=False)] == [1.0, 1.0, 1.0, 1.0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(MATH) + "\n" + json.dumps({**MCQA, "expected_answer": "Z"}) + "\n")
    refused = subprocess.run(rollmarket_command("verifier", "import-gym", str(bad), "--out", str(tmp_path / "no")),
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "line 2" in refused.stderr and not (tmp_path / "no").exists(), refused.stderr


HOSTILE = [None, 0, -5, True, 1e308, "", "x", "\u0000", [], {}, [None], [[1]], [{}], {"a": None}, ["A"] * 3,
           {"unit_tests": {"inputs": [1], "outputs": [2]}}, {"unit_tests": {"packed": 5}}, [{"A": 1}, {"B": []}]]


@pytest.mark.parametrize("field", ["expected_answer", "options", "verifier_metadata", "instruction_id_list",
                                   "kwargs", "responses_create_params", "question"])
def test_hostile_row_fields_are_row_errors_or_tasks_never_crashes(field):
    bases = [MATH, MCQA, CODE_IO, IFEVAL]
    for base in bases:
        for value in HOSTILE:
            try:
                task = task_from_row({**base, field: value})
            except GymRowError:
                continue
            assert isinstance(task, TaskSpec)


# Bodies NeMo Gym's own mcqa server (NVIDIA-NeMo/Gym 07d6b0d, resources_servers/mcqa, run on loopback)
# was sent, its tests' answers and grading modes, with the reward it answered; ours must answer the same.
GYM_OPTIONS = [{"A": "optA"}, {"B": "optB"}, {"C": "optC"}, {"D": "optD"}, {"E": "optE"}]
GYM_MCQA = [
    ("The answer is C.", "C", {}, 0.0),  # no grading_mode: strict_single_letter_boxed, Gym's default
    ("I think the answer is B.\n\nAnswer: B", "B", {"grading_mode": "strict_single_letter_boxed"}, 0.0),
    ("(B)", "B", {}, 0.0),
    ("Final: \\boxed{ [C] }", "C", {}, 1.0),
    ("\\boxed{\nC: optC is the one\n}", "C", {}, 1.0),
    ("Final: \\boxed{ optC }", "C", {}, 0.0),
    ("Final: \\boxed{ optC }", "C", {"grading_mode": "lenient_boxed"}, 1.0),
    ("\\boxed{\\text{E}}", "E", {"grading_mode": "lenient_boxed"}, 1.0),
    ("\\boxed{B", "B", {}, 0.0),
    ("Answer: c", "C", {"grading_mode": "lenient_answer_colon"}, 1.0),
    ("Answer: optC", "C", {"grading_mode": "lenient_answer_colon"}, 1.0),
    ("Option Selected: B", "B", {"template_metadata": {"output_regex": "Option Selected:\\s*([A-Za-z])"}}, 1.0),
    ("ANSWER IS b", "B", {"template_metadata": {"output_regex": "ANSWER IS\\s*([A-Za-z])"}}, 1.0),
    ("Maybe Answer: A? Let me reconsider. Final Answer: B", "B",
     {"template_metadata": {"output_regex": "Answer:\\s*([A-Za-z])"}}, 1.0),
    ("Antwort: B", "B", {"template_metadata": {"output_regex": ["Answer\\s*:\\s*([A-Za-z])",
                                                                 "Antwort\\s*:\\s*([A-Za-z])"]}}, 1.0),
    ("Answer: \\boxed{{B}}", "B", {"template_metadata": {"output_regex": "Final Choice:\\s*([A-Z])"}}, 1.0),
]


def test_mcqa_rows_are_graded_as_gyms_own_mcqa_server_grades_them(server):
    """An mcqa row's grading_mode (strict boxed letter unless it says otherwise) and its
    template_metadata patterns decide where the pick is read, as in Gym's server: an unboxed
    "The answer is C." is no answer there, so 0 here too."""
    for text, expected, extra, gym_reward in GYM_MCQA:
        sent = {"responses_create_params": {"input": [{"role": "user", "content": "Q?"}]},
                "response": response(message(text)), "options": GYM_OPTIONS, "expected_answer": expected, **extra}
        answered = post(server.url, "/verify", sent)
        assert answered.status_code == 200, answered.text
        assert answered.json()["reward"] == gym_reward, (text, extra, answered.json()["verification"])


def test_a_gym_agents_seed_body_seeds_the_rows_task(server):
    """Gym's simple_agent sends its whole run request (the dataset row, its Responses params dumped
    with their nulls) to /seed_session, then /verify in that session; we refused it (422) before
    NeMo Gym's own agent was run against us."""
    gym_params = {"input": [{"role": "user", "content": "Capital of France? A) Lyon B) Paris", "type": "message"}],
                  "background": None, "include": None, "instructions": None, "max_output_tokens": 16,
                  "metadata": None, "model": None, "parallel_tool_calls": True, "tool_choice": "auto",
                  "tools": [], "temperature": 0.0}
    seed_body = {"responses_create_params": gym_params, "options": [{"A": "Lyon"}, {"B": "Paris"}],
                 "expected_answer": "B", "grading_mode": "strict_single_letter_boxed", "uuid": "seed-1"}
    seeded = post(server.url, "/seed_session", seed_body)
    assert seeded.status_code == 200, seeded.text
    session = seeded.json()["session_id"]
    assert httpx.get(server.url + "/session", headers={"x-rollmarket-session": session}).json()["task_id"] == \
        "gym-seed-1"
    # /verify with no row fields and no task: the session's task (from the seed row) scores it.
    for text, reward in (("\\boxed{B}", 1.0), ("The answer is B.", 0.0)):
        bare = {"responses_create_params": gym_params, "response": response(message(text))}
        assert post(server.url, "/verify", bare, session=session).json()["reward"] == reward
    # A seed with no row fields opens a session with no task; a row that does not fit opens none.
    assert post(server.url, "/seed_session", {"responses_create_params": gym_params}).status_code == 200
    before = server.healthz()["sessions"]
    error = assert_error(post(server.url, "/seed_session", {**seed_body, "expected_answer": "Q"}), 422,
                         "invalid_request")
    assert "expected_answer" in error["message"] and server.healthz()["sessions"] == before


class _GymLikeResources(BaseHTTPRequestHandler):
    """Answers as a NeMo Gym resources server does: /seed_session is `{}` (Gym keeps the session in
    its own cookie), /verify a Gym verify response, not a VerifyResult."""

    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("content-length", 0)))
        answer = {} if self.path == "/seed_session" else {"responses_create_params": {"input": []}, "reward": 1.0}
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_a_gym_resources_server_behind_our_client_is_a_typed_error():
    """Our agent server pointed at NeMo Gym's own mcqa server crashed (500, KeyError 'session_id'):
    the client now says which server answered what, as a ResourcesError (the agent server's 502)."""
    stub = ThreadingHTTPServer(("127.0.0.1", 0), _GymLikeResources)
    Thread(target=stub.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{stub.server_address[1]}"
    try:
        with pytest.raises(ResourcesError, match="without a session_id") as seeded:
            ResourcesClient(url).seed_session()
        assert seeded.value.status is None
        with pytest.raises(ResourcesError, match="answered no VerifyResult"):
            ResourcesClient(url).verify(None, "B")
    finally:
        stub.shutdown()
        stub.server_close()
