"""The JSON every benchmark writes beside its table: name, date, machine, arguments and rows."""

from __future__ import annotations

import json
import os
import platform
from datetime import datetime, timezone
from pathlib import Path


def write_result(out: Path, benchmark: str, args, rows: list[dict], machine: dict | None = None) -> None:
    """Write `rows` to `out` with what docs/render.py quotes as provenance (date, machine, load);
    `machine` adds to the machine's description (a GPU's name, library versions)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": benchmark, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_average": os.getloadavg(), **(machine or {})},
        "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2) + "\n")
