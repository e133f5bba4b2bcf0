"""The marketplace page (`/market`): an exchange's workers, decisions, rejections, lags, reload
latency, throughput and trainer idle time.

The numbers come from one place, `rollmarket.exchange.market.market_report`: a running exchange
computes them for `GET /v1/market` (read here with the official TrainerClient), and an exchange
database file (`--exchange-db`, or a training run's own `exchange.db` via `?run=<id>`) is opened
read-only and computed here. Nothing here imports torch.
"""

from __future__ import annotations

import re
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field

from ..contracts import MarketReport, Record
from .data import DashboardError, Missing
from .runs import RunKind
from .runs import find_run as find_training

EXCHANGE_DB = "exchange.db"
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")
REFRESH_S = 5.0
"""How often a served page re-reads its `.json` twin."""


class MarketPage(Record):
    """The `/market` page: where the numbers came from, and the exchange's MarketReport."""

    source: str = Field(description="exchange (a running exchange's /v1/market), db (a database file) or run "
                                    "(a training run's exchange.db).")
    where: str = Field(description="The exchange URL or the database path.")
    run_id: str | None = None
    refresh_s: float = Field(description="How often the served page re-reads this twin (seconds); 0 in a static "
                                         "export, which is a snapshot.")
    report: MarketReport


@dataclass(frozen=True)
class MarketSource:
    """Where `/market` (without ?run=) reads from: a running exchange, or a database file."""

    exchange_url: str | None = None
    trainer_token: str | None = None
    exchange_db: Path | None = None

    def __post_init__(self) -> None:
        if self.exchange_url and self.exchange_db:
            raise ValueError("give an exchange URL or an exchange database, not both")
        if self.exchange_url and not self.trainer_token:
            raise ValueError("an exchange URL needs the exchange's trainer token")


def db_report(path: Path) -> MarketReport:
    """The MarketReport of an exchange database file, opened read-only (nothing is written)."""
    from ..exchange.market import market_report, open_readonly

    if not Path(path).is_file():
        raise DashboardError(Missing.unreadable_exchange_db, f"no exchange database at {path}", path=str(path))
    try:
        conn = open_readonly(Path(path))
        try:
            return market_report(conn, time.time())
        finally:
            conn.close()
    except sqlite3.Error as exc:
        raise DashboardError(Missing.unreadable_exchange_db, f"{path} does not read as an exchange database: {exc}",
                          path=str(path)) from exc


def exchange_report(url: str, token: str) -> MarketReport:
    """The MarketReport of a running exchange, through its API (GET /v1/market)."""
    from ..client import ExchangeError, TrainerClient

    try:
        with TrainerClient(url, token, timeout=10.0, retries=1, wire="json") as client:
            return client.market()
    except (ExchangeError, OSError) as exc:
        raise DashboardError(Missing.exchange_unreachable, f"the exchange at {url} did not answer: {exc}",
                          exchange=url) from exc


def find_run(runs_dir: Path, run_id: str) -> Path:
    """The training run `run_id` under runs_dir that holds an exchange.db (runs.py's discovery)."""
    if not RUN_ID.fullmatch(run_id) or run_id in (".", ".."):
        raise DashboardError(Missing.run, f"{run_id!r} is not a run id", run_id=run_id[:128])
    path = find_training(runs_dir, run_id, (RunKind.train, RunKind.demo), EXCHANGE_DB)
    if path is None:
        raise DashboardError(Missing.run, f"no run {run_id!r} with an {EXCHANGE_DB} under {runs_dir}",
                          run_id=run_id)
    return path


def market_page(source: MarketSource | None, runs_dir: Path, run_id: str | None = None) -> MarketPage:
    """The `/market` page for a run's exchange.db (`run_id`), else for the dashboard's source."""
    if run_id is not None:
        path = find_run(runs_dir, run_id) / EXCHANGE_DB
        return MarketPage(source="run", where=str(path), run_id=run_id, refresh_s=REFRESH_S, report=db_report(path))
    if source is None or not (source.exchange_url or source.exchange_db):
        raise DashboardError(Missing.no_market, "no marketplace: start the dashboard with --exchange URL "
                                                   "--trainer-token T or --exchange-db PATH, or ask for ?run=<id>")
    if source.exchange_db is not None:
        return MarketPage(source="db", where=str(source.exchange_db), refresh_s=REFRESH_S,
                          report=db_report(source.exchange_db))
    return MarketPage(source="exchange", where=source.exchange_url, refresh_s=REFRESH_S,
                      report=exchange_report(source.exchange_url, source.trainer_token))

