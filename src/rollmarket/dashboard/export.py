"""`rollmarket dashboard --static DIR`: every page as .html with its .json twin, and the assets,
linked relatively so the folder opens from file:// with no server and no network."""

from __future__ import annotations

import shutil
from pathlib import Path

from ..contracts import Record
from .campaigns import Campaigns
from .data import DashboardError, Runs, TrajectoryRef
from .market import MarketPage, db_report
from .metrics import metrics_page
from .probes import probe_page, saved_probes
from .pages import STATIC, Linker, Page, Renderer, file_path
from .runs import RunIndex, RunKind, index_page
from .training import TrainingRuns
from .rollouts import (EXPORT_PAGES, RolloutQuery, generation_page, rollouts_csv, rollouts_page,
                       training_runs)
from .questions import questions_page


class ExportSummary(Record):
    out_dir: str
    pages: int
    runs: int
    trajectories: int
    training: int = 0
    """Training (and demo) runs' curve pages."""
    rollout_pages: int = 0
    """Pages of training runs' rollouts tables (the first EXPORT_PAGES of each, with their rows' pages)."""
    campaigns: int = 0


def export_static(runs_dir: Path, out_dir: Path, *, exchange_db: Path | None = None) -> ExportSummary:
    """Write the whole dashboard of `runs_dir` into `out_dir` (replacing what the export owns there);
    with `exchange_db`, its marketplace page too (a snapshot: the exported page does not refresh).

    The index lists every kind of run; each training (and demo) run gets its page with its default
    charts' metrics inline and every other metric as `train/<run>/columns/<key>.js`.

    Trajectory pages: every trajectory of every viewer file once per trainer engine, and the
    side-by-side pages of each divergence, from either engine's side, once per trainer."""
    runs = Runs(Path(runs_dir))
    campaigns = Campaigns(Path(runs_dir))
    out = Path(out_dir)
    index = runs.index_page()
    run_index = RunIndex(Path(runs_dir), observatory_ids=runs.run_ids)
    every = index_page(run_index, index)
    pages: list[tuple[Page, str, Record]] = [(Page.index(), "index.html", every),
                                             (Page.metrics(), "metrics.html", metrics_page()),
                                             (Page.questions(), "questions.html", questions_page(campaigns))]
    # Campaign pages with their default curves (the metric chooser needs the server).
    campaign_pages = []
    for campaign_id in campaigns.ids():
        try:
            campaign_pages.append((Page.campaign(campaign_id), "campaign.html", campaigns.page(campaign_id)))
        except DashboardError:  # an unreadable campaign.json: the index lists it with its error, as the server does
            continue
    for name in saved_probes(runs_dir):
        try:
            pages.append((Page.probe(name), "probe.html", probe_page(runs_dir, name)))
        except DashboardError:  # not a probe report: the server answers it as unreadable_probe
            continue
    if exchange_db is not None:
        market = MarketPage(source="db", where=str(exchange_db), refresh_s=0, report=db_report(exchange_db))
        pages.append((Page.market(), "market.html", market))
    trajectories: list[TrajectoryRef] = []
    for summary in index.runs:
        if summary.error:
            continue
        run_page = runs.run_page(summary.run_id)
        pages.append((Page.run(summary.run_id), "run.html", run_page))
        trajectories += runs.trajectory_refs(summary.run_id)
        for row in run_page.divergence:
            if row.view is None:
                continue
            swapped = row.view.model_copy(update={"rollout_engine": row.view.compare,
                                                  "compare": row.view.rollout_engine})
            trajectories += [ref.model_copy(update={"trainer_engine": t})
                             for ref in (row.view, swapped) for t in run_page.trainer_engines]
    # Training pages carry their default charts' columns inline (from file:// a page cannot fetch its
    # twin); every other metric is a script of its own beside the page, loaded when it is chosen.
    training = TrainingRuns(run_index)
    trained = [e.run_id for e in every.entries if e.kind in (RunKind.train, RunKind.demo) and not e.error]
    train_pages = {run_id: training.page(run_id) for run_id in trained}
    pages += [(Page.train(run_id), "train.html", record) for run_id, record in train_pages.items()]
    # Rollouts: each training run's first EXPORT_PAGES table pages in file order, each of their rows'
    # generation pages, and the whole table as CSV (a filtered page needs the server).
    tables: list[tuple[Page, str, Record]] = []
    csvs: list[tuple[Page, str]] = []
    for run_dir in training_runs(runs_dir):
        run_id = run_dir.name
        for number in range(1, EXPORT_PAGES + 1):
            table = rollouts_page(runs_dir, run_id, RolloutQuery(page=number))
            tables.append((Page.rollouts(run_id, table.query.params()), "rollouts.html", table))
            tables += [(Page.generation(run_id, row.row), "rollout.html", generation_page(runs_dir, run_id, row.row))
                       for row in table.rows]
            if number >= table.pages:
                break
        csvs.append((Page.rollouts(run_id, csv=True), run_id))
    pages += tables + campaign_pages
    exported = ({file_path(p) for p, _, _ in pages} | {file_path(Page.trajectory(r)) for r in trajectories}
                | {file_path(p) for p, _ in csvs})

    renderer = Renderer()
    # Files are overwritten, never deleted: DIR may hold other things (even the runs themselves).
    out.mkdir(parents=True, exist_ok=True)
    shutil.copytree(STATIC, out / "static", dirs_exist_ok=True)

    def write(page: Page, template: str, record: Record) -> None:
        target = out / file_path(page)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(renderer.render(template, record, Linker(page, static=True, exported=exported)))
        (out / file_path(page, json_twin=True)).write_text(record.model_dump_json())

    for page, template, record in pages:
        write(page, template, record)
    for run_id, record in train_pages.items():
        for key in record.metrics.names:
            if key in record.metrics.columns:
                continue
            target = out / file_path(Page.train_columns(run_id, key))
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(f"rollmarketColumns({training.columns(run_id, [key]).model_dump_json()});\n")
    for page, run_id in csvs:
        with open(out / file_path(page), "w", encoding="utf-8", newline="") as f:
            f.writelines(rollouts_csv(runs_dir, run_id, RolloutQuery()))
    for ref in trajectories:
        record = runs.trajectory_page(ref.run_id, ref.rollout_engine, ref.trajectory_id, trainer=ref.trainer_engine,
                                      compare=ref.compare)
        write(Page.trajectory(ref), "trajectory.html", record)
    return ExportSummary(out_dir=str(out), pages=len(pages) + len(trajectories), runs=sum(1 for p, _, _ in pages if p.kind == "run"),
                         trajectories=len(trajectories), training=len(trained), rollout_pages=len(tables),
                         campaigns=len(campaign_pages))
