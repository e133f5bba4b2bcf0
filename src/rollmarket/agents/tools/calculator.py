"""calculator: safe arithmetic through the reference implementation's AST whitelist.

Same schema and, for every expression that works, the same output as `tasks.tools_ref.calculator`,
which the shipped models were trained on: '17 * 23' -> '391', '1/3' -> '0.333333'.
"""

from __future__ import annotations

from typing import Any, ClassVar

from ...tasks import tools_ref
from ..tool import Tool, ToolContext, output_or_failure


class Calculator(Tool):
    """+ - * / // % ** and parentheses on numbers; names, calls and attributes are refused.
    Expressions are capped at 200 characters, exponents at 64 and integer powers at 4096 bits."""

    name: ClassVar[str] = tools_ref.CALCULATOR["function"]["name"]
    description: ClassVar[str] = tools_ref.CALCULATOR["function"]["description"]
    parameters: ClassVar[dict[str, Any]] = tools_ref.CALCULATOR["function"]["parameters"]

    def run(self, arguments: dict[str, Any], context: ToolContext) -> str:
        return output_or_failure(tools_ref.calculator(arguments["expression"]))
