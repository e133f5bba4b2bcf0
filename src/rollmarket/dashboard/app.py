"""The observatory dashboard as a FastAPI app: server-rendered pages, each with a `.json` twin.

    /                                           runs, newest first        (/index.json)
    /runs/<run_id>                              matrices, worst token, length scaling, divergence
    /runs/<run_id>/trajectory/<rollout>/<id>    the viewer; ?trainer=<engine>&compare=<rollout engine>
    /metrics                                    what every number means
    /market                                     the exchange's marketplace; ?run=<id>: a run's exchange.db
    /healthz                                    liveness
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles

from ..contracts import Record
from ..contracts.errors import ErrorBody, ErrorCode, ErrorDetail
from .data import DashboardError, Missing, Runs, TrajectoryRef
from .market import MarketSource, market_page
from .metrics import metrics_page
from .pages import STATIC, Linker, Page, Renderer


def _json(record: Record) -> Response:
    return Response(record.model_dump_json(), media_type="application/json")


def _error_body(exc: DashboardError) -> ErrorBody:
    code = getattr(exc, "code", None) or (
        ErrorCode.internal if exc.missing is Missing.unreadable_run else ErrorCode.not_found)
    details = {k: v for k, v in exc.details.items() if v is not None}
    return ErrorBody(error=ErrorDetail(code=code, message=exc.message, reasons=[exc.missing.value], details=details))


def create_dashboard_app(runs_dir: Path, market: MarketSource | None = None) -> FastAPI:
    """The dashboard over every observatory run under `runs_dir` (read on each request); `market`
    is the exchange (or its database file) the /market page shows."""
    runs = Runs(Path(runs_dir))
    renderer = Renderer()
    app = FastAPI(title="rollmarket observatory dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.runs = runs
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    def html(template: str, record: Record, here: Page) -> HTMLResponse:
        return HTMLResponse(renderer.render(template, record, Linker(here, static=False)))

    @app.exception_handler(DashboardError)
    async def dashboard_error(request: Request, exc: DashboardError) -> Response:
        body = _error_body(exc)
        if request.scope["path"].endswith(".json"):
            return JSONResponse(body.model_dump(mode="json"), status_code=exc.status_code)
        here = Linker(Page("raw", asset=request.scope["path"]), static=False)
        page = renderer.render("error.html", body, here, status=exc.status_code, code=exc.missing.value,
                               message=exc.message)
        return HTMLResponse(page, status_code=exc.status_code)

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": True, "runs_dir": str(runs.runs_dir)}

    @app.get("/index.json")
    def index_json() -> Response:
        return _json(runs.index_page())

    @app.get("/", response_class=HTMLResponse)
    def index() -> HTMLResponse:
        return html("index.html", runs.index_page(), Page.index())

    @app.get("/metrics.json")
    def metrics_json() -> Response:
        return _json(metrics_page())

    @app.get("/metrics", response_class=HTMLResponse)
    def metrics() -> HTMLResponse:
        return html("metrics.html", metrics_page(), Page.metrics())

    @app.get("/market.json")
    def market_json(run: str | None = None) -> Response:
        return _json(market_page(market, runs.runs_dir, run))

    @app.get("/market", response_class=HTMLResponse)
    def market_html(run: str | None = None) -> HTMLResponse:
        return html("market.html", market_page(market, runs.runs_dir, run), Page.market(run))

    # The `.json` routes come first: `{run_id}` alone would match 'x.json' too.
    @app.get("/runs/{run_id}.json")
    def run_json(run_id: str) -> Response:
        return _json(runs.run_page(run_id))

    @app.get("/runs/{run_id}", response_class=HTMLResponse)
    def run(run_id: str) -> HTMLResponse:
        return html("run.html", runs.run_page(run_id), Page.run(run_id))

    @app.get("/runs/{run_id}/trajectory/{rollout}/{trajectory_id}.json")
    def trajectory_json(run_id: str, rollout: str, trajectory_id: str, trainer: str | None = None,
                        compare: str | None = None) -> Response:
        return _json(runs.trajectory_page(run_id, rollout, trajectory_id, trainer=trainer, compare=compare or None))

    @app.get("/runs/{run_id}/trajectory/{rollout}/{trajectory_id}", response_class=HTMLResponse)
    def trajectory(run_id: str, rollout: str, trajectory_id: str, trainer: str | None = None,
                   compare: str | None = None) -> HTMLResponse:
        page = runs.trajectory_page(run_id, rollout, trajectory_id, trainer=trainer, compare=compare or None)
        here = TrajectoryRef(run_id=run_id, rollout_engine=rollout, trajectory_id=trajectory_id, trainer_engine=trainer,
                             compare=compare or None)
        return html("trajectory.html", page, Page.trajectory(here))

    return app
