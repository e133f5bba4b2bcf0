"""NeMo Gym dataset rows turned into our tasks: the per-dataset fields of a Gym verify body or JSONL row.

A Gym resources server gets its dataset's own fields beside `responses_create_params` (and, on
/verify, `response`). Four of Gym's servers have a verifier family of ours that scores the same thing:

=================  ==========================================================  ===================
dataset            the row's fields (Gym's server)                             our task
=================  ==========================================================  ===================
``math``           ``expected_answer`` (math_with_judge; ``question`` kept)    ``math``, answer
``mcqa``           ``options`` [{"A": text}, ...] + ``expected_answer``        ``multiple_choice``
                   (+ ``grading_mode``, ``template_metadata``; mcqa)          (``read``, ``patterns``)
``code``           ``verifier_metadata.unit_tests`` {inputs, outputs,          ``code`` (io cases, or
                   fn_name}, or its ``packed`` form (code_gen)                 asserts on fn_name)
``instructions``   ``instruction_id_list`` + ``kwargs`` (instruction_following)  ``instructions``
=================  ==========================================================  ===================

The dataset is named (``--gym-dataset``) or, with ``auto``, read from which of these fields the
row has; fields of two datasets, or of none, are a GymRowError that names them. The prompt is the
row's user text (the last user message of ``responses_create_params.input``, else ``question`` or
``prompt``); an input of several messages (a system prompt, earlier turns) is kept as the task's
messages. Only what a family can score the way Gym's server does is converted: an IFEval
instruction id we have no constraint for, options not lettered A, B, C... in order, or unit tests
that do not fit are GymRowErrors too, never a task that scores something else.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
import zlib
from collections.abc import Callable
from enum import StrEnum
from typing import Any

from pydantic import ValidationError

from ..contracts import TaskSpec, VerifyResult
from .builtin.code import extract_code
from .gym import content_text
from .verifier import VerifierConfigError, get_verifier

MAX_UNPACKED_BYTES = 64 * 1024 * 1024
"""Largest `packed` unit-test blob accepted once inflated (a zip bomb is a bad row, not a crash)."""


class GymDataset(StrEnum):
    """Which of Gym's resources servers a row was written for."""

    auto = "auto"
    math = "math"
    mcqa = "mcqa"
    code = "code"
    instructions = "instructions"


class GymRowError(ValueError):
    """A Gym row that cannot become one of our tasks; the message names the field."""


# The fields that mark each dataset; `expected_answer` alone is math, with `options` it is mcqa.
_MARKS = {GymDataset.code: ("verifier_metadata",), GymDataset.instructions: ("instruction_id_list", "kwargs"),
          GymDataset.mcqa: ("options",)}


def detect_dataset(row: dict[str, Any]) -> GymDataset | None:
    """The dataset the row's fields name; None when it has none of them; GymRowError when several."""
    found = [dataset for dataset, keys in _MARKS.items() if any(key in row for key in keys)]
    if not found and "expected_answer" in row:
        found = [GymDataset.math]
    if len(found) > 1:
        fields = sorted(key for dataset in found for key in _MARKS[dataset] if key in row)
        raise GymRowError(f"{', '.join(fields)}: fields of several Gym datasets ({', '.join(found)}); "
                          "name one with --gym-dataset")
    return found[0] if found else None


def has_row_fields(row: dict[str, Any]) -> bool:
    """True when the body carries any Gym dataset field (expected_answer, options, unit tests, instructions)."""
    return "expected_answer" in row or any(key in row for keys in _MARKS.values() for key in keys)


def task_from_row(row: dict[str, Any], dataset: GymDataset | str = GymDataset.auto, *,
                  task_id: str | None = None) -> TaskSpec:
    """The row as a TaskSpec its verifier accepts; GymRowError naming the field that does not fit."""
    if not isinstance(row, dict):
        raise GymRowError(f"row: must be a JSON object, not {type(row).__name__}")
    dataset = GymDataset(dataset)
    chosen = detect_dataset(row) if dataset is GymDataset.auto else dataset
    if chosen is None:
        raise GymRowError("no Gym dataset fields (expected_answer, options, verifier_metadata, "
                          "instruction_id_list): give them, a `task`, or seed a session")
    verifier, answer, args = _CONVERT[chosen](row)
    prompt, messages = _conversation(row)
    raw = {"task_id": task_id or _row_id(row), "prompt": prompt, "messages": messages, "verifier": verifier,
           "answer": answer,
           "verifier_args": args, "metadata": {"gym_dataset": chosen.value}}
    try:
        task = TaskSpec.model_validate(raw)
        get_verifier(task.verifier).check(task)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise GymRowError(f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}") from None
    except VerifierConfigError as exc:
        raise GymRowError(str(exc)) from None
    return task


