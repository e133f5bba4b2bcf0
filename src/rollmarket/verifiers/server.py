"""The resources server: tools and verifiers over HTTP, with per-session state (NeMo Gym's shape).

    GET  /healthz          liveness, version, open sessions
    GET  /tools            the OpenAI function schemas of every tool
    GET  /session          the caller's session: its task, tools and how many calls it recorded
    POST /seed_session     {"task": TaskSpec}, {} or a NeMo Gym run request -> {"session_id", "tools"}; sets the cookie
    POST /close_session    closes the caller's session and deletes its workspace
    POST /verify           {"task", "answer", "tool_calls"} or {"task", "trajectory"} -> VerifyResult;
                           NeMo Gym's {"responses_create_params", "response"} -> {..., "reward"}
    POST /<tool>           the arguments object -> ToolResult, run in the caller's session

The session travels in the `rollmarket_session` cookie or the `x-rollmarket-session` header (the
header wins). A tool call is model behaviour, so a bad one is data: unknown tools, tools the task
does not offer and arguments that are not a JSON object all answer 200 with a ToolResult whose
outcome says so, and are recorded. A bad request from the client (no session, a body that is not
JSON, a task that does not fit the contract or its verifier) is a typed ErrorBody and changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import Field, ValidationError, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..bodies import BodyError, add_component_schemas, json_body, parse_json, read_body
from ..contracts import (
    AgentTrajectory,
    ErrorBody,
    ErrorCode,
    ErrorDetail,
    Record,
    TaskSpec,
    ToolCallRecord,
    ToolOutcome,
    ToolResult,
    VerifyResult,
    new_id,
)
from ..contracts.limits import MAX_KEY_LENGTH, MAX_NAME_LENGTH, MAX_TEXT_LENGTH
from .builtin.llm_judge import check_judge_policy
from .gym import GymBodyError, GymVerifyRequest, final_answer, gym_answer, is_gym_body, read_gym_body, run_tool_calls
from .gym_rows import GymRowError, gym_extracted, gym_reward, has_row_fields, task_from_row
from .sessions import (
    CALL_ID_HEADER,
    SESSION_COOKIE,
    SESSION_HEADER,
    Session,
    SessionStore,
)
from .settings import ResourcesSettings
from .verifier import VerifierConfigError, get_verifier, verify_trajectory

log = logging.getLogger(__name__)

_STATUS = {ErrorCode.malformed_body: 400, ErrorCode.invalid_request: 422, ErrorCode.payload_too_large: 413,
           ErrorCode.unauthorized: 401, ErrorCode.not_found: 404, ErrorCode.internal: 500}


class SeedRequest(Record):
    """Body of POST /seed_session."""

    task: TaskSpec | None = Field(default=None, description="The task whose files and tools the session gets; "
                                  "none: an empty workspace and every tool.")


class SeedResponse(Record):
    session_id: str
    tools: list[str] = Field(description="The tools this session may call.")
    ttl_s: float = Field(description="The session closes after this many idle seconds.")


class VerifyRequest(Record):
    """Body of POST /verify: an answer (and tool calls), or a whole trajectory."""

    task: TaskSpec | None = Field(default=None, description="The task; default: the session's task.")
    answer: str | None = Field(default=None, description="The model's final answer.")
    tool_calls: list[ToolCallRecord] | None = Field(
        default=None, description="The run's tool calls; absent: the calls recorded in the caller's session.")
    trajectory: AgentTrajectory | None = Field(
        default=None, description="A whole run instead of answer and tool_calls (scored by verify_trajectory).")

    @model_validator(mode="after")
    def _one_form(self) -> VerifyRequest:
        if self.trajectory is not None and (self.answer is not None or self.tool_calls is not None):
            raise ValueError("give either a trajectory or answer/tool_calls, not both")
        return self


class CloseResponse(Record):
    session_id: str
    closed: bool


class SessionState(Record):
    """Answer of GET /session: what the caller's session holds."""

    session_id: str
    task_id: str | None = Field(description="The task the session was seeded with; none: an empty workspace.")
    tools: list[str] = Field(description="The tools this session may call.")
    recorded_calls: int = Field(description="Tool calls recorded for /verify.")
    unrecorded_calls: int = Field(description="Calls past --max-calls-per-session, run but not recorded.")


