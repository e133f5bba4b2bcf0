"""The verifier families of issue 19: code (in the python_eval sandbox), llm_judge (against a loopback
stub and a real `rollmarket serve-model`), multiple_choice, instructions and math_verify.

Expected values are written out by hand from the task, never taken from the verifier's output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from helpers import ServiceProcess, rollmarket_command, served_model

from rollmarket.contracts import TaskSpec
from rollmarket.localhost import free_port
from rollmarket.verifiers import VERIFIERS, ResourcesClient, ResourcesError, VerifierConfigError, get_verifier, verify

REPO = Path(__file__).resolve().parent.parent
MOE = REPO / "models" / "tiny-moe"


def task(verifier: str, answer=None, prompt: str = "q", **args) -> TaskSpec:
    return TaskSpec(task_id="t1", prompt=prompt, verifier=verifier, answer=answer, verifier_args=args)


def test_families_are_registered_where_the_server_finds_them():
    for name in ("code", "llm_judge", "multiple_choice", "instructions", "math_verify"):
        assert name in VERIFIERS and get_verifier(name).name == name


# -- multiple choice ---------------------------------------------------------------------------

OPTIONS = ["Paris", "Lyon", "Nice", "New Paris"]


@pytest.mark.parametrize("answer, reward, failure", [
    ("B", 1.0, None),
    ("(b)", 1.0, None),
    ("The answer is (B).", 1.0, None),
    ("I think A is tempting, but answer: B", 1.0, None),
    ("\\boxed{Lyon}", 1.0, None),
    ("It must be Lyon, the silk city.", 1.0, None),
    ("A", 0.0, "wrong"),
    ("Paris", 0.0, "wrong"),
    ("Either (A) or (B).", 0.0, "ambiguous"),
    ("Paris or Lyon", 0.0, "ambiguous"),
    ("F", 0.0, "out_of_range"),
    ("The answer is a guess, I think.", 0.0, "no_choice"),
    ("Answer: D. Not (E)", 0.0, "wrong"),
    ("no idea", 0.0, "no_choice"),
    ("   ", 0.0, "no_answer"),
])
def test_multiple_choice_reads_letters_and_texts(answer, reward, failure):
    got = verify(task("multiple_choice", "B", options=OPTIONS), answer)
    assert got.reward == reward, got.info
    assert got.info.get("failure") == failure


def test_multiple_choice_expected_as_text_and_bad_config():
    assert verify(task("multiple_choice", "Nice", options=OPTIONS), "C").passed
    with pytest.raises(VerifierConfigError):
        verify(task("multiple_choice", "Marseille", options=OPTIONS), "A")
    with pytest.raises(VerifierConfigError):
        verify(task("multiple_choice", "E", options=OPTIONS), "A")
    with pytest.raises(VerifierConfigError):
        verify(task("multiple_choice", "A", options=["only one"]), "A")


# -- instructions ------------------------------------------------------------------------------

def test_instructions_score_each_constraint():
    constraints = [{"kind": "words", "min": 5, "max": 12}, {"kind": "bullets", "min": 2, "max": 2},
                   {"kind": "keywords", "include": ["river"], "exclude": ["ocean"]}, {"kind": "case", "value": "lower"},
                   {"kind": "no_commas"}]
    spec = task("instructions", constraints=constraints)
    good = "- the river runs\n- past the town today"
    result = verify(spec, good)
    assert (result.reward, result.passed) == (1.0, True), result.info
    # Broken: 3 bullets, an excluded word, a capital letter and a comma; words (11) still in range.
    bad = "- The river\n- meets the ocean,\n- at last"
    result = verify(spec, bad)
    assert result.components == {"0:words": 1.0, "1:bullets": 0.0, "2:keywords": 0.0, "3:case": 0.0,
                                 "4:no_commas": 0.0}
    assert result.reward == pytest.approx(1 / 5) and not result.passed
    assert result.info["failure"] == "constraints_broken" and len(result.info["broken"]) == 4


@pytest.mark.parametrize("constraint, answer, kept", [
    ({"kind": "json"}, '{"a": [1, 2]}', True),
    ({"kind": "json"}, '```json\n{"a": 1}\n```', True),
    ({"kind": "json"}, '{"a": 1', False),
    ({"kind": "sentences", "min": 3}, "One. Two! Three?", True),
    ({"kind": "sentences", "max": 1}, "One. Two.", False),
    ({"kind": "paragraphs", "min": 2, "max": 2}, "a\n\nb", True),
    ({"kind": "case", "value": "upper"}, "LOUD 123", True),
    ({"kind": "starts_with", "value": "Dear"}, "  Dear Sir", True),
    ({"kind": "ends_with", "value": "Thanks."}, "Bye.", False),
    ({"kind": "keywords", "include": ["cat"], "min_count": 2}, "cat category cat", True),
    ({"kind": "keywords", "include": ["cat"], "min_count": 2}, "cat category", False),
])
def test_instruction_kinds(constraint, answer, kept):
    assert verify(task("instructions", constraints=[constraint]), answer).passed is kept


def test_instructions_threshold_and_bad_config():
    spec = task("instructions", constraints=[{"kind": "words", "max": 3}, {"kind": "no_commas"}], **{"pass": 0.5})
    assert verify(spec, "a, b").passed and verify(spec, "a, b").reward == 0.5
    for bad in ([{"kind": "words"}], [{"kind": "words", "min": 5, "max": 1}], [{"kind": "rhymes"}], []):
        with pytest.raises(VerifierConfigError):
            verify(task("instructions", constraints=bad), "x")
    assert verify(task("instructions", constraints=[{"kind": "no_commas"}]), None).info["failure"] == "no_answer"


# -- code, in the sandbox ----------------------------------------------------------------------

ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]


@pytest.mark.parametrize("answer, reward, failure", [
    ("```python\ndef add(a, b):\n    return a + b\n```", 1.0, None),
    ("Here:\n```python\ndef add(a, b):\n    return a - b + 2 * b * (a != 2)\n```", 2 / 3, "tests_failed"),
    ("def add(a, b):\n    return a +", 0.0, "syntax_error"),
    ("raise RuntimeError('boom')", 0.0, "crashed"),
    ("```python\nwhile True:\n    pass\n```", 0.0, "timeout"),
    ("x = bytearray(2 * 1024 ** 3)", 0.0, "resource_limit"),
    ("print('x' * 10 ** 6)", 0.0, "resource_limit"),
    ("import os\nos._exit(0)", 0.0, "no_report"),
    ("import socket\nsocket.create_connection(('127.0.0.1', 1))", 0.0, "crashed"),
    ("", 0.0, "no_code"),
])
def test_code_runs_the_tests_in_the_sandbox(answer, reward, failure):
    limit = 2 if "while True" in answer else 30  # the loop needs the limit; the others must not hit it
    got = verify(task("code", tests=ADD_TESTS, timeout_s=limit, memory_mb=256), answer)
    assert got.reward == pytest.approx(reward), got.info
    assert got.info.get("failure") == failure, got.info


def test_code_reports_each_test_and_keeps_hosts_files(tmp_path):
    canary = tmp_path / "canary"
    answer = f"def add(a, b):\n    open({str(canary)!r}, 'w').write('x')\n    return a + b"
    got = verify(task("code", tests=ADD_TESTS), answer)
    assert got.reward == 0.0 and got.info["failure"] == "tests_failed" and not canary.exists(), got.info
    assert all("not allowed" in r["error"] for r in got.info["results"])
    got = verify(task("code", tests=ADD_TESTS), "def add(a, b):\n    return 3")
    assert [r["ok"] for r in got.info["results"]] == [True, False, False]
    assert got.info["results"][1]["error"].startswith("AssertionError")
    with pytest.raises(VerifierConfigError):
        verify(task("code", tests=["assert ("]), "x = 1")


SUM_IO = [{"stdin": "2 3\n", "stdout": "5\n"}, {"stdin": "10 -4\n", "stdout": "6"}, {"stdin": "0 0", "stdout": "0\n"}]


@pytest.mark.parametrize("answer, oks", [
    ("a, b = map(int, input().split())\nprint(a + b)", [True, True, True]),
    ("import sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b)  \nsys.exit(0)", [True, True, True]),
    ("a, b = map(int, input().split())\nprint(abs(a) + abs(b))", [True, False, True]),
    ("a, b = map(int, input().split())\nif a == 0:\n    raise SystemExit(3)\nprint(a + b)", [True, True, False]),
])
def test_code_stdin_stdout_cases(answer, oks):
    got = verify(task("code", io=SUM_IO), answer)
    assert [r["ok"] for r in got.info["results"]] == oks, got.info
    assert [r["test"] for r in got.info["results"]] == ["io[0]", "io[1]", "io[2]"]
    assert got.reward == pytest.approx(sum(oks) / 3) and got.passed is all(oks)


def test_code_mixes_statements_and_cases():
    answer = "def add(a, b):\n    return a + b\nif __name__ == '__main__':\n    print(add(*map(int, input().split())))"
    got = verify(task("code", tests=ADD_TESTS, io=SUM_IO), answer)
    assert got.passed and len(got.info["results"]) == 6, got.info
    with pytest.raises(VerifierConfigError):
        verify(task("code"), answer)


def test_code_without_a_sandbox_is_unavailable_not_a_crash(tmp_path):
    """Where bubblewrap is missing (PATH without it), the run is refused as `unavailable`, naming the fix."""
    program = ("import json; from rollmarket.contracts import TaskSpec; from rollmarket.verifiers import verify; "
               "t = TaskSpec(task_id='t', prompt='q', verifier='code', verifier_args={'tests': ['assert f() == 1']}); "
               "print(json.dumps(verify(t, 'def f():\\n    return 1').model_dump(mode='json')))")
    env = {k: v for k, v in os.environ.items() if k != "ROLLMARKET_UNSAFE_PYTHON_EVAL"}
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
                          env={**env, "PATH": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["reward"] == 0.0 and got["info"]["failure"] == "unavailable" and "bubblewrap" in got["info"]["why"]


# -- math_verify beside math -------------------------------------------------------------------

@pytest.mark.parametrize("gold, answer, passed, failure", [
    ("\\frac{1}{2}", "So the result is $\\boxed{0.5}$.", True, None),
    ("$x^2+2x+1$", "$\\boxed{(x+1)^2}$", True, None),
    ("$[1, 3)$", "The interval is $\\boxed{[1,3)}$", True, None),
    ("3", "$\\boxed{4}$", False, "not_equal"),
    ("3", "???", False, "unreadable"),
    ("3", None, False, "no_answer"),
])
def test_math_verify(gold, answer, passed, failure):
    got = verify(task("math_verify", gold), answer)
    assert got.passed is passed and got.info.get("failure") == failure, got.info


def test_math_verify_reads_what_math_cannot():
    """An interval: our sympy checker cannot even read it as an expected answer; math-verify compares it."""
    answer = "The set is $\\boxed{[1,3)}$."
    with pytest.raises(VerifierConfigError):
        verify(task("math", "[1, 3)"), answer)
    assert verify(task("math_verify", "$[1, 3)$"), answer).passed
    assert not verify(task("math_verify", "$[1, 3]$"), answer).passed


# -- llm_judge against a loopback stub ---------------------------------------------------------

class JudgeStub:
    """A real HTTP server on loopback speaking chat completions: it fails the first `fail` requests
    with `status`, then answers `reply`; it keeps every request body."""

    def __init__(self, reply: str = "VERDICT: CORRECT", fail: int = 0, status: int = 503):
        self.reply, self.fail, self.status, self.requests = reply, fail, status, []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.requests.append(body)
                if len(stub.requests) <= stub.fail:
                    payload, code = {"error": {"message": "try later"}}, stub.status
                else:
                    payload, code = {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                                     "choices": [{"index": 0, "finish_reason": "stop",
                                                  "message": {"role": "assistant", "content": stub.reply}}]}, 200
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub():
    made = []

    def make(**kwargs) -> JudgeStub:
        made.append(JudgeStub(**kwargs))
        return made[-1]

    yield make
    for s in made:
        s.close()


def judge_task(url: str, **args) -> TaskSpec:
    return TaskSpec(task_id="j1", prompt="What is 2+2?", verifier="llm_judge", answer="4",
                    verifier_args={"base_url": url, "model": "judge", "backoff_s": 0.01, **args})


def test_judge_keeps_prompt_and_raw_answer(stub):
    judge = stub(reply="Reasoning...\nVERDICT: CORRECT")
    got = verify(judge_task(judge.url), "four")
    assert got.passed and got.reward == 1.0
    sent = judge.requests[0]["messages"][0]["content"]
    assert "What is 2+2?" in sent and "four" in sent and "Reference answer:\n4" in sent
    assert got.info["judge_prompt"] == sent and got.info["judge_raw"] == "Reasoning...\nVERDICT: CORRECT"
    assert got.info["attempts"] == 1
    assert verify(judge_task(stub(reply="**Verdict:** correct").url), "4").passed
    wrong = verify(judge_task(stub(reply="VERDICT: INCORRECT").url), "five")
    assert wrong.reward == 0.0 and wrong.info["failure"] == "judged_wrong"


def test_judge_retries_with_backoff_then_succeeds(stub):
    judge = stub(fail=2, status=503)
    got = verify(judge_task(judge.url, retries=3), "four")
    assert got.passed and got.info["attempts"] == 3 and len(judge.requests) == 3


def test_judge_failures_are_typed_and_written(stub, tmp_path):
    failures = tmp_path / "failures.jsonl"
    flaky = stub(fail=10, status=503)
    got = verify(judge_task(flaky.url, retries=2, failures_file=str(failures)), "four")
    assert got.info["failure"] == "judge_unreachable" and len(flaky.requests) == 3 and got.info["judge_raw"] is None
    refused = stub(fail=10, status=400)
    got = verify(judge_task(refused.url, retries=2, failures_file=str(failures)), "four")
    assert got.info["failure"] == "judge_error" and len(refused.requests) == 1
    chatty = stub(reply="I think it is fine.")
    got = verify(judge_task(chatty.url, failures_file=str(failures)), "four")
    assert got.info["failure"] == "unparseable" and got.info["judge_raw"] == "I think it is fine."
    lines = [json.loads(line) for line in failures.read_text().splitlines()]
    assert [line["failure"] for line in lines] == ["judge_unreachable", "judge_error", "unparseable"]
    assert lines[2]["judge_raw"] == "I think it is fine." and "What is 2+2?" in lines[2]["judge_prompt"]


def test_judge_numeric_verdicts_and_bad_config(stub):
    judge = stub(reply="Score: 0.75")
    got = verify(judge_task(judge.url, pattern=r"Score:\s*([0-9.]+)", verdicts={}, pass_threshold=0.7), "four")
    assert got.reward == 0.75 and got.passed
    with pytest.raises(VerifierConfigError):
        verify(judge_task(judge.url, pattern="no group"), "four")
    with pytest.raises(VerifierConfigError):
        verify(judge_task(judge.url, prompt="{unknown}"), "four")
    assert judge.requests == [judge.requests[0]]  # bad configs sent nothing


def test_judge_endpoint_down_is_unreachable():
    got = verify(judge_task(f"http://127.0.0.1:{free_port()}/v1", retries=1), "four")
    assert got.info["failure"] == "judge_unreachable" and got.info["attempts"] == 2


# -- llm_judge against our own model server ----------------------------------------------------

def test_judge_against_serve_model(tmp_path):
    """A real `rollmarket serve-model` (the tiny random MoE) as the judge: its reply is kept raw,
    and since a random model does not write the verdict line, the parse fails as a typed failure."""
    assert (MOE / "config.json").exists(), "the shipped tiny-moe model is missing"
    failures = tmp_path / "failures.jsonl"
    with served_model(MOE, tmp_path / "serve.log") as url:
        model = httpx.get(url + "/models").json()["data"][0]["id"]
        spec = judge_task(url, model=model, max_tokens=8, failures_file=str(failures),
                          pattern=r"VERDICT:\s*(CORRECT|INCORRECT)")
        got = verify(spec, "four")
    assert got.info["attempts"] == 1 and isinstance(got.info["judge_raw"], str) and got.info["judge_raw"]
    assert "VERDICT:" not in got.info["judge_raw"] and got.info["failure"] == "unparseable", got.info
    assert got.info["judge_model"] == model and "What is 2+2?" in got.info["judge_prompt"]
    assert json.loads(failures.read_text().splitlines()[0])["judge_raw"] == got.info["judge_raw"]


# -- the families over HTTP: `rollmarket verifier serve` finds them ----------------------------

def test_families_through_the_resources_server(tmp_path, stub):
    judge, elsewhere = stub(reply="VERDICT: INCORRECT"), stub()
    port = free_port()
    server = ServiceProcess(rollmarket_command("verifier", "serve", "--port", str(port), "--log-level", "warning",
                                               "--judge-urls", f"http://127.0.0.1:1/v1, {judge.url}/"),
                            tmp_path / "resources.log", port).start(60)
    hidden = {"verifier": "llm_judge", "args": {"base_url": elsewhere.url, "model": "judge"}}
    refused = [judge_task(elsewhere.url),  # a judge the operator did not allow
               judge_task(judge.url, failures_file=str(tmp_path / "f.jsonl")),  # a file the task picks
               task("compound", components=[{"name": "a", "verifier": "exact"},
                                            {"name": "b", "verifier": "compound", "args": {"components": [hidden]}}])]
    try:
        with ResourcesClient(server.url) as client:
            hang = client.verify(task("code", tests=ADD_TESTS, timeout_s=2), "while True:\n    pass")
            good = client.verify(task("code", tests=ADD_TESTS), "def add(a, b):\n    return a + b")
            choice = client.verify(task("multiple_choice", "B", options=OPTIONS), "(A) or (C)")
            shaped = client.verify(task("instructions", constraints=[{"kind": "words", "max": 2}]), "one two three")
            judged = client.verify(judge_task(judge.url), "five")
            with pytest.raises(ResourcesError, match="options"):
                client.verify(task("multiple_choice", "B"), "B")
            for spec in refused:
                with pytest.raises(ResourcesError, match="llm_judge"):
                    client.verify(spec, "five")
    finally:
        server.stop()
    assert (hang.reward, hang.info["failure"]) == (0.0, "timeout")
    assert good.passed and [r["ok"] for r in good.info["results"]] == [True, True, True]
    assert choice.info["failure"] == "ambiguous" and choice.info["candidates"] == ["A", "C"]
    assert shaped.components == {"0:words": 0.0}
    assert judged.info["failure"] == "judged_wrong" and judged.info["judge_raw"] == "VERDICT: INCORRECT"
    assert len(judge.requests) == 1 and elsewhere.requests == [] and not (tmp_path / "f.jsonl").exists()


def test_resources_server_refuses_judges_unless_allowed():
    from fastapi.testclient import TestClient

    from rollmarket.verifiers import create_resources_app

    body = {"task": judge_task("http://127.0.0.1:9/v1").model_dump(mode="json"), "answer": "four"}
    with TestClient(create_resources_app()) as client:
        answer = client.post("/verify", json=body)
    assert answer.status_code == 422 and "--judge-urls" in answer.text
