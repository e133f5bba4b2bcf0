"""The agent server: the agent loop over HTTP, against a model server and a resources server by URL.

    GET  /healthz   liveness, version, the loop, the model and resources URLs
    POST /run       {"task", "sampling", "sample_index"} -> {"trajectory", "reward", "loop"}
                    or NeMo Gym's {"responses_create_params", <task fields>} -> Gym's verify response

Each run opens its own resources session (`/seed_session`, its own cookie and header), so runs in
flight at once never see each other's files or tool calls. The loop is `tool` (call the model, run
its tool calls in the session, until it answers) or `single` (one model call without tools, then
/verify). Errors are typed ErrorBody answers: 400 for a body that is not JSON, 422 for one that does
not fit (or a task the resources server refuses), 502 when the model or resources server fails.
A refused request opens nothing and leaves no session behind.

Which shape answers: the request's own, unless `?shape=gym` or `?shape=rollmarket` says otherwise.
A Gym answer carries ours beside it under `rollmarket`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .. import __version__
from ..bodies import BodyError, json_body, parse_json, read_body
from ..contracts import (
    AgentTrajectory,
    ErrorBody,
    ErrorCode,
    ErrorDetail,
    Record,
    SamplingConfig,
    TaskSpec,
    TerminalReason,
)
from ..contracts.limits import Count
from ..verifiers.client import ResourcesClient, ResourcesError
from ..verifiers.server import Fault, install_fault_handlers
from .gym import GYM_KEY, GymBodyError, gym_response, gym_task, is_gym_body
from .loop import Agent, AgentSettings, task_messages
from .model import ChatModel, ModelCallError, Sampling
from .toolbox import RemoteToolbox
from .tools import UnknownTool

log = logging.getLogger(__name__)

Loop = Literal["tool", "single"]


class AgentServerSettings(BaseModel):
    """Settings of one agent server process."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_url: str = Field(description="OpenAI-compatible model server, e.g. http://127.0.0.1:8000/v1.")
    resources_url: str = Field(description="Resources server (`rollmarket verifier serve`) for tools and /verify.")
    loop: Loop = Field("tool", description="tool: the tool-calling loop; single: one model call, then /verify.")
    model: str | None = Field(None, description="Model name to request (default: the server's first).")
    max_steps: int = Field(6, ge=1, description="Model turns per run of the tool loop.")
    host: str = Field("127.0.0.1", description="Interface to listen on.")
    port: int = Field(8003, ge=0, le=65535, description="TCP port.")
    run_threads: int = Field(64, ge=1, description="Runs in flight at once; more wait for a thread.")
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="Largest request body accepted (413 beyond).")


class RunRequest(Record):
    """Body of POST /run in rollmarket's shape."""

    task: TaskSpec
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="How every turn samples.")
    sample_index: Count = Field(0, description="Which sample of the task this is (with the seed: each turn's seed).")


class RunResponse(Record):
    """Answer of POST /run in rollmarket's shape."""

    trajectory: AgentTrajectory = Field(description="The run: every turn's token ids, logprobs, routed experts, "
                                                    "and its verification.")
    reward: float
    loop: Loop


class GymRunResponse(BaseModel):
    """Answer of POST /run in NeMo Gym's shape (its BaseVerifyResponse): the request's fields too."""

    model_config = ConfigDict(extra="allow")

    responses_create_params: dict[str, Any]
    response: dict[str, Any] = Field(description="A Responses API object; model items carry prompt_token_ids, "
                                                 "generation_token_ids and generation_log_probs.")
    reward: float
    rollmarket: RunResponse = Field(description="The same run in rollmarket's shape.")


class Upstream(Exception):
    """The model or resources server failed a run; answered 502."""


def sampling_of(config: SamplingConfig) -> Sampling:
    """The loop's Sampling of a job's or request's SamplingConfig."""
    return Sampling(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
                    max_tokens=config.max_tokens, seed=config.seed, stop=tuple(config.stop))


class AgentRunner:
    """Runs one task on the configured loop and verifies it; thread-safe (one model client for all)."""

    def __init__(self, settings: AgentServerSettings):
        self.settings = settings
        self.model = ChatModel(settings.model_url, settings.model)
        steps = settings.max_steps if settings.loop == "tool" else 1
        self.agent = Agent(self.model, RemoteToolbox(settings.resources_url), AgentSettings(max_steps=steps))

    def run(self, task: TaskSpec, sampling: SamplingConfig, sample_index: int) -> AgentTrajectory:
        """One verified run. Raises Fault (422: the resources server refused the task) or Upstream."""
        offered = task if self.settings.loop == "tool" else task.model_copy(update={"tools": []})
        try:
            self.agent.toolbox.schemas(list(offered.tools))
        except UnknownTool as exc:
            raise Fault(ErrorCode.invalid_request, f"task.tools: {exc}") from None
        try:
            run = self.agent.run(offered, sampling_of(sampling), sample_index=sample_index)
            if run.terminal_reason is TerminalReason.model_error:
                raise Upstream(f"model server {self.settings.model_url}: {run.error}")
            with ResourcesClient(self.settings.resources_url) as client:
                verdict = client.verify_trajectory(task, run)
        except ResourcesError as exc:
            if exc.status is not None and 400 <= exc.status < 500:
                raise Fault(ErrorCode.invalid_request, f"the resources server refused the task: {exc.message}",
                            {"upstream_status": exc.status, "upstream_code": exc.code}) from None
            raise Upstream(f"resources server {self.settings.resources_url}: {exc}") from None
        except ModelCallError as exc:  # the model server never answered even /v1/models
            raise Upstream(f"model server {self.settings.model_url}: {exc}") from None
        return run.model_copy(update={"verification": verdict})

    def close(self) -> None:
        self.model.close()


