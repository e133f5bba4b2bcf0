"""The observatory dashboard: `rollmarket dashboard --runs runs/` serves it, `--static DIR` exports it.

Server-rendered HTML from jinja2 templates with a little vanilla JS; every page has a `.json` twin
built from the same record (`data.py`); charts use Chart.js vendored under `static/vendor/`.
"""

from .app import create_dashboard_app
from .data import Runs
from .export import ExportSummary, export_static

__all__ = ["ExportSummary", "Runs", "create_dashboard_app", "export_static"]
