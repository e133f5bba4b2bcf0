"""The agents' tools, one file each, and the registry the agent loop and the resources server use.

    from rollmarket.agents.tools import run_tool, tool_schemas
    tools = tool_schemas(["calculator", "web_search"])          # offered to the model
    result = run_tool("calculator", '{"expression": "17*23"}')  # a ToolResult; never raises

Adding a tool: a `Tool` subclass in its own file here, an instance in TOOLS, a section in docs/tools.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ...contracts import ToolOutcome, ToolResult
from ..tool import Tool, ToolContext
from .calculator import Calculator
from .python_eval import PythonEval, SandboxLimits
from .read_file import ReadFile
from .web_search import WebSearch

TOOLS: dict[str, Tool] = {tool.name: tool for tool in (Calculator(), PythonEval(), ReadFile(), WebSearch())}
"""Every tool by name, with default settings."""


class UnknownTool(ValueError):
    """A tool name that is not in TOOLS."""


def get_tool(name: str) -> Tool:
    """The tool called `name`, or UnknownTool."""
    try:
        return TOOLS[name]
    except (KeyError, TypeError):
        raise UnknownTool(f"unknown tool: {name}") from None


def tool_schemas(names: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """The OpenAI function-tool schemas of `names`, in that order (every tool when None)."""
    return [get_tool(name).schema() for name in (TOOLS if names is None else names)]


def run_tool(name: str, arguments: Any, context: ToolContext | None = None) -> ToolResult:
    """Run tool `name` on `arguments` (a dict or a JSON string). Never raises: an unknown name is a
    result with outcome unknown_tool, like every other failure."""
    try:
        tool = get_tool(name)
    except UnknownTool as exc:
        return ToolResult(name=str(name), content=f"error: {exc}", outcome=ToolOutcome.unknown_tool)
    return tool(arguments, context)


__all__ = ["TOOLS", "Calculator", "PythonEval", "ReadFile", "SandboxLimits", "UnknownTool", "WebSearch",
           "get_tool", "run_tool", "tool_schemas"]
