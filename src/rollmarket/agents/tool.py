"""The tool interface: a name, a JSON Schema for its arguments, and a run that never raises.

Implementations live in `agents/tools/` (one file per tool). The agent loop and the resources
server call tools only through `Tool.__call__`, which validates the arguments against the schema,
runs the tool and turns every failure into a `ToolResult` whose content the model reads next:
a tool failure is a tool message, never a crash.
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match

from ..contracts import ToolOutcome, ToolResult

MAX_OUTPUT_CHARS = 4000
"""Tool output beyond this is cut (and the result marked truncated)."""
TRUNCATION_MARK = "\n[output truncated]"
"""Ends a cut output, so the model knows there was more; counted within MAX_OUTPUT_CHARS."""


class ToolFailure(Exception):
    """Raised inside `Tool.run` for an expected failure; `outcome` says which kind."""

    def __init__(self, message: str, outcome: ToolOutcome = ToolOutcome.error):
        super().__init__(message)
        self.outcome = outcome


@dataclass
class ToolContext:
    """Where a tool call runs.

    workdir: the task's directory (read_file reads only below it; python_eval runs in a
    throwaway copy of it). None means the task has no files.
    state: per-session state a stateful tool may keep (the resources server keeps one per cookie).
    """

    workdir: Path | None = None
    state: dict[str, Any] = field(default_factory=dict)


def output_or_failure(text: str, outcome: ToolOutcome = ToolOutcome.error) -> str:
    """`text`, or ToolFailure(outcome) when it is an `error: ...` message (the reference tools' convention)."""
    if text.startswith("error:"):
        raise ToolFailure(text.removeprefix("error:").strip(), outcome)
    return text


def parse_arguments(arguments: Any) -> dict[str, Any]:
    """The arguments as a dict: a dict as it is, a JSON object string parsed; None or "" is {}."""
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return {}
    if isinstance(arguments, (str, bytes)):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError) as exc:
            raise ToolFailure(f"arguments are not valid JSON: {exc}", ToolOutcome.bad_arguments) from None
    if not isinstance(arguments, dict):
        raise ToolFailure("arguments must be a JSON object", ToolOutcome.bad_arguments)
    return arguments


class Tool(ABC):
    """One tool. Subclasses set `name`, `description`, `parameters` and implement `run`."""

    name: ClassVar[str]
    description: ClassVar[str]
    parameters: ClassVar[dict[str, Any]]
    """JSON Schema of the arguments object."""
    _validator: ClassVar[Draft202012Validator]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "parameters" in cls.__dict__:
            # A broken schema fails at import, not at the first call.
            Draft202012Validator.check_schema(cls.parameters)
            cls._validator = Draft202012Validator(cls.parameters)

    def schema(self) -> dict[str, Any]:
        """The OpenAI function-tool schema offered to the model."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": self.parameters}}

    @abstractmethod
    def run(self, arguments: dict[str, Any], context: ToolContext) -> str:
        """Do the work and return the text the model sees; raise ToolFailure for expected failures."""

    def validate(self, arguments: Any) -> dict[str, Any]:
        """The parsed arguments, or ToolFailure(bad_arguments) saying what is wrong with them."""
        parsed = parse_arguments(arguments)
        error = best_match(self._validator.iter_errors(parsed))
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path)
            detail = f"{where}: {error.message}" if where else error.message
            raise ToolFailure(f"bad arguments for {self.name}: {detail}", ToolOutcome.bad_arguments)
        return parsed

    def __call__(self, arguments: Any, context: ToolContext | None = None) -> ToolResult:
        """Validate `arguments` (a dict or a JSON string), run, and return a ToolResult. Never raises.

        The boundary where failures become data: a ToolFailure keeps its outcome, any other
        exception is outcome `error`; either way the content starts with `error:`.
        """
        start = time.perf_counter()
        try:
            content = self.run(self.validate(arguments), context or ToolContext())
            if not isinstance(content, str):
                raise TypeError(f"{self.name} returned {type(content).__name__}, not str")
            outcome = ToolOutcome.ok
        except ToolFailure as exc:
            content, outcome = f"error: {exc}", exc.outcome
        except Exception as exc:  # noqa: BLE001 - the boundary: a tool bug is a tool message
            content, outcome = f"error: {type(exc).__name__}: {exc}", ToolOutcome.error
        truncated = len(content) > MAX_OUTPUT_CHARS
        if truncated:
            content = content[: MAX_OUTPUT_CHARS - len(TRUNCATION_MARK)] + TRUNCATION_MARK
        return ToolResult(name=self.name, content=content, outcome=outcome, truncated=truncated,
                          elapsed_s=time.perf_counter() - start)
