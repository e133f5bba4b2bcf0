"""`rollmarket dashboard --static DIR`: every page as .html with its .json twin, and the assets,
linked relatively so the folder opens from file:// with no server and no network."""

from __future__ import annotations

import shutil
from pathlib import Path

from ..contracts import Record
from .data import Runs, TrajectoryRef
from .market import MarketPage, db_report
from .metrics import metrics_page
from .pages import STATIC, Linker, Page, Renderer, file_path


class ExportSummary(Record):
    out_dir: str
    pages: int
    runs: int
    trajectories: int


def export_static(runs_dir: Path, out_dir: Path, *, exchange_db: Path | None = None) -> ExportSummary:
    """Write the whole dashboard of `runs_dir` into `out_dir` (replacing what the export owns there);
    with `exchange_db`, its marketplace page too (a snapshot: the exported page does not refresh).

    Trajectory pages: every trajectory of every viewer file once per trainer engine, and the
    side-by-side pages of each divergence, from either engine's side, once per trainer."""
    runs = Runs(Path(runs_dir))
    out = Path(out_dir)
    index = runs.index_page()
    pages: list[tuple[Page, str, Record]] = [(Page.index(), "index.html", index),
                                             (Page.metrics(), "metrics.html", metrics_page())]
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
    exported = {file_path(p) for p, _, _ in pages} | {file_path(Page.trajectory(r)) for r in trajectories}

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
    for ref in trajectories:
        record = runs.trajectory_page(ref.run_id, ref.rollout_engine, ref.trajectory_id, trainer=ref.trainer_engine,
                                      compare=ref.compare)
        write(Page.trajectory(ref), "trajectory.html", record)
    return ExportSummary(out_dir=str(out), pages=len(pages) + len(trajectories),
                         runs=sum(1 for p, _, _ in pages if p.kind == "run"),
                         trajectories=len(trajectories))