def _invalid(exc: ValidationError) -> Fault:
    errors = [{"loc": [str(p) for p in e["loc"]], "msg": e["msg"]} for e in exc.errors()[:20]]
    return Fault(ErrorCode.invalid_request, f"{'.'.join(errors[0]['loc']) or 'body'}: {errors[0]['msg']}",
                 {"errors": errors})


def create_agent_app(settings: AgentServerSettings, runner: AgentRunner | None = None) -> FastAPI:
    """The ASGI app of one agent server."""
    runner = runner or AgentRunner(settings)
    pool = ThreadPoolExecutor(settings.run_threads, thread_name_prefix="agent-run")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            yield
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            runner.close()

    app = FastAPI(title="rollmarket agent server", version=__version__, lifespan=lifespan,
                  description=f"The {settings.loop} loop against {settings.model_url} and {settings.resources_url}.")

    install_fault_handlers(app, log)

    @app.exception_handler(Upstream)
    async def on_upstream(request: Request, exc: Upstream) -> Response:
        body = ErrorBody(error=ErrorDetail(code=ErrorCode.upstream_error, message=str(exc)))
        return JSONResponse(body.model_dump(mode="json"), status_code=502)

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        """Liveness: status, version, time, the loop and the servers it uses."""
        return JSONResponse({"status": "ok", "version": __version__, "time": time.time(), "loop": settings.loop,
                             "model_url": settings.model_url, "resources_url": settings.resources_url})

    @app.post("/run", response_model=RunResponse | GymRunResponse, openapi_extra=json_body(RunRequest),
              responses={status: {"model": ErrorBody, "description": text} for status, text in (
                  (400, "Malformed body"), (413, "Body too large"),
                  (422, "Invalid request, or a task the resources server refuses"),
                  (502, "The model or resources server failed"))})
    async def run(request: Request, shape: Literal["gym", "rollmarket"] | None = None) -> Response:
        """Run the loop on one task and verify it; the answer's shape is the request's unless `shape` says."""
        try:
            data = parse_json(await read_body(request, settings.max_body_bytes))
        except BodyError as exc:
            code = ErrorCode.payload_too_large if exc.problem.value == "too_large" else ErrorCode.malformed_body
            raise Fault(code, str(exc), {"problem": exc.problem.value}) from None
        if not isinstance(data, dict):
            raise Fault(ErrorCode.invalid_request, f"the body must be a JSON object, not {type(data).__name__}")
        gym = is_gym_body(data)
        if gym:
            try:
                task, sampling = gym_task(data)
            except GymBodyError as exc:
                raise Fault(ErrorCode.invalid_request, str(exc)) from None
            except ValidationError as exc:
                raise _invalid(exc) from None
            body = RunRequest(task=task, sampling=sampling)
        else:
            try:
                body = RunRequest.model_validate(data)
            except ValidationError as exc:
                raise _invalid(exc) from None
        trajectory = await asyncio.get_running_loop().run_in_executor(
            pool, runner.run, body.task, body.sampling, body.sample_index)
        ours = RunResponse(trajectory=trajectory, reward=trajectory.reward, loop=settings.loop).model_dump(mode="json")
        if (shape or ("gym" if gym else "rollmarket")) == "rollmarket":
            return JSONResponse(ours)
        if not gym:  # a rollmarket request answered in Gym's shape: its task as a Gym row
            data = {GYM_KEY: {"input": task_messages(body.task)},
                    **body.task.model_dump(mode="json", exclude={"messages", "prompt", "tools"})}
        return JSONResponse({**gym_response(data, trajectory, body.task), "rollmarket": ours})

    return app


def serve(settings: AgentServerSettings, *, log_level: str = "info", access_log: bool = False) -> None:
    """Serve until interrupted."""
    import uvicorn

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = uvicorn.Config(create_agent_app(settings), host=settings.host, port=settings.port,
                            log_level=log_level, access_log=access_log, timeout_graceful_shutdown=5)
    uvicorn.Server(config).run()
