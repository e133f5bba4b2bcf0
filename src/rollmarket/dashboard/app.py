"""The observatory dashboard as a FastAPI app: server-rendered pages, each with a `.json` twin.

    /                                           runs of every kind; ?kind=&status=&q=&sort=  (/index.json)
    /train/<run_id>                             a training run's curves; ?overlay=<id>,<id>
    /train/<run_id>/metrics.json                its metrics as columns; ?after=<step> gives the newer steps, ?keys=K… those
    /train/<run_id>/columns.json?keys=K…        whole columns the page did not carry (a chart the chooser adds)
    /runs/<run_id>                              matrices, worst token, length scaling, divergence
    /runs/<run_id>/trajectory/<rollout>/<id>    the viewer; ?trainer=<engine>&compare=<rollout engine>
    /train/<run_id>/rollouts                    generations.jsonl as a table; ?page=&per_page=&q=&sort=&… (rollouts.py)
    /train/<run_id>/rollouts.csv                the filtered table as CSV
    /train/<run_id>/rollouts/<row>              one generation's turns, tool output and tokens
    /metrics                                    what every number means
    /campaigns/<campaign_id>                    curves over seeds with 95% bands, runs, verdicts; ?metric=KEY…
    /questions                                  the research agenda's open questions, answered or open
    /market                                     the exchange's marketplace; ?run=<id>: a run's exchange.db
    /probe/<name>                               a saved endpoint probe report (<runs>/probes/<name>.json)
    /healthz                                    liveness
"""

from __future__ import annotations

import time
from pathlib import Path

from fastapi import FastAPI, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles

from ..contracts import Record
from ..contracts.errors import ErrorBody, ErrorDetail
from .campaigns import Campaigns
from .data import DashboardError, Runs, TrajectoryRef
from .market import MarketSource, market_page
from .metrics import metrics_page
from .probes import probe_page
from .pages import STATIC, Linker, Page, Renderer
from .runs import RunIndex, index_page
from .training import TrainingRuns, parse_after, parse_keys
from .rollouts import bad_parameter, generation_page, parse_query, rollouts_csv, rollouts_page
from .questions import questions_page


def _json(record: Record) -> Response:
    return Response(record.model_dump_json(), media_type="application/json")


def _error_body(exc: DashboardError) -> ErrorBody:
    details = {k: v for k, v in exc.details.items() if v is not None}
    return ErrorBody(error=ErrorDetail(code=exc.code, message=exc.message, reasons=[exc.missing.value],
                                       details=details))


