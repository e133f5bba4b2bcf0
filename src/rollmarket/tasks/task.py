"""The task record: what an agent is asked, with which tools, and how its answer is checked."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Task(BaseModel):
    """One generated task and its gold trajectory (data only; behaviour lives in tools and verifiers)."""

    model_config = ConfigDict(frozen=True)

    id: str = Field(description="'<family>-<split seed>-<index>', unique within a generated set.")
    family: str = Field(description="Task family: calculator, lookup, chain or plain.")
    messages: list[dict[str, Any]] = Field(description="The prompt: OpenAI-format system + user messages.")
    tools: list[dict[str, Any]] = Field(description="OpenAI function-tool JSON schemas offered to the model.")
    files: dict[str, str] = Field(default_factory=dict,
                                  description="The task directory for read_file: relative path -> content.")
    expected: str = Field(description="The expected final answer, bare (e.g. '391' or 'Ilse Marrow').")
    verifier: str = Field(description="How to compare answers: 'numeric' or 'exact' (see tasks.answers).")
    gold: list[dict[str, Any]] = Field(
        description="The gold continuation after `messages`: assistant turns (with OpenAI `tool_calls` whose "
                    "`arguments` are dicts), tool results, and the final bare answer.")

    @property
    def digest(self) -> str:
        """sha256 of the canonical JSON of the task (sorted keys, no whitespace)."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    @property
    def prompt(self) -> str:
        """The user's question."""
        return next(m["content"] for m in self.messages if m["role"] == "user")
