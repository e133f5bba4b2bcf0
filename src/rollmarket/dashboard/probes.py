"""The endpoint probe page (`/probe/<name>`): a report `rollmarket probe --out` saved under
`<runs>/probes/<name>.json`, capability by capability with its evidence.

The dashboard only reads saved reports; it never probes an endpoint itself (a page view must not
send requests to a model server).
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import Field, ValidationError

from ..agents.probe import ProbeReport
from ..contracts import Record
from .data import DashboardError, Missing

PROBES_DIR = "probes"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


class ProbePage(Record):
    """The `/probe/<name>` page: which file the report came from, and the report."""

    name: str
    path: str = Field(description="The saved report's file, relative to --runs.")
    report: ProbeReport


class ProbeEntry(Record):
    """A saved probe report as the runs index lists it."""

    name: str = Field(description="The file's name without .json: the report's id in `/probe/<name>`.")
    url: str | None = Field(description="The endpoint probed; None when the file is not a probe report.")
    model: str | None
    probed_at: str | None
    counts: dict[str, int] = Field(description="Capabilities by status (yes, partial, no).")
    error: str | None = Field(default=None, description="Why the file is not a probe report (its page answers 500).")


def probe_entries(runs_dir: Path) -> list[ProbeEntry]:
    """Every report saved under `<runs_dir>/probes/`, newest probe first (unreadable ones last, by name)."""
    out = []
    for name in saved_probes(runs_dir):
        try:
            report = probe_page(runs_dir, name).report
        except DashboardError as exc:
            out.append(ProbeEntry(name=name, url=None, model=None, probed_at=None, counts={}, error=exc.message))
            continue
        counts = {status: 0 for status in ("yes", "partial", "no")}
        for status in report.statuses().values():
            counts[status] += 1
        out.append(ProbeEntry(name=name, url=report.url, model=report.model, probed_at=report.probed_at,
                              counts=counts))
    readable = sorted((e for e in out if e.error is None), key=lambda e: (e.probed_at or "", e.name), reverse=True)
    return readable + [e for e in out if e.error is not None]


def saved_probes(runs_dir: Path) -> list[str]:
    """The names of the reports saved under `<runs_dir>/probes/`, sorted."""
    folder = Path(runs_dir) / PROBES_DIR
    return sorted(f.stem for f in folder.glob("*.json") if NAME.fullmatch(f.stem)) if folder.is_dir() else []


def probe_page(runs_dir: Path, name: str) -> ProbePage:
    """The saved report `<runs_dir>/probes/<name>.json`; a DashboardError when there is none or it
    does not read as a ProbeReport."""
    file = Path(runs_dir) / PROBES_DIR / f"{name}.json"
    if not NAME.fullmatch(name) or not file.is_file():
        raise DashboardError(Missing.probe, f"no saved probe report {name!r} under {PROBES_DIR}/", name=name)
    try:
        report = ProbeReport.model_validate_json(file.read_text())
    except (ValidationError, UnicodeDecodeError) as exc:
        raise DashboardError(Missing.unreadable_probe, f"{PROBES_DIR}/{name}.json is not a probe report: "
                             f"{exc.__class__.__name__}", name=name) from None
    return ProbePage(name=name, path=f"{PROBES_DIR}/{name}.json", report=report)
