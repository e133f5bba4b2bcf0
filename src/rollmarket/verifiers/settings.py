"""Settings of `rollmarket verifier serve`: name, default, one line of help each."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ResourcesSettings(BaseModel):
    """Settings of one resources server process (tools and verifiers over HTTP)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field("127.0.0.1", description="Interface to listen on.")
    port: int = Field(8002, ge=0, le=65535, description="TCP port; 0 picks a free one.")
    session_ttl_s: float = Field(
        900.0, gt=0, description="A session unused this long is closed and its workspace deleted.")
    max_sessions: int = Field(
        1024, ge=1, description="Most open sessions; seeding one more closes the least recently used.")
    max_calls_per_session: int = Field(
        10_000, ge=1, description="Most tool calls a session records; later calls still run but are not recorded.")
    tool_threads: int = Field(
        16, ge=1, description="Threads that run tool calls and verifications (python_eval blocks one while it runs).")
    python_eval_timeout_s: float = Field(
        5.0, gt=0, description="Wall-clock limit of one python_eval call (the process group is killed after it).")
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="Largest request body accepted (413 beyond).")
    reap_interval_s: float = Field(5.0, gt=0, description="How often expired sessions are looked for.")
    judge_urls: str = Field("", description="Comma-separated base URLs that llm_judge tasks may call; "
                            "empty: llm_judge tasks are refused.")

    gym_dataset: Literal["auto", "math", "mcqa", "code", "instructions"] = Field(
        "auto", description="Which NeMo Gym dataset the rows of Gym /verify bodies come from (their fields become "
        "a task); auto: read it from the fields.")

    @property
    def judge_url_list(self) -> tuple[str, ...]:
        """judge_urls as a tuple, blanks dropped."""
        return tuple(url.strip() for url in self.judge_urls.split(",") if url.strip())
