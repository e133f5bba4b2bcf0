"""An agent server as the worker's agent: POST /run per sample instead of the loop in this process.

It has the in-process Agent's `run` and `run_group`, and like it never raises for what the servers
do: a run the agent server could not do comes back as a `model_error` trajectory with the server's
typed error, which the worker reports as a failed job (retryable) instead of submitting.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx

from ..contracts import AgentTrajectory, SamplingConfig, TaskSpec, TerminalReason
from .loop import task_messages
from .model import Sampling


class RemoteAgent:
    """Runs tasks on `rollmarket agent serve` (or any server with its /run) at `url`."""

    def __init__(self, url: str, *, timeout: float = 600.0):
        self.url = url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, timeout=timeout,
                                 headers={"user-agent": "rollmarket-agent-client"})

    def run(self, task: TaskSpec, sampling: Sampling, *, sample_index: int = 0,
            should_stop: Callable[[], bool] | None = None) -> AgentTrajectory:
        """One verified run on the agent server."""
        started = time.perf_counter()

        def failed(reason: TerminalReason, error: str) -> AgentTrajectory:
            return AgentTrajectory(task_id=task.task_id, sample_index=sample_index, seed=sampling.seed,
                                   messages=task_messages(task), terminal_reason=reason, error=error[:4000],
                                   wall_time_s=time.perf_counter() - started)

        if should_stop is not None and should_stop():
            return failed(TerminalReason.aborted, "stopped by the caller")
        config = SamplingConfig(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                                max_tokens=sampling.max_tokens, seed=sampling.seed, stop=list(sampling.stop))
        body = {"task": task.model_dump(mode="json"), "sampling": config.model_dump(mode="json"),
                "sample_index": sample_index}
        try:
            answer = self.http.post("/run", json=body, params={"shape": "rollmarket"})
        except httpx.HTTPError as exc:
            return failed(TerminalReason.model_error, f"agent server {self.url}: {type(exc).__name__}: {exc}")
        if answer.status_code != 200:
            return failed(TerminalReason.model_error,
                          f"agent server {self.url}: HTTP {answer.status_code}: {answer.text[:2000]}")
        try:
            return AgentTrajectory.model_validate(answer.json()["trajectory"])
        except (ValueError, KeyError, TypeError) as exc:
            return failed(TerminalReason.model_error, f"agent server {self.url}: unusable answer: {exc}")

    def run_group(self, task: TaskSpec, n: int, sampling: Sampling, *, concurrency: int | None = None,
                  should_stop: Callable[[], bool] | None = None) -> list[AgentTrajectory]:
        """`n` runs of one task at once (the agent server runs them in parallel); in sample order."""
        with ThreadPoolExecutor(max(1, min(n, concurrency or n)), thread_name_prefix="remote-agent") as pool:
            futures = [pool.submit(self.run, task, sampling, sample_index=i, should_stop=should_stop)
                       for i in range(n)]
            return [f.result() for f in futures]

    def close(self) -> None:
        self.http.close()