_ERRORS = {status: {"model": ErrorBody, "description": text} for status, text in (
    (400, "Malformed body"), (401, "No session"), (404, "Unknown, closed or expired session; unknown route"),
    (405, "Method not allowed"), (413, "Body too large"), (422, "Invalid request"))}


_TOOL_BODY = {"requestBody": {"required": False, "description": "The tool's arguments object (see GET /tools); "
                              "anything else is recorded as the model's mistake.",
                              "content": {"application/json": {"schema": {"type": "object"}}}}}


class Fault(Exception):
    """A request the server refuses, with the typed code the client sees."""

    def __init__(self, code: ErrorCode, message: str, details: dict[str, Any] | None = None):
        super().__init__(message)
        self.code, self.message, self.details = code, message, details or {}

    def response(self) -> JSONResponse:
        body = ErrorBody(error=ErrorDetail(code=self.code, message=self.message, details=self.details))
        return JSONResponse(body.model_dump(mode="json"), status_code=_STATUS[self.code])


async def _body(request: Request, limit: int) -> bytes:
    try:
        return await read_body(request, limit)
    except BodyError as exc:
        raise Fault(ErrorCode.payload_too_large, str(exc)) from None


def _json(body: bytes) -> Any:
    if not body.strip():
        return {}
    try:
        return parse_json(body)
    except BodyError as exc:
        raise Fault(ErrorCode.malformed_body, f"malformed JSON: {exc}", {"problem": exc.problem.value}) from None


