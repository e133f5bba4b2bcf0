"""Where an agent's tool calls go: in-process tools, or a resources server over HTTP.

Both hand out one session per run (the task's own directory and state) and answer every call
with a ToolResult; neither raises for a bad call.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from ..contracts import TaskSpec, ToolOutcome, ToolResult


class ToolSession(Protocol):
    def call(self, name: str, raw_arguments: str) -> ToolResult: ...


class Toolbox(Protocol):
    def schemas(self, names: list[str]) -> list[dict[str, Any]]: ...

    def session(self, task: TaskSpec): ...
    """A context manager yielding a ToolSession for one run of `task`."""


def parse_arguments(raw: str) -> dict[str, Any] | None:
    """The model's arguments as an object, or None when they are not a JSON object."""
    try:
        value = json.loads(raw) if raw.strip() else {}
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _unavailable(name: str, allowed: list[str]) -> ToolResult:
    offered = ", ".join(allowed) or "none"
    return ToolResult(name=name, content=f"error: unknown tool: {name} (available: {offered})",
                      outcome=ToolOutcome.unknown_tool)


class _LocalSession:
    def __init__(self, context, allowed: list[str]):
        self.context = context
        self.allowed = allowed

    def call(self, name: str, raw_arguments: str) -> ToolResult:
        from .tools import run_tool

        if name not in self.allowed:
            return _unavailable(name, self.allowed)
        return run_tool(name, raw_arguments, self.context)


class LocalToolbox:
    """The tools in this process; each run gets a throwaway copy of its task's files."""

    def schemas(self, names: list[str]) -> list[dict[str, Any]]:
        from .tools import tool_schemas

        return tool_schemas(names)

    @contextmanager
    def session(self, task: TaskSpec) -> Iterator[_LocalSession]:
        from .workspace import task_workspace

        with task_workspace(task.files) as context:
            yield _LocalSession(context, list(task.tools))


class _RemoteSession:
    def __init__(self, client, allowed: list[str]):
        self.client = client
        self.allowed = allowed

    def call(self, name: str, raw_arguments: str) -> ToolResult:
        if name not in self.allowed:
            return _unavailable(name, self.allowed)
        arguments = parse_arguments(raw_arguments)
        if arguments is None:
            return ToolResult(name=name, content="error: arguments must be a JSON object",
                              outcome=ToolOutcome.bad_arguments)
        try:
            return self.client.call_tool(name, arguments)
        except Exception as exc:  # the resources server is down or answered garbage: a tool error
            return ToolResult(name=name, content=f"error: tool server failed: {exc}", outcome=ToolOutcome.error)


class RemoteToolbox:
    """Tools served by `rollmarket verifier serve` (or any server with the same routes)."""

    def __init__(self, url: str):
        self.url = url

    def schemas(self, names: list[str]) -> list[dict[str, Any]]:
        from .tools import tool_schemas

        return tool_schemas(names)

    @contextmanager
    def session(self, task: TaskSpec) -> Iterator[_RemoteSession]:
        from ..verifiers.client import ResourcesClient

        client = ResourcesClient(self.url)
        try:
            client.seed_session(task)
            yield _RemoteSession(client, list(task.tools))
        finally:
            client.close()
