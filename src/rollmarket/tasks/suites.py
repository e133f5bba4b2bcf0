"""The shipped task suites: TaskSpec lines in JSONL, a train and a held-out split each.

    arithmetic  calculator family: arithmetic and word problems, one calculator call.
    lookup      lookup family: one web_search or one read_file, then the value.
    chains      2-5 dependent calls: the chain family (2-3 calls) and chain4/chain5 (generators.py).
    agent       six kinds: calculator, python_eval, read_file, web_search, trivia (no tool) and
                multi_hop (a chain task with at least two searches), each scored by a compound
                verifier: the answer decides pass/fail, tool use adds a fifth of the reward.

Every task is a pure function of (family, seed, index): train draws with seed 1 and held-out with
seed 2 (`families.SPLIT_SEEDS`), so held-out tasks of the training families are the same first
indices the tiny models were evaluated on and never trained on. No train split of any suite holds
a prompt of any suite's held-out split, except trivia, whose held-out questions ask facts a model
can only know from training. The files under `rollmarket/data/suites/` are `build_suite`'s output,
byte for byte; `rollmarket suites build` rewrites them.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..contracts import TaskSpec
from .families import SPLIT_SEEDS
from .generators import make_task
from .task import Task
from .world import World, load_world

SPLITS = ("train", "heldout")
DATA_DIR = "data/suites"
TOOL_NAMES = ("calculator", "python_eval", "read_file", "web_search")
VERIFIER_NAMES = ("exact", "numeric", "math", "json_schema", "tool_use", "compound", "code", "llm_judge",
                  "multiple_choice", "instructions", "math_verify")

NUMERIC_ARGS = {"rel_tol": 1e-6, "abs_tol": 1e-9}
"""What the tiny models were scored with (tasks.answers)."""
EXACT_INT_ARGS = {"rel_tol": 0.0, "abs_tol": 0.0}
"""python_eval answers are integers up to 2**53, where a relative tolerance would let wrong ones pass."""
EXACT_ARGS = {"case_sensitive": False}
ANSWER_WEIGHT, TOOLS_WEIGHT = 0.8, 0.2
EXTRA_CALLS = 2
"""Agent tasks allow this many tool calls beyond the gold trajectory's before the tools score drops."""


