"""A synchronous client of the resources server. One ResourcesClient is one session.

    with ResourcesClient("http://127.0.0.1:8002") as client:
        client.seed_session(task)
        client.call_tool("read_file", {"path": "notes.txt"})      # ToolResult
        client.verify(task, "42")                                  # scored with the calls above
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import httpx
from pydantic import ValidationError

from ..contracts import (
    AgentTrajectory,
    TaskSpec,
    ToolCallRecord,
    ToolResult,
    VerifyResult,
)
from .sessions import CALL_ID_HEADER, SESSION_HEADER


class ResourcesError(Exception):
    """The server refused a request (its typed code and message) or could not be reached (status None)."""

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.code = message, status, code

    def __str__(self) -> str:
        return f"[{self.status} {self.code}] {self.message}" if self.status else self.message


class ResourcesClient:
    """Talks to one resources server as one session (the cookie is kept and the header sent)."""

    def __init__(self, url: str, *, timeout: float = 120.0, transport: httpx.BaseTransport | None = None):
        self.url = url.rstrip("/")
        self.session_id: str | None = None
        self.tools: list[str] = []
        self._http = httpx.Client(base_url=self.url, timeout=timeout, transport=transport,
                                  headers={"user-agent": "rollmarket-resources-client"})

    def _post(self, path: str, *, body: Any = None, content: bytes | None = None,
              headers: dict[str, str] | None = None) -> httpx.Response:
        headers = {"content-type": "application/json", **(headers or {})}
        if self.session_id:
            headers[SESSION_HEADER] = self.session_id
        if content is None:
            content = json.dumps({} if body is None else body).encode()
        try:
            response = self._http.post(path, content=content, headers=headers)
        except httpx.TransportError as exc:
            raise ResourcesError(f"POST {path}: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 400:
            try:
                error = response.json()["error"]
                code, message = error["code"], error["message"]
            except (ValueError, KeyError, TypeError):
                code, message = None, response.text[:500]
            raise ResourcesError(message, status=response.status_code, code=code)
        return response

    def seed_session(self, task: TaskSpec | None = None) -> str:
        """Open this client's session (for `task`, or an empty one) and return its id."""
        body = {} if task is None else {"task": task.model_dump(mode="json")}
        answer = self._read(self._post("/seed_session", body=body), "/seed_session")
        session_id, tools = answer.get("session_id"), answer.get("tools")
        if not isinstance(session_id, str) or not isinstance(tools, list):
            # NeMo Gym's resources servers answer {} here: they keep the session in their own cookie.
            raise ResourcesError(f"POST /seed_session: {self.url} answered without a session_id and tools "
                                 f"({json.dumps(answer)[:200]}): not a rollmarket resources server")
        self.session_id, self.tools = session_id, [str(tool) for tool in tools]
        return self.session_id

    def _read(self, response: httpx.Response, path: str) -> dict[str, Any]:
        """The JSON object a 2xx answer holds; a ResourcesError (status None: the server failed) otherwise."""
        try:
            answer = response.json()
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise ResourcesError(f"POST {path}: {self.url} answered {response.text[:200]!r}, not a JSON object")
        return answer

    def call_tool(self, name: str, arguments: dict[str, Any] | str, *, call_id: str | None = None) -> ToolResult:
        """Run one tool call in the session. A str is sent as the model wrote it (it may not be JSON)."""
        content = arguments.encode() if isinstance(arguments, str) else json.dumps(arguments).encode()
        headers = {CALL_ID_HEADER: call_id} if call_id else None
        return ToolResult.model_validate_json(self._post(f"/{name}", content=content, headers=headers).content)

    def verify(self, task: TaskSpec | None, answer: str | None,
               tool_calls: Sequence[ToolCallRecord] | None = None) -> VerifyResult:
        """Score `answer`; tool_calls None means the calls this session recorded."""
        body: dict[str, Any] = {"answer": answer}
        if task is not None:
            body["task"] = task.model_dump(mode="json")
        if tool_calls is not None:
            body["tool_calls"] = [call.model_dump(mode="json") for call in tool_calls]
        return self._verdict(self._post("/verify", body=body))

    def _verdict(self, response: httpx.Response) -> VerifyResult:
        try:
            return VerifyResult.model_validate(self._read(response, "/verify"))
        except ValidationError as exc:
            raise ResourcesError(f"POST /verify: {self.url} answered no VerifyResult ({exc.errors()[0]['msg']} at "
                                 f"{'.'.join(str(p) for p in exc.errors()[0]['loc'])})") from None

    def verify_trajectory(self, task: TaskSpec, trajectory: AgentTrajectory) -> VerifyResult:
        """Score a whole agent run (its final answer and its own tool calls)."""
        body = {"task": task.model_dump(mode="json"), "trajectory": trajectory.model_dump(mode="json")}
        return self._verdict(self._post("/verify", body=body))

    def close(self) -> None:
        """Close the session on the server (deleting its workspace), then the connection."""
        try:
            if self.session_id:
                self._post("/close_session")
        except ResourcesError:
            pass
        finally:
            self.session_id = None
            self._http.close()

    def __enter__(self) -> ResourcesClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
