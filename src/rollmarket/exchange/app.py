"""The exchange's HTTP API (FastAPI). Routes are thin: parse, authenticate, call the service.

Bodies may be JSON or msgpack (`Content-Type: application/msgpack`); responses follow the
`Accept` header. Every error is an ErrorBody with a typed code.
"""

from __future__ import annotations

import logging
import re
import time
from datetime import datetime, timezone
from contextlib import asynccontextmanager
from typing import Any

import swagger_ui_bundle
from fastapi import FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..bodies import add_component_schemas, json_body
from ..contracts import (
    AuditPage,
    EnqueueReceipt,
    ErrorBody,
    ErrorCode,
    FailureReport,
    FetchedGroup,
    FetchResult,
    GroupDecision,
    HeartbeatReply,
    LeaseGrant,
    MarketReport,
    PolicyManifest,
    PoolStatus,
    Record,
    ReloadAck,
    ReloadStatus,
    ReportReceipt,
    RolloutJob,
    RolloutLease,
    SampleGroup,
    SubmissionReceipt,
    Tier,
    TrainerFeedback,
    WorkerHeartbeat,
    WorkerManifest,
    WorkerRegistration,
    WorkerSummary,
)
from ..contracts.base import ID_MAX_LENGTH, ID_PATTERN, Identifier
from ..contracts.limits import INT64_MAX, MAX_COUNT, MAX_NAME_LENGTH, MAX_VERSION, Name
from ..contracts.wire import JSON, MSGPACK, embed, packb, unpackb
from .codec import clip, parse, respond, wants_msgpack
from .errors import ExchangeFault
from .service import Exchange
from .settings import ExchangeSettings
from .store import FetchFilter, StoredGroup, StoreError

log = logging.getLogger(__name__)

DOCS_ASSETS = "/docs/assets"
"""Where Swagger UI's files (the swagger-ui-bundle-v2 wheel's copy) are served, so /docs works offline."""


class JobBatch(Record):
    """Jobs to enqueue in one call; all or none are stored."""

    jobs: list[RolloutJob] = Field(min_length=1, max_length=10_000)


class EnqueueResult(Record):
    receipts: list[EnqueueReceipt] = Field(max_length=10_000)


class GroupReport(Record):
    """A trainer's decision on a group and its feedback on the worker; either may be omitted."""

    decision: GroupDecision | None = None
    feedback: TrainerFeedback | None = None


class GroupReportItem(GroupReport):
    """One group's report inside a batch."""

    group_id: Identifier


class ReportBatch(Record):
    """Reports on several groups in one call; all are recorded or none is."""

    reports: list[GroupReportItem] = Field(min_length=1, max_length=1024)


class ReportBatchResult(Record):
    receipts: list[ReportReceipt] = Field(max_length=1024)


class JobStateAnswer(Record):
    lease_id: Name
    job_state: Name = Field(description="queued (will be retried), failed or expired.")


class Health(Record):
    status: Name
    version: Name
    time: float
    leader: bool = Field(description="Whether this replica runs the singleton sweeps (the reaper) now.")


def _id_path(what: str):
    return Path(min_length=1, max_length=ID_MAX_LENGTH, pattern=ID_PATTERN, description=f"The {what}'s id.")


def _id_query(what: str):
    return Query(None, min_length=1, max_length=ID_MAX_LENGTH, pattern=ID_PATTERN, description=what)


_TRAINER_ID = re.compile(ID_PATTERN)


def _trainer_id(*candidates: str | None) -> str:
    """The first trainer id given (query, feedback, X-Trainer-Id header), else "default"; a header
    that is not an id is refused like any other malformed parameter."""
    for value in candidates:
        if value is not None:
            if len(value) > ID_MAX_LENGTH or not _TRAINER_ID.fullmatch(value):
                raise ExchangeFault(ErrorCode.invalid_request,
                                    "X-Trainer-Id must be an id: 1-128 of A-Z a-z 0-9 _ . : -",
                                    details={"errors": [{"loc": ["header", "x-trainer-id"],
                                                         "msg": "not an id"}]})
            return value
    return "default"


_CLIENT_MADE = (RecursionError, OverflowError, UnicodeError)
"""Exceptions that in this service only a client's values can cause (nesting, integers past 64
bits, unencodable strings). The contracts' limits stop them at the door; one that gets past them
is still the client's input, so the boundary answers 422, and logs it as the bug it also is."""


