"""Verifiers in-process and the pass@k / majority@k profile.

Covers every built-in verifier's edge cases (a bad answer is reward 0 with a `why`, never an
exception; a bad task configuration is a VerifierConfigError), verify_trajectory, the hostile
inputs the math verifier must not run, and hand-computed pass@k and majority@k values. The
formula tests lock the estimators: do not "fix" one without a decision.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from itertools import combinations
from pathlib import Path

import pytest

from rollmarket.contracts import (
    AgentStep,
    AgentTrajectory,
    TaskSpec,
    TerminalReason,
    ToolCallRecord,
    ToolOutcome,
    ToolResult,
    VerifyResult,
)
from rollmarket.verifiers import (
    VERIFIERS,
    VerifierConfigError,
    get_verifier,
    majority_at_k,
    pass_at_k,
    profile_rollouts,
    read_rollouts,
    verify,
    verify_trajectory,
)


def task(verifier: str, answer=None, tools=(), **args) -> TaskSpec:
    return TaskSpec(task_id="t-1", prompt="?", verifier=verifier, answer=answer, tools=list(tools),
                    verifier_args=args)


def call(name: str, arguments: dict | None = None, outcome: ToolOutcome = ToolOutcome.ok, raw: str | None = None):
    return ToolCallRecord(id=f"c-{name}", name=name, raw_arguments=raw if raw is not None else json.dumps(arguments or {}),
                          arguments=arguments if raw is None else None,
                          result=ToolResult(name=name, content="x", outcome=outcome))


def zero_with_why(result: VerifyResult) -> bool:
    return result.reward == 0 and not result.passed and bool(result.info.get("why"))


def test_every_named_verifier_is_registered():
    assert set(VERIFIERS) == {"exact", "numeric", "math", "json_schema", "tool_use", "compound", "code", "llm_judge",
                              "multiple_choice", "instructions", "math_verify"}


def test_unknown_verifier_and_bad_args_are_config_errors():
    with pytest.raises(VerifierConfigError, match="unknown verifier 'nope'"):
        verify(task("nope", "1"), "1")
    with pytest.raises(VerifierConfigError, match="rel_tol"):
        verify(task("numeric", "1", rel_tol=-1), "1")
    with pytest.raises(VerifierConfigError, match="bad args"):
        verify(task("numeric", "1", tolerance=0.1), "1")  # unknown key
    with pytest.raises(VerifierConfigError, match="not a finite number"):
        verify(task("numeric", "about seven"), "7")
    with pytest.raises(VerifierConfigError):
        get_verifier("numeric").verify(task("numeric", "1"), "1", args=["not", "a", "mapping"])  # type: ignore[arg-type]
    assert issubclass(VerifierConfigError, ValueError)


# -- numeric -----------------------------------------------------------------------------------

@pytest.mark.parametrize("answer", ["391", "391.", "391.0", "The answer is 391.", "\\boxed{391}", "3.91e2",
                                    "$391$", "first 17*23, so: 391"])
def test_numeric_reads_the_same_number(answer):
    result = verify(task("numeric", "391"), answer)
    assert result.reward == 1 and result.passed
    assert result.info["canonical"] == "391" and result.info["expected"] == "391"


@pytest.mark.parametrize("answer,expected", [("1,234", 1234), ("It costs 1,234,567.5 coins", 1234567.5),
                                             ("-5", -5), ("it is -0.25", -0.25), ("3/4", 0.75), (".5", 0.5)])
def test_numeric_commas_negatives_and_fractions(answer, expected):
    assert verify(task("numeric", expected), answer).passed


def test_numeric_tolerance_boundaries():
    loose = task("numeric", 100, rel_tol=0.01)
    assert verify(loose, "101").passed          # |1| <= 0.01 * 101
    assert verify(loose, "99").passed           # |1| <= 0.01 * 100
    assert not verify(loose, "101.5").passed
    default = task("numeric", 1.0)
    assert verify(default, "1.0000009").passed  # rel 9e-7 < 1e-6
    assert not verify(default, "1.000002").passed
    near_zero = task("numeric", 0, abs_tol=1e-3)
    assert verify(near_zero, "0.0009").passed and not verify(near_zero, "0.002").passed
    assert verify(task("numeric", 0), "-0").info["canonical"] == "0"


@pytest.mark.parametrize("answer,why", [(None, "no answer"), ("", "empty answer"), ("   ", "empty answer"),
                                        ("no idea", "no number"), ("nan", "no number"), ("inf", "no number"),
                                        ("1" * 400, "no number")])
def test_numeric_bad_answers_score_zero(answer, why):
    result = verify(task("numeric", 1), answer)
    assert zero_with_why(result) and why in result.info["why"]


def test_a_huge_answer_is_not_read():
    started = time.perf_counter()
    for name, expected in [("numeric", "1"), ("exact", "a"), ("math", "1"), ("json_schema", None)]:
        args = {"schema": {"type": "object"}} if name == "json_schema" else {}
        result = verify(task(name, expected, **args), "1 " * 100_000)
        assert zero_with_why(result) and "too long" in result.info["why"], name
    assert verify(task("numeric", "1", max_answer_chars=10), "x" * 11).info["why"].startswith("answer too long")
    assert time.perf_counter() - started < 2


def test_wrong_number_names_the_difference():
    result = verify(task("numeric", "391"), "390")
    assert zero_with_why(result) and result.info["canonical"] == "390" and result.info["abs_error"] == 1


# -- exact -------------------------------------------------------------------------------------

def test_exact_normalizes_case_space_and_punctuation():
    t = task("exact", "New York")
    assert verify(t, '  "new   york."  ').passed
    assert verify(t, "\\boxed{New York}").passed
    assert not verify(t, "New York City").passed
    assert not verify(task("exact", "New York", case_sensitive=True), "new york").passed
    assert verify(task("exact", "New York", case_sensitive=True), "New York.").passed


def test_exact_aliases_and_lists():
    t = task("exact", "NYC", aliases=["New York", "New York City"])
    assert verify(t, "new york city").passed and verify(t, "nyc").passed
    assert verify(task("exact", ["a", "b"]), "B").passed
    result = verify(t, "Boston")
    assert zero_with_why(result) and result.info["canonical"] == "boston"


def test_exact_bad_answers_and_config():
    assert zero_with_why(verify(task("exact", "x"), None))
    assert zero_with_why(verify(task("exact", "x"), "..."))
    with pytest.raises(VerifierConfigError):
        verify(task("exact", None), "x")
    with pytest.raises(VerifierConfigError):
        verify(task("exact", {"not": "text"}), "x")


# -- math --------------------------------------------------------------------------------------

@pytest.mark.parametrize("expected,answer", [
    ("1/2", "0.5"), ("0.5", "1/2"), ("(x-1)*(x+1)", "x**2-1"), ("2*sqrt(2)", "sqrt(8)"), ("2*x+1", "1+2x"),
    ("x^2", "x**2"), ("1", "sin(x)**2 + cos(x)**2"), ("1/2", "\\boxed{\\frac{1}{2}}"), ("1/2", "$\\dfrac12$"),
    ("pi/2", "\\frac{\\pi}{2}"), ("sqrt(3)/3", "1/sqrt(3)"), ("6", "3!"), ("x = 4", "4"), ("e**2", "exp(2)"),
    ("2", "\\sqrt[3]{8}"), ("3", "so the answer is 3."), ("1/3", "\\left(\\frac{1}{3}\\right)"),
])
def test_math_equivalent(expected, answer):
    result = verify(task("math", expected), answer)
    assert result.reward == 1 and result.passed, result.info


@pytest.mark.parametrize("expected,answer", [
    ("1/2", "1/3"), ("1/3", "0.333333"), ("x**2-1", "(x-1)**2"), ("2*sqrt(2)", "sqrt(6)"), ("x", "sqrt(x**2)"),
    ("x", "y"), ("x", "abs(x)"), ("2*x+1", "2x"),
])
def test_math_not_equivalent(expected, answer):
    result = verify(task("math", expected), answer)
    assert zero_with_why(result), result.info


def test_math_canonical_keys_group_equal_answers():
    keys = {verify(task("math", "1/2"), a).info["canonical"] for a in ["0.5", "1/2", "\\frac{2}{4}", "2/4"]}
    assert keys == {"0.5"}
    assert verify(task("math", "2x+1"), "1+2x").info["canonical"] == verify(task("math", "2x+1"), "2*x+1").info["canonical"]


@pytest.mark.parametrize("answer", [
    "__import__('os').system('echo hi')", "().__class__.__bases__[0].__subclasses__()", "x.__class__",
    "lambda: 1", "open('/etc/passwd').read()", "exec(1)", "Symbol('x')", "Pow(9, Pow(9, 9))", "x if 1 else 2",
    "9**9**9", "2**(10**10)", "(10**100)**(10**3)", "100000!", "factorial(10**6)", "x" + "+x" * 500, "{1: 2}",
    "\\unknowncommand{1}", "\\frac{1}", "[1, 2]", "1; 2",
])
def test_math_hostile_answers_score_zero_fast_and_run_nothing(answer, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    started = time.perf_counter()
    result = verify(task("math", "42"), answer)
    assert zero_with_why(result), result.info
    assert time.perf_counter() - started < 2
    assert list(tmp_path.iterdir()) == []


def test_math_hostile_answer_prints_nothing_in_a_fresh_process():
    """The classic os.system payload, in a process of its own, writes nothing to stdout."""
    code = ("from rollmarket.contracts import TaskSpec\nfrom rollmarket.verifiers import verify\n"
            "t = TaskSpec(task_id='t', prompt='?', verifier='math', answer='1')\n"
            "r = verify(t, \"__import__('os').system('echo hi')\")\nimport sys\n"
            "sys.stderr.write(repr(r.reward))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr.endswith("0.0")


def test_math_simplify_stage_runs_in_a_child_with_a_time_limit():
    equal = verify(task("math", "1", samples=0), "sin(x)**2 + cos(x)**2")
    assert equal.passed and equal.info["stage"] == "simplify"
    different = verify(task("math", "1", samples=0), "sin(x)**2")
    assert zero_with_why(different) and different.info["stage"] == "simplify"
    # equal, but simplify needs seconds (and still fails to show it): numeric sampling is what decides
    expected = "+".join(f"sin({i}*x)**{i % 3 + 2}*cos({i + 1}*x)**{i % 2 + 2}" for i in range(1, 8))
    answer = "+".join(f"(2*sin({i}*x/2)*cos({i}*x/2))**{i % 3 + 2}*cos({i + 1}*x)**{i % 2 + 2}" for i in range(1, 8))
    assert verify(task("math", expected), answer).info["stage"] == "numeric"
    started = time.perf_counter()
    slow = verify(task("math", expected, samples=0, time_limit_s=0.3), answer)
    assert time.perf_counter() - started < 10
    assert slow.reward == 0 and "timed out" in slow.info["why"]
    assert verify(task("math", "1", samples=0), "cos(x)**2 + sin(x)**2").passed  # a fresh child after the kill


def test_math_config_and_empty():
    with pytest.raises(VerifierConfigError, match="cannot read the expected"):
        verify(task("math", "__import__('os')"), "1")
    with pytest.raises(VerifierConfigError):
        verify(task("math", None), "1")
    assert zero_with_why(verify(task("math", "1"), None))
    assert zero_with_why(verify(task("math", "1"), ""))
    assert zero_with_why(verify(task("math", "1"), "x" * 600))  # past max_chars


# -- json_schema -------------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
          "required": ["city", "population"], "additionalProperties": False}


def test_json_schema_valid_whole_fenced_and_embedded():
    t = task("json_schema", schema=SCHEMA)
    for answer, where in [('{"city": "Oslo", "population": 700000}', "whole"),
                          ('Here:\n```json\n{"city": "Oslo", "population": 7}\n```\nDone.', "fence"),
                          ('The result is {"population": 7, "city": "Oslo"} as asked.', "embedded")]:
        result = verify(t, answer)
        assert result.passed and result.reward == 1 and result.components == {"valid": 1.0, "fields": 1.0}, answer
        assert result.info["found_in"] == where
    assert verify(t, '{"population": 7, "city": "Oslo"}').info["canonical"] == '{"city":"Oslo","population":7}'


def test_json_schema_invalid_and_not_json():
    t = task("json_schema", schema=SCHEMA)
    invalid = verify(t, '{"city": "Oslo", "population": "many"}')
    assert zero_with_why(invalid) and invalid.components["valid"] == 0 and "population" in invalid.info["why"]
    for answer in ['{"city": "Oslo", "population": NaN}', "{'city': 'Oslo'}", "not json at all", "{" * 5000,
                   "[" * 100_000, None, ""]:
        result = verify(t, answer)
        assert zero_with_why(result), answer


def test_json_schema_expected_fields():
    t = task("json_schema", {"city": "Oslo", "population": 7}, schema=SCHEMA)
    assert verify(t, '{"city": "Oslo", "population": 7}').passed
    wrong = verify(t, '{"city": "Bergen", "population": 7}')
    assert zero_with_why(wrong) and wrong.components == {"valid": 1.0, "fields": 0.5}
    assert wrong.info["mismatched_fields"] == ["city"]
    partial = verify(task("json_schema", schema=SCHEMA, expected={"city": "Oslo", "population": 7}, partial_credit=True),
                     '{"city": "Bergen", "population": 7.0}')
    assert partial.reward == 0.5 and not partial.passed


def test_json_schema_bad_schema_is_a_config_error():
    with pytest.raises(VerifierConfigError, match="not a valid JSON Schema"):
        verify(task("json_schema", schema={"type": "no-such-type"}), "{}")
    with pytest.raises(VerifierConfigError):
        verify(task("json_schema"), "{}")  # no schema


# -- tool_use ----------------------------------------------------------------------------------

def test_tool_use_required_forbidden_and_failures():
    t = task("tool_use", tools=["calculator", "read_file"], required=["calculator"], forbidden=["web_search"])
    good = verify(t, "391", tool_calls=[call("calculator", {"expression": "17*23"})])
    assert good.passed and good.reward == 1
    assert good.components == {"required_called": 1.0, "no_forbidden": 1.0, "no_failed_calls": 1.0}
    none = verify(t, "391")
    assert not none.passed and none.components["required_called"] == 0 and none.reward == pytest.approx(2 / 3)
    failed = verify(t, "x", tool_calls=[call("calculator", {"expression": "1/0"}, ToolOutcome.error),
                                        call("calculator", {"expression": "1"})])
    assert failed.components["no_failed_calls"] == 0.5 and failed.components["required_called"] == 1
    forbidden = verify(t, "x", tool_calls=[call("calculator", {"expression": "1"}), call("web_search", {"query": "q"})])
    assert forbidden.components["no_forbidden"] == 0 and "web_search" in forbidden.info["why"]
    offered_only = verify(task("tool_use", tools=["calculator"]), "x", tool_calls=[call("python_eval", {"code": "1"})])
    assert offered_only.components["no_forbidden"] == 0


def test_tool_use_expected_calls_order_max_calls_and_reduce():
    expected = [{"name": "read_file", "arguments": {"path": "a.txt"}},
                {"name": "calculator", "arguments": {"expression": "2 * 3"}}]
    calls = [call("calculator", {"expression": "2*3"}), call("read_file", {"path": "A.TXT"})]
    unordered = verify(task("tool_use", expected_calls=expected), "6", tool_calls=calls)
    assert unordered.components["arguments_match"] == 1 and unordered.info["matched_calls"] == [1, 0]
    ordered = verify(task("tool_use", expected_calls=expected, order_matters=True), "6", tool_calls=calls)
    assert ordered.components["arguments_match"] == 0.5
    strict = verify(task("tool_use", expected_calls=expected, argument_match="exact"), "6", tool_calls=calls)
    assert strict.components["arguments_match"] == 0
    bad_json = verify(task("tool_use", expected_calls=expected[:1]), "", tool_calls=[call("read_file", raw="{oops")])
    assert bad_json.components["arguments_match"] == 0
    capped = verify(task("tool_use", max_calls=1, reduce="product"), "6", tool_calls=calls)
    assert capped.components["within_max_calls"] == 0 and capped.reward == 0
    minimum = verify(task("tool_use", required=["calculator", "read_file"], reduce="min", count_failed=False), "",
                     tool_calls=calls[:1])
    assert minimum.reward == 0.5


def test_tool_use_config():
    with pytest.raises(VerifierConfigError, match="nothing to check"):
        verify(task("tool_use", count_failed=False), "x")
    with pytest.raises(VerifierConfigError):
        verify(task("tool_use", expected_calls=[{"arguments": {}}]), "x")


# -- compound ----------------------------------------------------------------------------------

def compound_task(pass_rule="all", answer=391):
    return task("compound", answer, tools=["calculator"], components=[
        {"name": "answer", "verifier": "numeric", "weight": 0.8},
        {"name": "tools", "verifier": "tool_use", "weight": 0.2, "args": {"required": ["calculator"]}},
    ], **{"pass": pass_rule})


def test_compound_weights_components_and_nested_info():
    calc = [call("calculator", {"expression": "17*23"})]
    both = verify(compound_task(), "391", tool_calls=calc)
    assert both.reward == 1 and both.passed and both.components == {"answer": 1.0, "tools": 1.0}
    no_tools = verify(compound_task(), "391")
    # tools: required_called 0, no_forbidden 1, no_failed_calls 1 -> 2/3
    assert no_tools.reward == pytest.approx(0.8 + 0.2 * 2 / 3) and not no_tools.passed
    assert no_tools.info["parts"]["tools"]["components"]["required_called"] == 0
    assert no_tools.info["canonical"] == "391"  # from the answer part, not tool_use
    wrong = verify(compound_task(), "390", tool_calls=calc)
    assert wrong.reward == pytest.approx(0.2) and "answer:" in wrong.info["why"]
    assert verify(compound_task("answer"), "391").passed
    assert not verify(compound_task("answer"), "390", tool_calls=calc).passed
    assert verify(compound_task(0.85), "391").passed and not verify(compound_task(0.95), "391").passed


def test_compound_config_errors():
    with pytest.raises(VerifierConfigError, match="unique"):
        verify(task("compound", 1, components=[{"name": "a", "verifier": "numeric"}] * 2), "1")
    with pytest.raises(VerifierConfigError, match="unknown verifier"):
        verify(task("compound", 1, components=[{"name": "a", "verifier": "nope"}]), "1")
    with pytest.raises(VerifierConfigError, match="component 'a'"):
        verify(task("compound", 1, components=[{"name": "a", "verifier": "numeric", "args": {"rel_tol": "x"}}]), "1")
    with pytest.raises(VerifierConfigError):
        verify(task("compound", 1, components=[{"name": "a", "verifier": "numeric", "weight": 0}]), "1")
    with pytest.raises(VerifierConfigError):
        verify(task("compound", 1, components=[{"name": "a", "verifier": "numeric"}], **{"pass": "b"}), "1")


# -- trajectories ------------------------------------------------------------------------------

def run(answer: str | None, reason=TerminalReason.final_answer, calls=(), task_id="t-1", index=0,
        verification: VerifyResult | None = None) -> AgentTrajectory:
    steps = [AgentStep(index=0, tool_calls=list(calls), finish_reason="tool_calls")] if calls else []
    return AgentTrajectory(task_id=task_id, sample_index=index, messages=[{"role": "user", "content": "?"}],
                           steps=steps, final_answer=answer, terminal_reason=reason, verification=verification)


def test_verify_trajectory_uses_final_answer_and_tool_calls():
    calc = [call("calculator", {"expression": "17*23"})]
    assert verify_trajectory(compound_task(), run("391", calls=calc)).reward == 1
    unfinished = verify_trajectory(task("numeric", 391), run(None, TerminalReason.max_steps, calc))
    assert zero_with_why(unfinished) and "max_steps" in unfinished.info["why"]
    # tool_use (and a compound with a tool_use part) still scores a run without a final answer
    assert verify_trajectory(task("tool_use", required=["calculator"]), run(None, TerminalReason.length, calc)).passed
    partial = verify_trajectory(compound_task(), run(None, TerminalReason.max_steps, calc))
    assert partial.reward == pytest.approx(0.2) and not partial.passed
    with pytest.raises(VerifierConfigError):
        verify_trajectory(task("nope", 1), run("1", TerminalReason.max_steps))


# -- pass@k and majority@k ---------------------------------------------------------------------

def brute_pass_at_k(n: int, c: int, k: int) -> float:
    draws = list(combinations([True] * c + [False] * (n - c), k))
    return sum(any(d) for d in draws) / len(draws)


def test_pass_at_k_hand_values():
    """Locks the unbiased estimator 1 - C(n-c, k)/C(n, k): do not "fix" without a decision."""
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 4) == 1.0                      # C(3,4) = 0: every 4-draw holds a correct one
    assert pass_at_k(16, 1, 4) == pytest.approx(0.25)
    assert pass_at_k(16, 0, 16) == 0.0 and pass_at_k(16, 16, 1) == 1.0
    assert pass_at_k(10, 3, 2) == pytest.approx(1 - math.comb(7, 2) / math.comb(10, 2))
    assert pass_at_k(3, 1, 4) is None                     # n < k: no such draw
    for n, c, k in [(8, 3, 4), (9, 1, 1), (7, 6, 4), (12, 2, 5)]:
        assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k))
    assert pass_at_k(10_000, 3, 16) == pytest.approx(1 - math.comb(9997, 16) / math.comb(10_000, 16))
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 0)


def brute_majority(keys, passed, k):
    total = []
    for draw in combinations(range(len(keys)), k):
        votes = {}
        for i in draw:
            if keys[i] is not None:
                votes.setdefault(keys[i], []).append(passed[i])
        if not votes:
            total.append(0.0)
            continue
        top = max(len(v) for v in votes.values())
        winners = [sum(v) / len(v) for v in votes.values() if len(v) == top]
        total.append(sum(winners) / len(winners))
    return sum(total) / len(total)


def test_majority_at_k_hand_values():
    """Locks majority@k: uniform tie-breaking, abstentions do not vote, an all-abstain draw is wrong."""
    # 3 samples say "4" (right), 2 say "5": majority@1 = 3/5; over all 4-draws "4" wins unless the draw
    # is {4,4,5,5} (a tie, worth 1/2): C(3,2)*C(2,2)=3 of the C(5,4)=5 draws -> (2*1 + 3*0.5)/5 = 0.7
    keys, passed = ["4", "4", "4", "5", "5"], [True, True, True, False, False]
    assert majority_at_k(keys, passed, 1) == pytest.approx(0.6)
    assert majority_at_k(keys, passed, 4) == pytest.approx(0.7)
    assert majority_at_k(keys, passed, 5) == 1.0
    assert majority_at_k(keys, passed, 16) is None
    # one right answer and two copies of the same wrong one: at k=3 the wrong one always wins
    assert majority_at_k(["a", "b", "b"], [True, False, False], 3) == 0.0
    # a tie of two answers, one right: 1/2
    assert majority_at_k(["a", "b"], [True, False], 2) == 0.5
    # abstentions (no key) do not vote; a draw of only abstentions is wrong
    assert majority_at_k([None, None, "a"], [False, False, True], 1) == pytest.approx(1 / 3)
    assert majority_at_k([None, None, "a"], [False, False, True], 2) == pytest.approx(2 / 3)
    for keys, passed, k in [(list("aabbbcd"), [1, 1, 0, 0, 0, 1, 0], 4), (list("abcdabca") + [None], [1, 0, 0, 0, 1, 0, 0, 1, 0], 5),
                            (list("aaab"), [1, 0, 1, 0], 3)]:
        assert majority_at_k(keys, passed, k) == pytest.approx(brute_majority(keys, passed, k))


def test_majority_at_k_monte_carlo_for_large_tasks():
    keys = [str(i % 40) for i in range(200)]           # 40 answers: too many draws to enumerate
    passed = [k == "0" for k in keys]
    value = majority_at_k(keys, passed, 16, seed=1)
    assert value == majority_at_k(keys, passed, 16, seed=1)   # seeded: reproducible
    assert 0.0 < value < 0.2                                 # all answers equally common: about 1/40


def verified(answer: str, passed: bool, reward: float, canonical: str | None, **kw) -> AgentTrajectory:
    verdict = VerifyResult(reward=reward, passed=passed, info={"canonical": canonical})
    return run(answer, verification=verdict, **kw)


def test_profile_rollouts_per_task_and_global(tmp_path: Path):
    runs = [verified("4", True, 1.0, "4", task_id="a", index=i) for i in range(3)]
    runs += [verified("5", False, 0.0, "5", task_id="a", index=3 + i) for i in range(2)]
    runs += [verified("x", i == 0, float(i == 0), None, task_id="b", index=i) for i in range(16)]
    runs += [run(None, TerminalReason.max_steps, task_id="c")]
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(r.model_dump_json() + "\n" for r in runs) + "{not json\n\n")
    loaded, problems = read_rollouts(path)
    assert len(loaded) == len(runs) and len(problems) == 1 and problems[0].startswith("line 23")
    report = profile_rollouts(loaded, source=str(path), skipped_lines=len(problems))
    rows = {row.task_id: row for row in report.tasks}
    assert rows["a"].n == 5 and rows["a"].correct == 3
    assert rows["a"].pass_at_k == {1: pytest.approx(0.6), 4: 1.0, 16: None}
    assert rows["a"].majority_at_k == {1: pytest.approx(0.6), 4: pytest.approx(0.7), 16: None}
    assert rows["a"].reward_mean == pytest.approx(0.6) and rows["a"].reward_median == 1.0
    assert rows["a"].reward_std == pytest.approx(math.sqrt(0.24))
    assert rows["b"].pass_at_k[4] == pytest.approx(0.25) and rows["b"].distinct_answers == 1  # key: normalized "x"
    assert rows["c"].pass_at_k[1] == 0 and rows["c"].majority_at_k[1] == 0 and rows["c"].terminal_reasons == {"max_steps": 1}
    overall = report.overall
    assert overall.tasks == 3 and overall.samples == 22 and overall.correct == 4 and overall.unverified == 1
    assert overall.pass_at_k[1] == pytest.approx((0.6 + 1 / 16 + 0) / 3)
    assert overall.pass_at_k[4] == pytest.approx((1.0 + 0.25) / 2) and overall.tasks_at_k == {1: 3, 4: 2, 16: 1}
    assert overall.pass_at_k[16] == 1.0
    assert overall.reward_mean == pytest.approx(4 / 22)
    assert overall.terminal_reasons == {"final_answer": 21, "max_steps": 1}
    again = type(report).model_validate_json(report.model_dump_json())
    assert again == report and report.skipped_lines == 1


def test_profile_pass_at_k_interval_is_a_bootstrap_over_tasks():
    """40 tasks × 16 samples, half the tasks always right, half always wrong: pass@1 = 0.5 and the
    percentile bootstrap over tasks has the binomial spread, half width ≈ 1.96·sqrt(.25/40)."""
    runs = [verified("4", t % 2 == 0, float(t % 2 == 0), "4", task_id=f"t{t:02d}", index=i)
            for t in range(40) for i in range(16)]
    overall = profile_rollouts(runs).overall
    interval = overall.pass_at_k_interval[1]
    assert interval.mean == pytest.approx(0.5) and interval.n == 40 and overall.samples_per_task_min == 16
    assert (interval.hi - interval.lo) / 2 == pytest.approx(1.96 * math.sqrt(0.25 / 40), rel=0.15)
    assert overall.pass_at_k_interval[16].mean == pytest.approx(0.5)
    same = [verified("4", True, 1.0, "4", task_id=f"t{t}", index=i) for t in range(3) for i in range(4)]
    one = profile_rollouts(same).overall
    assert (one.pass_at_k_interval[1].lo, one.pass_at_k_interval[1].hi) == (1.0, 1.0)
    assert one.pass_at_k_interval[16] is None and one.samples_per_task_min == 4


def test_profile_of_nothing():
    report = profile_rollouts([])
    assert report.overall.samples == 0 and report.overall.pass_at_k == {1: None, 4: None, 16: None}
    assert report.overall.reward_mean is None


def test_profile_cli_writes_the_report_next_to_the_input(tmp_path: Path):
    runs = [verified("4", i < 2, float(i < 2), "4" if i < 2 else "5", task_id="a", index=i) for i in range(4)]
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(r.model_dump_json() + "\n" for r in runs))
    code = "import sys; from rollmarket.cli.profile import profile; profile(sys.argv[1:])"
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "COLUMNS": "200"})  # wide: the path must not wrap
    assert done.returncode == 0, done.stderr
    out = tmp_path / "rollouts.profile.json"
    assert "rollouts.profile.json" in done.stdout and "pass@4" in done.stdout
    assert "percentile bootstrap over tasks" in done.stdout and "16 or more per task" in done.stdout
    report = json.loads(out.read_text())
    assert report["overall"]["pass_at_k"]["4"] == 1.0 and report["tasks"][0]["majority_at_k"]["4"] == 0.5
    custom = tmp_path / "custom.json"
    done = subprocess.run([sys.executable, "-c", code, str(path), "--out", str(custom), "--no-by-task"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and custom.exists(), done.stderr


def test_every_verifier_and_arg_is_documented():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "verifiers.md").read_text()
    for name, verifier in VERIFIERS.items():
        assert f"### `{name}`" in doc, name
        fields = [field.alias or key for key, field in verifier.Args.model_fields.items()]
        missing = [f for f in fields if f"`{f}`" not in doc]
        assert not missing, f"args of {name} missing from docs/verifiers.md: {missing}"