def _row_id(row: dict[str, Any]) -> str:
    for key in ("task_id", "uuid", "id", "_ng_task_index"):
        value = row.get(key)
        if isinstance(value, (str, int)) and not isinstance(value, bool) and str(value).strip():
            return "gym-" + re.sub(r"[^A-Za-z0-9_.:\-]", "-", str(value).strip())[:100]
    digest = hashlib.sha256(json.dumps(row, sort_keys=True, default=str).encode()).hexdigest()
    return f"gym-{digest[:16]}"


def _conversation(row: dict[str, Any]) -> tuple[str, list[dict[str, str]] | None]:
    """The task's prompt (the last user text) and, when the input holds more than one user
    message, its messages (developer is system; function calls of an earlier run are left out)."""
    params = row.get("responses_create_params")
    given = params.get("input") if isinstance(params, dict) else None
    if isinstance(given, str) and given.strip():
        return given, None
    messages = []
    for item in given if isinstance(given, list) else []:
        if isinstance(item, dict) and item.get("type", "message") == "message" and isinstance(item.get("role"), str):
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": content_text(item.get("content"))})
    users = [m["content"] for m in messages if m["role"] == "user" and m["content"].strip()]
    if users:
        return users[-1], (messages if len(messages) > 1 else None)
    for key in ("question", "prompt"):
        if isinstance(row.get(key), str) and row[key].strip():
            return row[key], None
    raise GymRowError("responses_create_params.input: no user message (and no question or prompt field)")


def _string(row: dict[str, Any], key: str) -> str:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, (str, int, float)) or not str(value).strip():
        raise GymRowError(f"{key}: required, a non-empty string")
    return str(value).strip()


def _math(row: dict[str, Any]) -> tuple[str, Any, dict[str, Any]]:
    return "math", _string(row, "expected_answer"), {}


def _mcqa(row: dict[str, Any]) -> tuple[str, Any, dict[str, Any]]:
    options = row.get("options")
    if not isinstance(options, list) or len(options) < 2:
        raise GymRowError("options: required, a list of at least two {letter: text} objects")
    texts = []
    for i, entry in enumerate(options):
        want = chr(ord("A") + i)
        if not isinstance(entry, dict) or len(entry) != 1:
            raise GymRowError(f"options.{i}: must be one {{letter: text}} object")
        (letter, text), = entry.items()
        if not isinstance(letter, str) or letter.upper() != want or not isinstance(text, str):
            raise GymRowError(f"options.{i}: must be {{{want!r}: text}} (letters A, B, C... in order)")
        texts.append(text)
    expected = _string(row, "expected_answer").upper()
    if len(expected) != 1 or not "A" <= expected < chr(ord("A") + len(texts)):
        raise GymRowError(f"expected_answer: {expected!r} is not the letter of an option")
    mode = row.get("grading_mode", _MCQA_DEFAULT_MODE)
    if mode not in _MCQA_READING:
        raise GymRowError(f"grading_mode: {mode!r} is not one of mcqa's ({', '.join(_MCQA_READING)})")
    template = row.get("template_metadata")
    patterns = template.get("output_regex", []) if isinstance(template, dict) else []
    patterns = [patterns] if isinstance(patterns, str) else patterns
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise GymRowError("template_metadata.output_regex: must be a regular expression or a list of them")
    return "multiple_choice", expected, {"options": texts, "read": _MCQA_READING[mode], "patterns": patterns}


# mcqa's grading modes (a row's `grading_mode`, strict by default) and the multiple_choice reading that
# grades the same way; Gym's server reads an unboxed "Answer: B" as no answer unless the row says so.
_MCQA_DEFAULT_MODE = "strict_single_letter_boxed"
_MCQA_READING = {_MCQA_DEFAULT_MODE: "boxed_letter", "lenient_boxed": "boxed", "lenient_answer_colon": "answer_colon"}