class _Boundary:
    """Pure ASGI middleware: the one place an unexpected exception becomes a typed answer.

    Starlette's own last-resort handler answers 500 and then re-raises, which makes uvicorn close
    the keep-alive connection; here the answer is sent and the exception stops, so the client's
    connection goes on serving. Every unexpected exception is logged with its traceback.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = [False]

        async def watch(message):
            if message["type"] == "http.response.start":
                started[0] = True
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as exc:
            if started[0]:
                raise  # half an answer is out: only closing the connection can end it
            if isinstance(exc, _CLIENT_MADE):
                log.error("a %s from a client's input got past the contracts on %s %s",
                          type(exc).__name__, scope["method"], scope["path"], exc_info=True)
                fault = ExchangeFault(ErrorCode.invalid_request,
                                      f"the request holds a value this exchange cannot store ({type(exc).__name__})")
            else:
                log.error("unhandled error on %s %s", scope["method"], scope["path"], exc_info=True)
                fault = ExchangeFault(ErrorCode.internal, f"internal error: {type(exc).__name__}")
            response = JSONResponse(fault.body().model_dump(mode="json"), status_code=fault.status)
            await response(scope, receive, send)


_ERRORS: dict[int | str, dict[str, Any]] = {status: {"model": ErrorBody, "description": text} for status, text in (
    (400, "Malformed body"), (401, "Missing or invalid token"), (403, "Not allowed for this token"),
    (404, "Not found"), (409, "Conflict"), (413, "Payload too large"), (415, "Unsupported media type"),
    (422, "Invalid or rejected"), (503, "The database is unavailable; try again"),
)}


def _body(model: type[BaseModel]) -> dict[str, Any]:
    return json_body(model, media_types=(JSON, MSGPACK))


_BODY_MODELS: list[type[BaseModel]] = [WorkerManifest, WorkerHeartbeat, FailureReport, SampleGroup,
                                       ReloadAck, PolicyManifest, JobBatch, GroupReport, ReportBatch]


class _Timing:
    """Pure ASGI middleware: request counts and latency per route template."""

    def __init__(self, app, exchange: Exchange):
        self.app = app
        self.exchange = exchange

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = [500]

        async def send_and_watch(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", "unmatched")
            metrics = self.exchange.metrics
            metrics.latency.labels(path, scope["method"]).observe(time.perf_counter() - start)
            metrics.requests.labels(path, scope["method"], str(status[0])).inc()


def _fetched_fields(stored: StoredGroup, active: int | None) -> dict[str, Any]:
    return {
        "tier": stored.tier, "status": stored.status,
        "received_at": _utc(stored.received_at), "lag_at_arrival": stored.lag_at_arrival,
        "current_lag": max(0, (active or 0) - stored.policy_version), "served_count": stored.served_count,
    }


def _fetched_msgpack(stored: StoredGroup, active: int | None) -> dict[str, Any]:
    # Stored bytes go out as they came in: no decode, no re-encode on the hot path.
    fields = _fetched_fields(stored, active)
    return {"group": embed(stored.payload), **{k: v.value if isinstance(v, Tier) else v for k, v in fields.items()}}


def _fetched(stored: StoredGroup, active: int | None) -> FetchedGroup:
    return FetchedGroup.model_validate({"group": SampleGroup.model_validate(unpackb(stored.payload)),
                                        **_fetched_fields(stored, active)})


def _utc(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, timezone.utc)


def create_app(settings: ExchangeSettings, exchange: Exchange | None = None) -> FastAPI:
    """The ASGI app of one exchange. The store opens when the app starts (lifespan)."""
    exchange = exchange or Exchange(settings)
    limit = settings.max_body_bytes

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await exchange.start()
        try:
            yield
        finally:
            await exchange.stop()

    app = FastAPI(
        title="rollmarket exchange",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,  # served below from the package's own copy of Swagger UI: no CDN
        redoc_url=None,
        description="Rollout workers lease jobs and submit sample groups with full provenance; "
        "trainers publish policies, enqueue jobs and fetch gated groups. Bodies are JSON or "
        "msgpack (application/msgpack, arrays as raw little-endian bytes).",
    )
    app.state.exchange = exchange
    app.add_middleware(_Boundary)
    app.add_middleware(_Timing, exchange=exchange)  # outermost: it also counts the boundary's answers
    app.mount(DOCS_ASSETS, StaticFiles(directory=str(swagger_ui_bundle.swagger_ui_path)), name="docs-assets")

    # -- errors ---------------------------------------------------------------------------
    @app.exception_handler(ExchangeFault)
    async def on_fault(request: Request, fault: ExchangeFault) -> Response:
        headers = {"WWW-Authenticate": "Bearer"} if fault.status == 401 else None
        return JSONResponse(fault.body().model_dump(mode="json"), status_code=fault.status, headers=headers)

    @app.exception_handler(StoreError)
    async def on_store_error(request: Request, exc: StoreError) -> Response:
        # PostgreSQL down or restarting: 503, which clients retry and fail over on (500 they do not).
        log.warning("store unavailable on %s %s: %s", request.method, request.url.path, exc)
        return await on_fault(request, ExchangeFault(ErrorCode.store_unavailable, str(exc)))

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> Response:
        errors = [{"loc": [clip(str(p), 64) for p in e.get("loc", ())], "msg": clip(str(e.get("msg")), 500)}
                  for e in exc.errors()[:20]]
        first = errors[0] if errors else {"loc": [], "msg": "invalid request"}
        fault = ExchangeFault(ErrorCode.invalid_request, f"{'.'.join(first['loc'])}: {first['msg']}",
                              details={"errors": errors})
        return await on_fault(request, fault)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> Response:
        code = ErrorCode.not_found if exc.status_code == 404 else ErrorCode.invalid_request
        body = ErrorBody.model_validate({"error": {"code": code, "message": clip(str(exc.detail), 500)}})
        return JSONResponse(body.model_dump(mode="json"), status_code=exc.status_code, headers=exc.headers)

    def authz(request: Request) -> str | None:
        return request.headers.get("authorization")

    # -- worker side ----------------------------------------------------------------------
    @app.post("/v1/workers/register", tags=["workers"], openapi_extra=_body(WorkerManifest),
              responses={201: {"model": WorkerRegistration}, **_ERRORS}, status_code=201)
    async def register_worker(request: Request) -> Response:
        """Register a worker; the answer carries its bearer token (shown once, stored hashed)."""
        exchange.check_registration(authz(request))
        manifest, _, _ = await parse(request, WorkerManifest, limit)
        return respond(request, await exchange.register(manifest), status=201)

    @app.post("/v1/workers/heartbeat", tags=["workers"], openapi_extra=_body(WorkerHeartbeat),
              responses={200: {"model": HeartbeatReply}, **_ERRORS})
    async def heartbeat(request: Request) -> Response:
        """Say the worker is alive; learn which policy to load and which leases no longer stand."""
        worker_id = await exchange.worker_of(authz(request))
        beat, _, _ = await parse(request, WorkerHeartbeat, limit)
        return respond(request, await exchange.heartbeat(worker_id, beat))

    @app.post("/v1/leases", tags=["workers"], responses={200: {"model": LeaseGrant}, **_ERRORS})
    async def lease(request: Request, wait_s: float = Query(0.0, ge=0, le=3600, allow_inf_nan=False,
                                                            description="Long-poll for work up to this many seconds "
                                                                        "(the exchange caps it at --max-lease-wait-s).")) -> Response:
        """Lease one job that fits this worker, or learn why there is none."""
        worker_id = await exchange.worker_of(authz(request))
        return respond(request, await exchange.lease(worker_id, wait_s))

    @app.post("/v1/leases/{lease_id}/renew", tags=["workers"],
              responses={200: {"model": RolloutLease}, **_ERRORS})
    async def renew_lease(request: Request, lease_id: str = _id_path("lease")) -> Response:
        """Extend a lease the worker still works on by another lease TTL (long agent rollouts)."""
        worker_id = await exchange.worker_of(authz(request))
        return respond(request, await exchange.renew(worker_id, lease_id))

    @app.post("/v1/leases/{lease_id}/fail", tags=["workers"], openapi_extra=_body(FailureReport),
              responses={200: {"model": JobStateAnswer}, **_ERRORS})
    async def fail_lease(request: Request, lease_id: str = _id_path("lease")) -> Response:
        """Give a lease back because the job could not be done; the job is re-queued or failed."""
        worker_id = await exchange.worker_of(authz(request))
        report, _, _ = await parse(request, FailureReport, limit)
        state = await exchange.fail(worker_id, lease_id, report)
        return respond(request, JobStateAnswer(lease_id=lease_id, job_state=state))

    @app.post("/v1/groups", tags=["workers"], openapi_extra=_body(SampleGroup),
              responses={200: {"model": SubmissionReceipt}, **_ERRORS})
    async def submit_group(request: Request) -> Response:
        """Submit the group for a lease. Idempotent per lease: the same group twice gets the same receipt."""
        worker_id = await exchange.worker_of(authz(request))
        group, body, kind = await parse(request, SampleGroup, limit)
        receipt = await exchange.submit(worker_id, group, body if kind == MSGPACK else None)
        return respond(request, receipt)

    @app.post("/v1/reload-acks", tags=["workers"], openapi_extra=_body(ReloadAck),
              responses={200: {"model": ReloadStatus}, **_ERRORS})
    async def ack_reload(request: Request) -> Response:
        """Confirm a policy version is loaded; a digest that contradicts the manifest is a 409 violation."""
        worker_id = await exchange.worker_of(authz(request))
        ack, _, _ = await parse(request, ReloadAck, limit)
        return respond(request, await exchange.ack_reload(worker_id, ack))

    # -- trainer side ---------------------------------------------------------------------
    @app.post("/v1/policies", tags=["trainer"], openapi_extra=_body(PolicyManifest),
              responses={200: {"model": PoolStatus}, **_ERRORS})
    async def publish_policy(request: Request, quorum: int | None = Query(None, ge=1, le=MAX_COUNT, description="Acks needed to activate; default from settings.")) -> Response:
        """Publish a new policy version; it becomes active once its reload quorum acks it."""
        await exchange.require_trainer(authz(request))
        manifest, _, _ = await parse(request, PolicyManifest, limit)
        return respond(request, await exchange.publish(manifest, quorum))

    @app.get("/v1/policies", tags=["trainer"], responses={200: {"model": list[PolicyManifest]}, **_ERRORS})
    async def list_policies(request: Request) -> Response:
        """Every published policy manifest, oldest first."""
        await exchange.require_trainer(authz(request))
        return respond(request, [p.model_dump(mode="json") for p in await exchange.policies()])

    @app.post("/v1/jobs", tags=["trainer"], openapi_extra=_body(JobBatch),
              responses={200: {"model": EnqueueResult}, **_ERRORS})
    async def enqueue_jobs(request: Request) -> Response:
        """Enqueue jobs. Idempotent per idempotency_key; a different job under a used key is a 409."""
        await exchange.require_trainer(authz(request))
        batch, _, _ = await parse(request, JobBatch, limit)
        return respond(request, EnqueueResult(receipts=await exchange.enqueue(batch.jobs)))

    @app.get("/v1/jobs", tags=["trainer"], responses={200: {"model": list[Any]}, **_ERRORS})
    async def list_jobs(request: Request, state: str | None = Query(None, max_length=32, description="queued, leased, done, failed or expired."),
                        limit: int = Query(100, ge=1, le=10_000)) -> Response:
        """Jobs with their state and attempts."""
        await exchange.require_trainer(authz(request))
        jobs = await exchange.store.jobs(state, limit)
        return respond(request, [j.model_dump(mode="json") for j in jobs])

    @app.get("/v1/groups", tags=["trainer"], responses={200: {"model": FetchResult}, **_ERRORS})
    async def fetch_groups(
        request: Request,
        tier: Tier = Query(Tier.fresh, description="fresh, replay or quarantine; the last two only when asked."),
        policy_version: int | None = Query(None, ge=0, le=MAX_VERSION, description="Only groups from this version."),
        max_staleness: int | None = Query(None, ge=0, le=MAX_VERSION, description="Only groups at most this many versions behind the active one."),
        precision_class: str | None = Query(None, max_length=MAX_NAME_LENGTH, description="Only groups rolled out at this precision."),
        limit: int = Query(16, ge=1, le=1024, description="Most groups returned."),
        include_served: bool = Query(False, description="Also return groups already served to this trainer."),
        newest_first: bool = Query(False, description="Newest arrivals first instead of oldest."),
        trainer_id: str | None = _id_query("Which trainer asks (or the X-Trainer-Id header)."),
    ) -> Response:
        """Fetch stored groups that fit the filters; each serving is counted per trainer."""
        await exchange.require_trainer(authz(request))
        who = _trainer_id(trainer_id, request.headers.get("x-trainer-id"))
        batch = await exchange.fetch(FetchFilter(
            trainer_id=who, tier=tier, policy_version=policy_version, max_staleness=max_staleness,
            precision_class=precision_class, limit=limit, include_served=include_served,
            newest_first=newest_first,
        ))
        as_msgpack = wants_msgpack(request)
        if as_msgpack:
            body = {"groups": [_fetched_msgpack(g, batch.active_version) for g in batch.groups],
                    "active_version": batch.active_version, "remaining": batch.remaining}
            return Response(packb(body), media_type=MSGPACK)
        return respond(request, FetchResult(groups=[_fetched(g, batch.active_version) for g in batch.groups],
                                            active_version=batch.active_version, remaining=batch.remaining))

    @app.get("/v1/groups/{group_id}", tags=["trainer"], responses={200: {"model": FetchedGroup}, **_ERRORS})
    async def get_group(request: Request, group_id: str = _id_path("group")) -> Response:
        """One stored group by id, for inspection; not counted as served."""
        await exchange.require_trainer(authz(request))
        stored = await exchange.group(group_id)
        pool = await exchange.pool()
        as_msgpack = wants_msgpack(request)
        if as_msgpack:
            return Response(packb(_fetched_msgpack(stored, pool.active_version)), media_type=MSGPACK)
        return respond(request, _fetched(stored, pool.active_version))

    @app.post("/v1/groups/{group_id}/report", tags=["trainer"], openapi_extra=_body(GroupReport),
              responses={200: {"model": ReportReceipt}, **_ERRORS})
    async def report_group(request: Request, group_id: str = _id_path("group")) -> Response:
        """Record a trainer's decision on a group (moving it between tiers) and its feedback."""
        await exchange.require_trainer(authz(request))
        report, _, _ = await parse(request, GroupReport, limit)
        trainer_id = _trainer_id(report.feedback.trainer_id if report.feedback else None,
                                 request.headers.get("x-trainer-id"))
        return respond(request, await exchange.report(trainer_id, group_id, report.decision, report.feedback))

    @app.post("/v1/groups/reports", tags=["trainer"], openapi_extra=_body(ReportBatch),
              responses={200: {"model": ReportBatchResult}, **_ERRORS})
    async def report_groups(request: Request) -> Response:
        """Record decisions and feedback on several groups in one call (one write): all or none."""
        await exchange.require_trainer(authz(request))
        batch, _, _ = await parse(request, ReportBatch, limit)
        header = request.headers.get("x-trainer-id")
        reports = [(_trainer_id(item.feedback.trainer_id if item.feedback else None, header), item.group_id,
                    item.decision, item.feedback) for item in batch.reports]
        return respond(request, ReportBatchResult(receipts=await exchange.report_many(reports)))

    @app.get("/v1/pool", tags=["trainer"], responses={200: {"model": PoolStatus}, **_ERRORS})
    async def pool_status(request: Request) -> Response:
        """Active and published versions, reload quorum, workers, and job/lease/group counts."""
        await exchange.require_trainer(authz(request))
        return respond(request, await exchange.pool())

    @app.get("/v1/workers", tags=["trainer"], responses={200: {"model": list[WorkerSummary]}, **_ERRORS})
    async def list_workers(request: Request) -> Response:
        """Every registered worker with its status, alignment and feedback quality."""
        await exchange.require_trainer(authz(request))
        return respond(request, [w.model_dump(mode="json") for w in await exchange.workers()])

    @app.get("/v1/market", tags=["trainer"], responses={200: {"model": MarketReport}, **_ERRORS})
    async def market(request: Request) -> Response:
        """The marketplace: workers with their profile and record, decisions over time by worker and
        tier, rejection reasons, policy lag at arrival, reload-ack latency, accepted tokens/s and
        each trainer's idle fraction (read-only; the dashboard's /market page)."""
        await exchange.require_trainer(authz(request))
        return respond(request, await exchange.market())

    @app.get("/v1/audit", tags=["trainer"], responses={200: {"model": AuditPage}, **_ERRORS})
    async def audit(
        request: Request,
        since_seq: int = Query(0, ge=0, le=INT64_MAX, description="Return events after this sequence number."),
        kind: str | None = Query(None, max_length=MAX_NAME_LENGTH, description="Event kind, or a prefix ending in '*' such as 'lease.*'."),
        subject: str | None = Query(None, max_length=256, description="Only events about this id."),
        limit: int = Query(500, ge=1, le=10_000),
    ) -> Response:
        """The append-only audit log of every state change."""
        await exchange.require_trainer(authz(request))
        return respond(request, await exchange.audit(since_seq, kind, subject, limit))

    # -- operations -----------------------------------------------------------------------
    @app.get("/healthz", tags=["ops"], response_model=Health)
    async def healthz() -> Health:
        """Liveness: the process answers and its store is open."""
        return Health(status="ok", version=__version__, time=time.time(), leader=exchange.is_leader)

    @app.get("/docs", tags=["ops"], response_class=HTMLResponse, include_in_schema=False)
    async def docs() -> HTMLResponse:
        """Swagger UI over /openapi.json, with its scripts and styles served from the package."""
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json", title=f"{app.title} - API",
            swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js", swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png",
        )

    @app.get("/metrics", tags=["ops"], response_class=Response)
    async def metrics() -> Response:
        """Prometheus text exposition (docs/metrics.md lists every metric)."""
        return Response(await exchange.render_metrics(), media_type="text/plain; version=0.0.4")

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description,
                             routes=app.routes)
        add_component_schemas(schema, _BODY_MODELS)
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
