"""The `code` verifier's verdict is decided outside the sandbox: solutions written to fool it score 0.

Each cheat runs for real in python_eval's bubblewrap sandbox, beside an honest solution of the same
task that scores 1 (so the task can be passed, and the 0s are the cheats' own). The expected
rewards are known by hand: add(1, 2) is 3, add(-1, 1) is 0, add(2, 2) is 4, and 2 + 3 prints 5.
"""

from __future__ import annotations

import pytest

from rollmarket.contracts import TaskSpec
from rollmarket.verifiers import VerifierConfigError, verify
from rollmarket.verifiers.builtin.code import split_test

ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]
SUM_IO = [{"stdin": "2 3\n", "stdout": "5\n"}, {"stdin": "10 -4\n", "stdout": "6\n"}]
HONEST = "def add(a, b):\n    return a + b\nif __name__ == '__main__':\n    print(add(*map(int, input().split())))"

# Finds the harness's report marker wherever the interpreter holds it (frames, constants, globals).
_FIND_MARKER = """
import gc, json, os, sys
def _strings():
    frame = sys._getframe()
    while frame is not None:
        yield from frame.f_code.co_consts
        yield from frame.f_globals.values()
        frame = frame.f_back
    for obj in gc.get_objects():
        if isinstance(obj, (list, tuple, dict)):
            yield from (obj.values() if isinstance(obj, dict) else obj)
marker = next(s for s in _strings() if isinstance(s, str) and s.startswith("@@rollmarket-code-report-")
              and s.endswith("@@") and len(s) > 30)
"""

CHEATS = {
    # The report the old harness wrote (each test a verdict), forged, then an exit before the real one.
    "forged verdicts": _FIND_MARKER + """
def add(a, b):
    return 0
print(marker + json.dumps({"error": None, "results": [[True, None]] * 5}))
sys.stdout.flush()
os._exit(0)
""",
    # A report in today's shape, every value claimed True, every printed output claimed "ok".
    "forged values": _FIND_MARKER + """
def add(a, b):
    return 0
print(marker + json.dumps({"error": None, "tests": [["ok", [["v", True]]]] * 3, "cases": [["ok", "ok"]] * 2}))
sys.stdout.flush()
os._exit(0)
""",
    "exit 0 early": "def add(a, b):\n    return a - b\nimport sys\nsys.exit(0)",
    "os._exit early": "def add(a, b):\n    return a - b\nimport os\nos._exit(0)",
    # Builtins and the harness's own tools patched: a no-op exec, a yes-man eval, a forging json.dumps.
    "patched builtins": """
import builtins, json
class Yes:
    def __eq__(self, other):
        return True
    __hash__ = object.__hash__
def add(a, b):
    return Yes()
builtins.AssertionError = type("Never", (Exception,), {})
builtins.eval = lambda *args, **kwargs: True
builtins.exec = lambda *args, **kwargs: None
_dumps = json.dumps
json.dumps = lambda obj, *args, **kwargs: _dumps({"error": None, "results": [[True, None]] * 5,
                                                  "tests": [["ok", [["v", True]]]] * 3, "cases": [["ok", "ok"]] * 2})
""",
    # An int that equals everything: not a plain value, so it cannot reach the comparison.
    "int with its own __eq__": "class I(int):\n    def __eq__(self, other):\n        return True\n"
                               "    __hash__ = int.__hash__\ndef add(a, b):\n    return I(0)\n"
                               "if __name__ == '__main__':\n    print(I(0))",
}


# How each is caught: a forged report of the old shape does not parse; one of today's shape claims
# values that are wrong; an early exit ends the run before any test; a patched json.dumps forges too.
WHY = {"forged verdicts": "no_report", "forged values": "tests_failed", "exit 0 early": "crashed",
       "os._exit early": "no_report", "patched builtins": "tests_failed", "int with its own __eq__": "tests_failed"}


def task(**args) -> TaskSpec:
    return TaskSpec(task_id="cheat", prompt="Write add(a, b).", verifier="code", verifier_args=args)


def test_the_honest_solution_passes_the_same_task():
    got = verify(task(tests=ADD_TESTS, io=SUM_IO, timeout_s=30), HONEST)
    assert got.reward == 1.0 and got.passed, got.info


@pytest.mark.parametrize("name", sorted(CHEATS))
def test_cheating_solutions_score_zero(name):
    got = verify(task(tests=ADD_TESTS, io=SUM_IO, timeout_s=30), CHEATS[name])
    assert got.reward == 0.0 and not got.passed, (name, got.info)
    assert got.info["failure"] == WHY[name], got.info


def test_the_expected_values_never_enter_the_sandbox():
    """A solution that searches its whole interpreter for the expected answer finds nothing to copy."""
    search = _FIND_MARKER.split("marker = ")[0] + \
        "import re\nfound = next((s for s in _strings() if isinstance(s, str) and re.search(r'zebra-[0-9]', s)), " \
        "'not found')\n"
    answer = search + "def secret():\n    return found\nif __name__ == '__main__':\n    print(found)"
    got = verify(task(tests=["assert secret() == 'zebra-42'"], io=[{"stdin": "", "stdout": "zebra-43"}]), answer)
    assert [r["ok"] for r in got.info["results"]] == [False, False], got.info
    assert "'not found'" in got.info["results"][0]["error"], got.info  # what the code gave, shown by us


def test_values_cross_as_plain_data_whatever_their_size():
    tests = ["assert big() == 7 ** 6000", "assert mixed() == {(1, 'a'): [b'x', 2.5, None, {3}], 'n': -4}"]
    answer = "def big():\n    return 7 ** 6000\ndef mixed():\n    return {(1, 'a'): [b'x', 2.5, None, {3}], 'n': -4}"
    assert verify(task(tests=tests), answer).passed
    assert verify(task(tests=tests), answer.replace("7 ** 6000", "7 ** 6000 + 1").replace("-4}", "-5}")).reward == 0


@pytest.mark.parametrize("test, values, held", [
    ("assert f() == (1, 2)", [(1, 2)], True),
    ("assert f() == (1, 2)", [[1, 2]], False),  # a list is not a tuple, as in Python
    ("assert not f()", [0], True),
    ("assert 1 < f() <= 3", [3], True),
    ("assert f() in {'a', 'b'}", ["c"], False),
    ("assert f() is None", [None], True),
    ("assert f(1) == g(1)", [2, 2], True),
    ("assert f() == set()", [set()], True),  # set() and float('inf') are read here, not in the sandbox
    ("assert f() < float('inf')", [10 ** 400], True),
])
def test_tests_are_split_and_decided_here(test, values, held):
    check = split_test(test)
    assert check.decide(values) is held
    assert len(check.sent) == len(values) and all("f(" in s or "g(" in s for s in check.sent)


@pytest.mark.parametrize("bad", ["x = add(1, 2)", "assert 1 == 1", "import os\nassert f()"])
def test_a_test_that_is_not_one_assert_on_the_code_is_a_config_error(bad):
    with pytest.raises(VerifierConfigError, match=r"tests\[0\]"):
        verify(task(tests=[bad]), HONEST)