def _unit_tests(row: dict[str, Any]) -> dict[str, Any]:
    metadata = row.get("verifier_metadata")
    tests = metadata.get("unit_tests") if isinstance(metadata, dict) else None
    if not isinstance(tests, dict):
        raise GymRowError("verifier_metadata.unit_tests: required, an object {inputs, outputs, fn_name}")
    if "packed" in tests:  # Gym's LiveCodeBench preparation: base64 of zlib of the JSON
        try:
            inflater = zlib.decompressobj()
            raw = inflater.decompress(base64.b64decode(tests["packed"], validate=True), MAX_UNPACKED_BYTES)
            if inflater.unconsumed_tail:
                raise GymRowError(f"verifier_metadata.unit_tests.packed: inflates past {MAX_UNPACKED_BYTES} bytes")
            unpacked = json.loads(raw)
        except (binascii.Error, zlib.error, TypeError, ValueError) as exc:
            if isinstance(exc, GymRowError):
                raise
            raise GymRowError(f"verifier_metadata.unit_tests.packed: not base64 zlib JSON ({exc})") from None
        if not isinstance(unpacked, dict):
            raise GymRowError("verifier_metadata.unit_tests.packed: must hold an object {inputs, outputs}")
        tests = {"inputs": unpacked.get("inputs"), "outputs": unpacked.get("outputs"), "fn_name": tests.get("fn_name")}
    inputs, outputs = tests.get("inputs"), tests.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or not inputs \
            or not all(isinstance(x, str) for x in [*inputs, *outputs]):
        raise GymRowError("verifier_metadata.unit_tests: inputs and outputs must be non-empty lists of strings")
    if len(inputs) != len(outputs):
        raise GymRowError(f"verifier_metadata.unit_tests: {len(inputs)} inputs but {len(outputs)} outputs")
    return tests


# A call-based test (LiveCodeBench's fn_name) calls the method of the solution's class Solution,
# else the top-level function; this helper runs in the sandbox, the comparison stays outside.
_CALL_SETUP = '''def _gym_call(name, args):
    found = globals()
    target = getattr(found["Solution"](), name) if "Solution" in found else found[name]
    return target(*args)
'''


def _code(row: dict[str, Any]) -> tuple[str, Any, dict[str, Any]]:
    tests = _unit_tests(row)
    fn_name = tests.get("fn_name")
    if fn_name is None:
        return "code", None, {"io": [{"stdin": i, "stdout": o} for i, o in zip(tests["inputs"], tests["outputs"],
                                                                                strict=True)]}
    if not isinstance(fn_name, str) or not fn_name.isidentifier():
        raise GymRowError(f"verifier_metadata.unit_tests.fn_name: {fn_name!r} is not a Python name")
    asserts = []
    for i, (given, want) in enumerate(zip(tests["inputs"], tests["outputs"], strict=True)):
        try:  # LiveCodeBench writes one JSON value per line: the arguments; the output is one JSON value
            args = [json.loads(line) for line in given.split("\n") if line.strip()]
            expected = json.loads(want)
        except ValueError:
            raise GymRowError(f"verifier_metadata.unit_tests: case {i} is not JSON lines (call-based tests "
                              "need JSON arguments and a JSON output)") from None
        asserts.append(f"assert _gym_call({fn_name!r}, {args!r}) == {expected!r}")
    return "code", None, {"tests": asserts, "setup": _CALL_SETUP}


def _words(kwargs: dict[str, Any], count: str, kind: str) -> dict[str, Any]:
    n, relation = kwargs.get(count), kwargs.get("relation")
    if not isinstance(n, int) or isinstance(n, bool) or relation not in ("less than", "at least"):
        raise GymRowError(f"kwargs: {kind} needs {count} (an integer) and relation ('less than' or 'at least')")
    return {"kind": kind, "max": n - 1} if relation == "less than" else {"kind": kind, "min": n}


def _need(kwargs: dict[str, Any], key: str, kind: type) -> Any:
    value = kwargs.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise GymRowError(f"kwargs: needs {key} ({kind.__name__})")
    return value