def _validate(model: type[Record], data: Any) -> Any:
    if not isinstance(data, dict):
        raise Fault(ErrorCode.invalid_request, f"the body must be a JSON object, not {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = [{"loc": [str(p) for p in e["loc"]], "msg": e["msg"]} for e in exc.errors()[:20]]
        first = errors[0]
        raise Fault(ErrorCode.invalid_request, f"{'.'.join(first['loc']) or 'body'}: {first['msg']}",
                    {"errors": errors}) from None


def install_fault_handlers(app: FastAPI, log: logging.Logger) -> None:
    """The typed error answers a service built on Fault gives: its Fault as is, a body that does not
    fit as invalid_request (422) with the first field named, a routing refusal (404/405) typed, and
    any bug as a logged internal error (500) without a traceback on the wire."""

    @app.exception_handler(Fault)
    async def on_fault(request: Request, fault: Fault) -> Response:
        return fault.response()

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> Response:
        errors = [{"loc": [str(p) for p in e.get("loc", ())], "msg": e.get("msg")} for e in exc.errors()[:20]]
        first = errors[0] if errors else {"loc": [], "msg": "invalid request"}
        return Fault(ErrorCode.invalid_request, f"{'.'.join(first['loc'])}: {first['msg']}",
                     {"errors": errors}).response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> Response:
        code = ErrorCode.not_found if exc.status_code == 404 else ErrorCode.invalid_request
        body = ErrorBody(error=ErrorDetail(code=code, message=str(exc.detail)))
        return JSONResponse(body.model_dump(mode="json"), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def on_crash(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return Fault(ErrorCode.internal, f"internal error: {type(exc).__name__}").response()


def session_id_of(request: Request) -> str | None:
    """The caller's session id: the x-rollmarket-session header, else the rollmarket_session cookie."""
    return request.headers.get(SESSION_HEADER) or request.cookies.get(SESSION_COOKIE)


def create_resources_app(settings: ResourcesSettings | None = None) -> FastAPI:
    """The ASGI app of one resources server."""
    from ..agents.tools import TOOLS, PythonEval, SandboxLimits, run_tool, tool_schemas
    from ..agents.workspace import task_workspace

    settings = settings or ResourcesSettings()
    tool_impls = {**TOOLS, PythonEval.name: PythonEval(SandboxLimits(timeout_s=settings.python_eval_timeout_s))}
    tool_names = sorted(tool_impls)

    def run(name: str, arguments: Any, context: Any) -> ToolResult:
        tool = tool_impls.get(name)
        return tool(arguments, context) if tool is not None else run_tool(name, arguments, context)

    store = SessionStore(ttl_s=settings.session_ttl_s, max_sessions=settings.max_sessions,
                         max_calls=settings.max_calls_per_session, open_workspace=task_workspace)
    pool = ThreadPoolExecutor(settings.tool_threads, thread_name_prefix="resources")

    async def in_pool(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def reaper() -> None:
        while True:
            await asyncio.sleep(settings.reap_interval_s)
            try:
                closed = await in_pool(store.reap)
            except Exception:  # keep reaping whatever one pass hit
                log.exception("session reaper failed")
                continue
            if closed:
                log.info("closed %d expired sessions", closed)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(reaper())
        try:
            yield
        finally:
            task.cancel()
            await in_pool(store.close_all)
            pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="rollmarket resources server", version=__version__, lifespan=lifespan,
                  description="Tools and verifiers over HTTP with per-session state (cookie "
                  f"{SESSION_COOKIE} or header {SESSION_HEADER}).")
    app.state.sessions = store
    app.state.settings = settings

    install_fault_handlers(app, log)

    def caller(request: Request) -> Session:
        session_id = session_id_of(request)
        if not session_id:
            raise Fault(ErrorCode.unauthorized, f"no session: POST /seed_session first, then send the "
                        f"{SESSION_COOKIE} cookie or the {SESSION_HEADER} header")
        session = store.get(session_id)
        if session is None:
            raise Fault(ErrorCode.not_found, "unknown, closed or expired session")
        return session

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        """Liveness: status, version, time and the number of open sessions."""
        return JSONResponse({"status": "ok", "version": __version__, "time": time.time(), "sessions": len(store)})

    @app.get("/tools")
    async def list_tools() -> JSONResponse:
        """The OpenAI function-tool schema of every tool this server runs."""
        return JSONResponse({"tools": tool_schemas(tool_names)})

    @app.post("/seed_session", response_model=SeedResponse, responses=_ERRORS,
              openapi_extra=json_body(SeedRequest, required=False))
    async def seed_session(request: Request) -> Response:
        """Open a session for a task: a private copy of its files, its own tool state and call record."""
        payload = _json(await _body(request, settings.max_body_bytes))
        task = seed_gym(payload) if isinstance(payload, dict) and "responses_create_params" in payload \
            else _validate(SeedRequest, payload).task
        if task is not None:
            unknown = [name for name in task.tools if name not in tool_impls]
            if unknown:
                raise Fault(ErrorCode.invalid_request, f"task {task.task_id} names tools this server does not "
                            f"have: {', '.join(unknown)} (it has {', '.join(tool_names)})")
            try:
                get_verifier(task.verifier).check(task)
            except VerifierConfigError as exc:
                raise Fault(ErrorCode.invalid_request, str(exc)) from None
        try:
            session = await in_pool(store.open, task)
        except ValueError as exc:  # agents.workspace.UnsafeTaskPath: a file path outside the task directory
            raise Fault(ErrorCode.invalid_request, str(exc)) from None
        answer = SeedResponse(session_id=session.id, tools=session.tools or tool_names, ttl_s=settings.session_ttl_s)
        response = JSONResponse(answer.model_dump(mode="json"))
        response.set_cookie(SESSION_COOKIE, session.id, httponly=True, samesite="lax")
        return response

    @app.post("/close_session", response_model=CloseResponse, responses=_ERRORS)
    async def close_session(request: Request) -> Response:
        """Close the caller's session and delete its workspace (after any call still running)."""
        session = caller(request)
        closed = await in_pool(store.close, session.id)
        response = JSONResponse(CloseResponse(session_id=session.id, closed=closed).model_dump(mode="json"))
        response.delete_cookie(SESSION_COOKIE)
        return response

    @app.post("/verify", response_model=VerifyResult, responses=_ERRORS, openapi_extra=json_body(VerifyRequest))
    async def verify_route(request: Request) -> Response:
        """Score an answer with the task's verifier. Without tool_calls, the session's recorded calls are used.

        A NeMo Gym body (`responses_create_params` + `response`) is answered in Gym's shape."""
        payload = _json(await _body(request, settings.max_body_bytes))
        if is_gym_body(payload):
            return await verify_gym(request, payload)
        body = _validate(VerifyRequest, payload)
        session = caller(request) if session_id_of(request) else None
        task = body.task or (session.task if session is not None else None)
        if task is None:
            raise Fault(ErrorCode.invalid_request, "task: required (the session has no task)")
        try:
            check_judge_policy(task, settings.judge_url_list)
        except VerifierConfigError as exc:
            raise Fault(ErrorCode.invalid_request, str(exc)) from None
        source = "request"
        if body.trajectory is not None:
            work, args = verify_trajectory, (task, body.trajectory)
            source = "trajectory"
        else:
            calls = body.tool_calls
            if calls is None:
                calls, source = (session.recorded(), "session") if session is not None else ([], "none")
            verifier = _verifier(task)
            work, args = (lambda: verifier.verify(task, body.answer, tool_calls=calls)), ()
        try:
            verdict = await in_pool(work, *args)
        except VerifierConfigError as exc:
            raise Fault(ErrorCode.invalid_request, str(exc)) from None
        return JSONResponse(verdict.model_dump(mode="json"), headers={"x-rollmarket-tool-calls": source})

    def seed_gym(payload: dict[str, Any]) -> TaskSpec | None:
        """The task of a NeMo Gym seed body: Gym's agents send the whole run request (a dataset row) to
        /seed_session. Its `task`, else its row's fields; a row with neither opens a session with no task."""
        if payload.get("task") is not None:
            return _validate(SeedRequest, {"task": payload["task"]}).task
        if not has_row_fields(payload):
            return None
        try:
            return task_from_row(payload, settings.gym_dataset)
        except GymRowError as exc:
            raise Fault(ErrorCode.invalid_request, str(exc), {"shape": "nemo_gym",
                                                              "gym_dataset": settings.gym_dataset}) from None

    async def verify_gym(request: Request, payload: dict[str, Any]) -> Response:
        try:
            body = read_gym_body(payload)
            answer, calls = final_answer(body), run_tool_calls(body)
        except GymBodyError as exc:
            raise Fault(ErrorCode.invalid_request, str(exc), {"shape": "nemo_gym"}) from None
        session = caller(request) if session_id_of(request) else None
        task = body.task
        if task is None and has_row_fields(payload):  # the row's own fields, as Gym's servers read them
            try:
                task = task_from_row(payload, settings.gym_dataset)
            except GymRowError as exc:
                raise Fault(ErrorCode.invalid_request, str(exc), {"shape": "nemo_gym", "gym_dataset":
                                                                  settings.gym_dataset}) from None
        task = task or (session.task if session is not None else None)
        if task is None:
            raise Fault(ErrorCode.invalid_request, "task: required beside a NeMo Gym body: a `task`, the fields of "
                        "a Gym dataset row (expected_answer, options, verifier_metadata, instruction_id_list) or a "
                        "seeded session", {"shape": "nemo_gym"})
        try:
            check_judge_policy(task, settings.judge_url_list)
        except VerifierConfigError as exc:
            raise Fault(ErrorCode.invalid_request, str(exc)) from None
        source = "response"
        if calls is None:
            calls, source = (session.recorded(), "session") if session is not None else ([], "none")
        verifier = _verifier(task)
        try:
            verdict = await in_pool(lambda: verifier.verify(task, answer, tool_calls=calls))
        except VerifierConfigError as exc:
            raise Fault(ErrorCode.invalid_request, str(exc)) from None
        answered = gym_answer(payload, verdict, gym_reward(task, verdict), gym_extracted(task, verdict, answer))
        return JSONResponse(answered, headers={"x-rollmarket-tool-calls": source})

    def _verifier(task: TaskSpec):
        try:
            return get_verifier(task.verifier)
        except VerifierConfigError as exc:
            raise Fault(ErrorCode.invalid_request, str(exc)) from None

    @app.get("/session", response_model=SessionState, responses=_ERRORS)
    async def session_state(request: Request) -> Response:
        """The caller's session: its task, the tools it may call and how many calls it recorded."""
        session = caller(request)
        state = SessionState(session_id=session.id, task_id=session.task.task_id if session.task else None,
                             tools=session.tools or tool_names, recorded_calls=len(session.recorded()),
                             unrecorded_calls=session.unrecorded_calls)
        return JSONResponse(state.model_dump(mode="json"))

    @app.post("/{tool_name}", response_model=ToolResult, responses=_ERRORS, openapi_extra=_TOOL_BODY)
    async def call_tool(tool_name: str, request: Request) -> Response:
        """Run one tool call in the caller's session; the body is the arguments object."""
        session = caller(request)
        call_id = request.headers.get(CALL_ID_HEADER)
        if call_id is not None and len(call_id) > MAX_KEY_LENGTH:
            raise Fault(ErrorCode.invalid_request, f"{CALL_ID_HEADER} is longer than {MAX_KEY_LENGTH} characters")
        if len(tool_name) > MAX_NAME_LENGTH:  # no tool has such a name, and no record could hold it
            raise Fault(ErrorCode.not_found, f"no tool has a name of {len(tool_name)} characters "
                                             f"(at most {MAX_NAME_LENGTH})")
        raw = (await _body(request, settings.max_body_bytes)).decode("utf-8", errors="replace")
        if len(raw) > MAX_TEXT_LENGTH:  # the call's record keeps the arguments as written
            raise Fault(ErrorCode.payload_too_large, f"arguments of {len(raw)} characters exceed the limit "
                                                     f"of {MAX_TEXT_LENGTH}")
        try:
            parsed = parse_json(raw) if raw.strip() else {}
        except BodyError:
            parsed = None
        arguments = parsed if isinstance(parsed, dict) else None
        offered = session.tools
        if not session.enter():
            raise Fault(ErrorCode.not_found, "the session was closed")
        try:
            if offered is not None and tool_name not in offered:
                result = ToolResult(name=tool_name, content=f"error: unknown tool: {tool_name} "
                                    f"(available: {', '.join(offered)})", outcome=ToolOutcome.unknown_tool)
            else:
                result = await in_pool(run, tool_name, arguments if arguments is not None else raw, session.context)
        finally:
            session.leave()
        session.record(ToolCallRecord(id=call_id or new_id("call"), name=tool_name,
                                      raw_arguments=raw, arguments=arguments, result=result))
        return JSONResponse(result.model_dump(mode="json"))

    def openapi() -> dict[str, Any]:
        """FastAPI's schema, plus the bodies the routes read themselves and one path per tool."""
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        add_component_schemas(schema, [SeedRequest, VerifyRequest, GymVerifyRequest])
        generic = schema["paths"]["/{tool_name}"]["post"]
        for tool in tool_schemas(tool_names):
            function = tool["function"]
            operation = {key: value for key, value in generic.items() if key != "parameters"}
            operation.update(summary=f"Call {function['name']}", description=function.get("description", ""),
                             operationId=f"call_{function['name']}",
                             requestBody={"required": True, "content": {"application/json": {
                                 "schema": function["parameters"]}}})
            schema["paths"].setdefault(f"/{function['name']}", {})["post"] = operation
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def serve(settings: ResourcesSettings, *, log_level: str = "info", access_log: bool = False) -> None:
    """Serve until interrupted; every session's workspace is deleted on shutdown."""
    import uvicorn

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = uvicorn.Config(create_resources_app(settings), host=settings.host, port=settings.port,
                            log_level=log_level, access_log=access_log, timeout_graceful_shutdown=5)
    uvicorn.Server(config).run()
