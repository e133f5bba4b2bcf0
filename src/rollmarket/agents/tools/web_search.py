"""web_search: BM25 over the corpus the project ships (the world's documents), top 2.

Same schema and output as `tasks.tools_ref.web_search` ('Title: text' per line, best first, or
'no results'), whose BM25 index over the shipped world is built once per process and reused.
Deterministic: the same query gives the same text on every machine.
"""

from __future__ import annotations

from typing import Any, ClassVar

from ...contracts import ToolOutcome
from ...tasks import tools_ref
from ...tasks.world import load_world
from ..tool import Tool, ToolContext, output_or_failure


class WebSearch(Tool):
    """Search the shipped corpus of the world (456 documents: regions, towns, companies, people)."""

    name: ClassVar[str] = tools_ref.WEB_SEARCH["function"]["name"]
    description: ClassVar[str] = tools_ref.WEB_SEARCH["function"]["description"]
    parameters: ClassVar[dict[str, Any]] = tools_ref.WEB_SEARCH["function"]["parameters"]

    def run(self, arguments: dict[str, Any], context: ToolContext) -> str:
        return output_or_failure(tools_ref.web_search(arguments["query"], load_world()), ToolOutcome.bad_arguments)