class ServerTiming:
    """ASGI middleware: a `Server-Timing: app;dur=<ms>` header on every response, the time from the
    request to the response's start (the page built and serialized; not its transfer). The browser's
    devtools show it, and benchmarks/dashboard_open.py reads it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()

        async def timed_send(message):
            if message["type"] == "http.response.start":
                ms = (time.perf_counter() - started) * 1000
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"server-timing", f"app;dur={ms:.1f}".encode())]}
            await send(message)

        await self.app(scope, receive, timed_send)


def create_dashboard_app(runs_dir: Path, market: MarketSource | None = None) -> FastAPI:
    """The dashboard over every run under `runs_dir` (read on each request); `market` is the exchange
    (or its database file) the /market page shows."""
    runs = Runs(Path(runs_dir))
    index = RunIndex(Path(runs_dir), observatory_ids=runs.run_ids)
    training = TrainingRuns(index)
    campaigns = Campaigns(Path(runs_dir))
    renderer = Renderer()
    app = FastAPI(title="rollmarket dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.runs = runs
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.add_middleware(ServerTiming)

    def html(template: str, record: Record, here: Page) -> HTMLResponse:
        return HTMLResponse(renderer.render(template, record, Linker(here, static=False)))

    @app.exception_handler(DashboardError)
    async def dashboard_error(request: Request, exc: DashboardError) -> Response:
        body = _error_body(exc)
        if request.scope["path"].endswith((".json", ".csv")):  # data, not a page: the error as data too
            return JSONResponse(body.model_dump(mode="json"), status_code=exc.status_code)
        here = Linker(Page("raw", asset=request.scope["path"]), static=False)
        page = renderer.render("error.html", body, here, status=exc.status_code, code=exc.missing.value,
                               message=exc.message)
        return HTMLResponse(page, status_code=exc.status_code)

    @app.get("/healthz")
    def healthz() -> dict:
        return {"ok": True, "runs_dir": str(runs.runs_dir)}

    @app.get("/index.json")
    def index_json(kind: str | None = None, status: str | None = None, q: str | None = None,
                   sort: str | None = None) -> Response:
        return _json(index_page(index, runs.index_page(), kind=kind, status=status, q=q, sort=sort))

    @app.get("/", response_class=HTMLResponse)
    def index_html(request: Request, kind: str | None = None, status: str | None = None, q: str | None = None,
                   sort: str | None = None) -> HTMLResponse:
        page = index_page(index, runs.index_page(), kind=kind, status=status, q=q, sort=sort)
        return html("index.html", page, Page("index", query=request.url.query))

    # The `.json` routes come first: `{run_id}` alone would match 'x.json' too.
    @app.get("/train/{run_id}.json")
    def train_json(run_id: str, overlay: str | None = None) -> Response:
        return _json(training.page(run_id, overlay))

    @app.get("/train/{run_id}/metrics.json")
    def train_metrics(run_id: str, after: str | None = None,
                      keys: list[str] | None = Query(default=None)) -> Response:
        return _json(training.series(run_id, parse_after(after), parse_keys(keys)))

    @app.get("/train/{run_id}/columns.json")
    def train_columns(run_id: str, keys: list[str] | None = Query(default=None)) -> Response:
        return _json(training.columns(run_id, parse_keys(keys, required=True)))

    @app.get("/train/{run_id}", response_class=HTMLResponse)
    def train(request: Request, run_id: str, overlay: str | None = None) -> HTMLResponse:
        return html("train.html", training.page(run_id, overlay), Page.train(run_id, request.url.query))

    @app.get("/metrics.json")
    def metrics_json() -> Response:
        return _json(metrics_page())

    @app.get("/metrics", response_class=HTMLResponse)
    def metrics() -> HTMLResponse:
        return html("metrics.html", metrics_page(), Page.metrics())

    @app.get("/questions.json")
    def questions_json() -> Response:
        return _json(questions_page(campaigns))

    @app.get("/questions", response_class=HTMLResponse)
    def questions() -> HTMLResponse:
        return html("questions.html", questions_page(campaigns), Page.questions())

    @app.get("/campaigns/{campaign_id}.json")
    def campaign_json(campaign_id: str, metric: list[str] | None = Query(default=None)) -> Response:
        return _json(campaigns.page(campaign_id, metric))

    @app.get("/campaigns/{campaign_id}", response_class=HTMLResponse)
    def campaign(campaign_id: str, metric: list[str] | None = Query(default=None)) -> HTMLResponse:
        return html("campaign.html", campaigns.page(campaign_id, metric), Page.campaign(campaign_id, metric))

    @app.get("/market.json")
    def market_json(run: str | None = None) -> Response:
        return _json(market_page(market, runs.runs_dir, run))

    @app.get("/market", response_class=HTMLResponse)
    def market_html(run: str | None = None) -> HTMLResponse:
        return html("market.html", market_page(market, runs.runs_dir, run), Page.market(run))

    @app.get("/probe/{name}.json")
    def probe_json(name: str) -> Response:
        return _json(probe_page(runs.runs_dir, name))

    @app.get("/probe/{name}", response_class=HTMLResponse)
    def probe_html(name: str) -> HTMLResponse:
        return html("probe.html", probe_page(runs.runs_dir, name), Page.probe(name))

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

    def table_query(request: Request):
        return parse_query(dict(request.query_params))

    def row_number(row: str) -> int:
        if not row.isdigit():
            raise bad_parameter("row", f"row {row[:100]!r} is not a row number")
        return int(row)

    # `.json` and `.csv` first, as above.
    @app.get("/train/{run_id}/rollouts.json")
    def rollouts_json(run_id: str, request: Request) -> Response:
        return _json(rollouts_page(runs.runs_dir, run_id, table_query(request)))

    @app.get("/train/{run_id}/rollouts.csv")
    def rollouts_csv_file(run_id: str, request: Request) -> Response:
        query = table_query(request)
        chunks = rollouts_csv(runs.runs_dir, run_id, query)
        first = next(chunks)  # finds the run (or raises its typed 404) before the response starts
        return StreamingResponse(
            _prepend(first, chunks), media_type="text/csv; charset=utf-8",
            headers={"Content-Disposition": f'attachment; filename="{run_id}-rollouts.csv"'})

    @app.get("/train/{run_id}/rollouts", response_class=HTMLResponse)
    def rollouts(run_id: str, request: Request) -> HTMLResponse:
        page = rollouts_page(runs.runs_dir, run_id, table_query(request))
        return html("rollouts.html", page, Page.rollouts(run_id, page.query.params()))

    @app.get("/train/{run_id}/rollouts/{row}.json")
    def generation_json(run_id: str, row: str) -> Response:
        return _json(generation_page(runs.runs_dir, run_id, row_number(row)))

    @app.get("/train/{run_id}/rollouts/{row}", response_class=HTMLResponse)
    def generation(run_id: str, row: str) -> HTMLResponse:
        page = generation_page(runs.runs_dir, run_id, row_number(row))
        return html("rollout.html", page, Page.generation(run_id, page.generation.row))

    return app


def _prepend(first: str, rest):
    yield first
    yield from rest
