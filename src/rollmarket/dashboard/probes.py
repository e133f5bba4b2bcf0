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
