"""Synthetic tasks over a seeded made-up world: the world, the task families, reference tools."""

from .answers import VERIFIERS, check_answer
from .families import FAMILIES, SPLIT_SEEDS, SYSTEM, TOOLS, generate, generate_split, make_task
from .task import Task
from .tools_ref import TOOL_SCHEMAS, run_tool
from .world import World, generate_world, load_world

__all__ = ["FAMILIES", "SPLIT_SEEDS", "SYSTEM", "TOOLS", "TOOL_SCHEMAS", "VERIFIERS", "Task", "World",
           "check_answer", "generate", "generate_split", "generate_world", "load_world", "make_task", "run_tool"]