# IFEval instruction ids (Gym's instruction_following) that one of our constraints checks the same way.
_INSTRUCTIONS: dict[str, Callable[[dict[str, Any]], list[dict[str, Any]]]] = {
    "length_constraints:number_words": lambda kw: [_words(kw, "num_words", "words")],
    "length_constraints:number_sentences": lambda kw: [_words(kw, "num_sentences", "sentences")],
    "detectable_format:number_bullet_lists": lambda kw: [
        {"kind": "bullets", "min": _need(kw, "num_bullets", int), "max": kw["num_bullets"]}],
    "keywords:existence": lambda kw: [{"kind": "keywords", "include": _need(kw, "keywords", list)}],
    "keywords:forbidden_words": lambda kw: [{"kind": "keywords", "exclude": _need(kw, "forbidden_words", list)}],
    "detectable_format:json_format": lambda kw: [{"kind": "json"}],
    "change_case:english_lowercase": lambda kw: [{"kind": "case", "value": "lower"}],
    "change_case:english_capital": lambda kw: [{"kind": "case", "value": "upper"}],
    "startend:end_checker": lambda kw: [{"kind": "ends_with", "value": _need(kw, "end_phrase", str)}],
    "startend:quotation": lambda kw: [{"kind": "starts_with", "value": '"'}, {"kind": "ends_with", "value": '"'}],
    "punctuation:no_comma": lambda kw: [{"kind": "no_commas"}],
}
SUPPORTED_INSTRUCTIONS = tuple(sorted(_INSTRUCTIONS))


def _instructions(row: dict[str, Any]) -> tuple[str, Any, dict[str, Any]]:
    ids, kwargs = row.get("instruction_id_list"), row.get("kwargs")
    if not isinstance(ids, list) or not ids or not isinstance(kwargs, list) or len(kwargs) != len(ids):
        raise GymRowError("instruction_id_list, kwargs: required, non-empty lists of the same length")
    constraints = []
    for i, (name, given) in enumerate(zip(ids, kwargs, strict=True)):
        convert = _INSTRUCTIONS.get(name) if isinstance(name, str) else None
        if convert is None:
            raise GymRowError(f"instruction_id_list.{i}: {name!r} has no constraint here (supported: "
                              f"{', '.join(SUPPORTED_INSTRUCTIONS)})")
        if given is not None and not isinstance(given, dict):
            raise GymRowError(f"kwargs.{i}: must be an object or null")
        try:
            constraints.extend(convert({k: v for k, v in (given or {}).items() if v is not None}))
        except GymRowError as exc:
            raise GymRowError(f"kwargs.{i} ({name}): {str(exc).removeprefix('kwargs: ')}") from None
    return "instructions", None, {"constraints": constraints}


_CONVERT = {GymDataset.math: _math, GymDataset.mcqa: _mcqa, GymDataset.code: _code,
            GymDataset.instructions: _instructions}


# Gym's code_gen and instruction_following give 1 only when every test or instruction holds; ours
# give the fraction (kept in the verdict), so a Gym client gets Gym's number as `reward`.
_ALL_OR_NOTHING = {GymDataset.code.value, GymDataset.instructions.value}


def gym_reward(task: TaskSpec, verdict: VerifyResult) -> float:
    """The reward Gym's own server would give a row's task: all or nothing for code and instructions."""
    if task.metadata.get("gym_dataset") in _ALL_OR_NOTHING:
        return 1.0 if verdict.passed else 0.0
    return verdict.reward


def gym_extracted(task: TaskSpec, verdict: VerifyResult, answer: str | None) -> dict[str, Any]:
    """The fields Gym's servers add for what they read from the answer (their metrics group samples by
    them): `extracted_answer` for math and mcqa rows, `extracted_model_code` for code rows. Math rows
    also get the two fields math_with_judge's response requires: `library_reward` (the checker's
    reward, before any judge: ours has none) and `judge_evaluations` (null: no judge was asked)."""
    dataset = task.metadata.get("gym_dataset")
    if dataset == GymDataset.math.value:
        return {"extracted_answer": verdict.info.get("canonical"), "library_reward": verdict.reward,
                "judge_evaluations": None}
    if dataset == GymDataset.mcqa.value:
        return {"extracted_answer": verdict.info.get("canonical")}
    if dataset == GymDataset.code.value:
        return {"extracted_model_code": extract_code(answer or "") or None}
    return {}


def import_rows(lines: list[str], dataset: GymDataset | str = GymDataset.auto) -> list[TaskSpec]:
    """Every JSONL line of a Gym dataset file as a task; GymRowError naming the first bad line."""
    tasks, seen = [], set()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            task = task_from_row(row, dataset)
        except (ValueError, GymRowError) as exc:
            raise GymRowError(f"line {number}: {exc}") from None
        if task.task_id in seen:  # two rows with one id: the line number keeps both
            task = task.model_copy(update={"task_id": f"{task.task_id}-{number}"})
        seen.add(task.task_id)
        tasks.append(task)
    return tasks