class UnknownSuite(ValueError):
    """A suite name, or a split of it, that is not shipped. `kind` is "suite" or "split", `name`
    the name given, `known` the names that exist and `suite` the suite of an unknown split."""

    def __init__(self, kind: str, name: str, known: Iterable[str], suite: str | None = None):
        self.kind, self.name, self.known, self.suite = kind, name, tuple(known), suite
        close = difflib.get_close_matches(name, self.known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        of = f" of suite {suite!r}" if suite else ""
        super().__init__(f"unknown {kind} {name!r}{of}; the {kind}s are {', '.join(self.known)}{hint}")


class TaskFileError(ValueError):
    """A tasks file line that is not a TaskSpec; `line` is 1-based."""

    def __init__(self, path: str | Path, line: int, reason: str):
        super().__init__(f"{path}:{line}: {reason}")
        self.path, self.line, self.reason = str(path), line, reason


@dataclass(frozen=True)
class Suite:
    """A shipped suite: what it asks, which kinds of task it mixes and how many per split."""

    name: str
    description: str
    kinds: tuple[tuple[str, Fraction], ...]
    """(kind, share of the suite) pairs, in the order the suite interleaves them."""
    sizes: tuple[tuple[str, int], ...]
    """(split, default number of tasks)."""

    def size(self, split: str) -> int:
        return dict(self.sizes)[split]


def _suite(name: str, description: str, kinds: dict[str, Fraction], train: int, heldout: int) -> Suite:
    return Suite(name, description, tuple(kinds.items()), (("train", train), ("heldout", heldout)))


_ONE, _HALF, _QUARTER, _SIXTH = Fraction(1), Fraction(1, 2), Fraction(1, 4), Fraction(1, 6)
SUITES: dict[str, Suite] = {s.name: s for s in [
    _suite("arithmetic", "Arithmetic and word problems; one calculator call, then the number.",
           {"calculator": _ONE}, 200, 80),
    _suite("lookup", "A fact about a town, company or person (web_search) or a value in a file (read_file).",
           {"lookup": _ONE}, 200, 50),
    _suite("chains", "Multi-step questions of 2-5 dependent tool calls (searches, files, then arithmetic).",
           {"chain": _HALF, "chain4": _QUARTER, "chain5": _QUARTER}, 200, 50),
    _suite("agent", "Six kinds: calculator, python_eval, read_file, web_search, trivia (no tool), multi-hop.",
           {k: _SIXTH for k in ("calculator", "python_eval", "read_file", "web_search", "trivia", "multi_hop")},
           240, 60),
]}


def suite_names() -> tuple[str, ...]:
    """Names of the shipped suites."""
    return tuple(SUITES)


def _get(name: str) -> Suite:
    if name not in SUITES:
        raise UnknownSuite("suite", name, suite_names())
    return SUITES[name]


def _check_split(split: str, suite: str | None = None) -> None:
    if split not in SPLITS:
        raise UnknownSuite("split", split, SPLITS, suite)


def check_suite(name: str, split: str | None = None) -> None:
    """Raise UnknownSuite unless `name` (and `split`, when given) is shipped."""
    _get(name)
    if split is not None:
        _check_split(split, name)


def parse_suite_spec(spec: str, default_split: str = "heldout") -> tuple[str, str]:
    """`NAME` or `NAME:SPLIT` → (name, split), both checked; raises UnknownSuite."""
    name, _, split = spec.partition(":")
    split = split or default_split
    check_suite(name, split)
    return name, split


# --- where each kind's tasks come from -------------------------------------------------------------


def _calls(task: Task) -> list[dict[str, Any]]:
    return [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for m in task.gold if m["role"] == "assistant" for c in m.get("tool_calls") or []]


def _uses(tool: str) -> Callable[[Task], bool]:
    return lambda task: [c["name"] for c in _calls(task)] == [tool]


@dataclass(frozen=True)
class _Source:
    family: str
    keep: Callable[[Task], bool] = lambda task: True
    memorized: bool = False
    """Held-out prompts may occur in train (facts a model can only recall)."""


_SOURCES: dict[str, _Source] = {
    "calculator": _Source("calculator"),
    "lookup": _Source("lookup"),
    "chain": _Source("chain"),
    "chain4": _Source("chain4"),
    "chain5": _Source("chain5"),
    "python_eval": _Source("python"),
    "read_file": _Source("lookup", keep=_uses("read_file")),
    "web_search": _Source("lookup", keep=_uses("web_search")),
    "trivia": _Source("plain", memorized=True),
    "multi_hop": _Source("chain", keep=lambda t: sum(c["name"] == "web_search" for c in _calls(t)) >= 2),
}


def _draw(kind: str, split: str, n: int, world: World, exclude: frozenset[str]) -> list[Task]:
    """The first `n` tasks of `kind` under the split's seed that its filter keeps, minus excluded prompts."""
    source = _SOURCES[kind]
    out: list[Task] = []
    index, limit = 0, 50 * n + 1000
    while len(out) < n:
        if index >= limit:
            raise RuntimeError(f"{kind}: only {len(out)} of {n} tasks in the first {limit} indices")
        task = make_task(source.family, SPLIT_SEEDS[split], index, world)
        index += 1
        if source.keep(task) and (source.memorized or task.prompt not in exclude):
            out.append(task)
    return out


# --- verifiers -------------------------------------------------------------------------------------


def _answer_check(task: Task) -> tuple[str, dict[str, Any]]:
    if task.verifier == "numeric":
        return "numeric", dict(EXACT_INT_ARGS if task.family == "python" else NUMERIC_ARGS)
    if task.verifier == "exact":
        return "exact", dict(EXACT_ARGS)
    return task.verifier, {}


def _agent_check(task: Task, kind: str, tools: list[str]) -> tuple[str, dict[str, Any]]:
    """Compound: the answer (weight 0.8) decides pass; tool use adds 0.2 (the gold tools called within
    a budget of calls, or, for trivia, no tool at all)."""
    verifier, args = _answer_check(task)
    calls = _calls(task)
    if kind == "trivia":
        tool_args: dict[str, Any] = {"forbidden": list(tools), "max_calls": 0}
    else:
        tool_args = {"required": sorted({c["name"] for c in calls}), "max_calls": len(calls) + EXTRA_CALLS}
    return "compound", {"components": [
        {"name": "answer", "verifier": verifier, "weight": ANSWER_WEIGHT, "args": args},
        {"name": "tools", "verifier": "tool_use", "weight": TOOLS_WEIGHT, "args": tool_args}], "pass": "answer"}


def _spec(task: Task, suite: str, split: str, index: int, kind: str) -> TaskSpec:
    tools = [t["function"]["name"] for t in task.tools]
    verifier, args = _agent_check(task, kind, tools) if suite == "agent" else _answer_check(task)
    calls = _calls(task)
    return TaskSpec(
        task_id=f"{suite}-{split}-{index:04d}", messages=task.messages, tools=tools, verifier=verifier,
        answer=task.expected, verifier_args=args, files=task.files,
        metadata={"suite": suite, "split": split, "kind": kind, "family": task.family, "source_task": task.id,
                  "source_digest": task.digest, "n_tool_calls": len(calls), "gold_calls": calls},
    )


# --- building --------------------------------------------------------------------------------------


def _quota(n: int, shares: Iterable[tuple[str, Fraction]]) -> dict[str, int]:
    """Split `n` by shares, largest remainders first (ties to the earlier kind)."""
    shares = list(shares)
    exact = {k: n * s for k, s in shares}
    counts = {k: int(v) for k, v in exact.items()}
    order = sorted(range(len(shares)), key=lambda i: (-(exact[shares[i][0]] - counts[shares[i][0]]), i))
    for i in order[: n - sum(counts.values())]:
        counts[shares[i][0]] += 1
    return counts


def _interleave(groups: dict[str, list[Task]]) -> list[tuple[str, Task]]:
    """Spread each kind evenly through the file, so any prefix is a fair sample of the suite."""
    keyed = [((Fraction(2 * i + 1, 2 * len(tasks)), order), kind, task)
             for order, (kind, tasks) in enumerate(groups.items()) for i, task in enumerate(tasks)]
    return [(kind, task) for _, kind, task in sorted(keyed, key=lambda x: x[0])]


def _build(suite: Suite, split: str, n: int, world: World, exclude: frozenset[str]) -> list[TaskSpec]:
    groups = {kind: _draw(kind, split, count, world, exclude)
              for kind, count in _quota(n, suite.kinds).items()}
    specs = []
    for i, (kind, task) in enumerate(_interleave(groups)):
        # The lookup suite names its kind by the tool a task needs.
        kind = _calls(task)[0]["name"] if kind == "lookup" else kind
        specs.append(_spec(task, suite.name, split, i, kind))
    return specs


@lru_cache(maxsize=1)
def heldout_prompts() -> frozenset[str]:
    """User prompts of every suite's held-out split at its default size, except trivia's."""
    world = load_world()
    return frozenset(spec.messages[-1]["content"]
                     for suite in SUITES.values()
                     for spec in _build(suite, "heldout", suite.size("heldout"), world, frozenset())
                     if spec.messages and spec.metadata["kind"] != "trivia")


def build_suite(name: str, split: str, n: int | None = None) -> list[TaskSpec]:
    """Generate suite `name`'s `split` (`n` tasks, default the shipped size), as shipped.

    Train never holds a prompt of any suite's default held-out split (trivia aside). The shipped
    held-out splits hold no prompt the tiny models trained on (a test regenerates their training
    data and checks); a held-out `n` above the default may draw one, and then no longer measures
    them on unseen tasks.
    """
    suite = _get(name)
    _check_split(split)
    n = suite.size(split) if n is None else n
    exclude = frozenset() if split == "heldout" else heldout_prompts()
    return _build(suite, split, n, load_world(), exclude)


def build_all(out_dir: Path | None = None) -> list[Path]:
    """Write every suite's splits under `out_dir` (default: the package data dir); return the paths."""
    paths = []
    for name in SUITES:
        for split in SPLITS:
            path = (out_dir / name / f"{split}.jsonl") if out_dir else suite_path(name, split)
            paths.append(write_tasks(build_suite(name, split), path))
    return paths


# --- files -----------------------------------------------------------------------------------------


def suite_path(name: str, split: str) -> Path:
    """The shipped JSONL of suite `name`'s `split` inside the installed package."""
    _get(name)
    _check_split(split)
    return Path(str(resources.files("rollmarket").joinpath(DATA_DIR, name, f"{split}.jsonl")))


def tasks_jsonl(tasks: Iterable[TaskSpec]) -> str:
    """One `TaskSpec.model_dump_json()` per line: the format of every tasks file."""
    return "".join(task.model_dump_json() + "\n" for task in tasks)


def write_tasks(tasks: Iterable[TaskSpec], path: str | Path) -> Path:
    """Write `tasks` to `path` as JSONL (parents created); return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tasks_jsonl(tasks), encoding="utf-8")
    return path


def parse_tasks(text: str, source: str | Path = "<tasks>") -> list[TaskSpec]:
    """TaskSpecs from JSONL text; blank lines are skipped; a bad line or a repeated task_id raises
    TaskFileError naming the line."""
    tasks: list[TaskSpec] = []
    first_line: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            task = TaskSpec.model_validate_json(line)
        except ValidationError as exc:
            raise TaskFileError(source, number, _reason(exc)) from exc
        if task.task_id in first_line:
            raise TaskFileError(source, number, f"task_id {task.task_id!r} repeats line {first_line[task.task_id]}")
        first_line[task.task_id] = number
        tasks.append(task)
    return tasks


def _reason(exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = ".".join(str(p) for p in error["loc"])
    return f"not a TaskSpec: {where + ': ' if where else ''}{error['msg']}"


def load_tasks(path: str | Path) -> list[TaskSpec]:
    """Read a tasks file: one TaskSpec JSON object per line (see docs/suites.md)."""
    return parse_tasks(Path(path).read_text(encoding="utf-8"), path)


def load_suite(name: str, split: str) -> list[TaskSpec]:
    """The shipped tasks of suite `name`'s `split`."""
    return load_tasks(suite_path(name, split))
