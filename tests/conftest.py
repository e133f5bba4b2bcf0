from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# Training runs mirror to every installed tracker by default; under test W&B is off (as a user turns
# it off, with W&B's own variable) so that each run does not start a wandb-core process. The tracker
# tests ask for W&B by name, which starts it whatever this says.
os.environ.setdefault("WANDB_MODE", "disabled")

from helpers import ExchangeProcess  # noqa: E402

LONGEST_FIRST = ("test_vllm_reload", "test_fuzz", "test_train_resume", "test_demo", "test_vllm", "test_campaign",
                 "test_packaging", "test_vllm_observe", "test_train_ranks", "test_worker", "test_evals",
                 "test_ray_pool", "test_serve_engine_process", "test_crash", "test_decode_slots", "test_collect",
                 "test_train_loop", "test_replicas")
"""The modules that take longest (a `--durations` run of the whole suite), longest first. `make test`
spreads modules over two workers (`-n 2 --dist loadfile`), which take them in collection order: the
long ones go first, so that no worker is left with one of them at the end while the other idles."""


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: the rest keep their order


@pytest.fixture
def start_exchange(tmp_path):
    """Start real exchange processes; every one started is stopped after the test."""
    started: list[ExchangeProcess] = []

    def start(*args: str, db: Path | None = None) -> ExchangeProcess:
        server = ExchangeProcess(db=db or tmp_path / "exchange.db", log=tmp_path / "exchange.log",
                                 args=list(args))
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def exchange(start_exchange) -> ExchangeProcess:
    """One exchange with short TTLs so that expiry paths run in test time."""
    return start_exchange("--reaper-interval-s", "0.1")


@pytest.fixture(scope="module")
def browser():
    """Debian's chromium for the dashboard's browser tests (tests/dashboard_browser.py)."""
    from dashboard_browser import chromium

    with chromium() as browser:
        yield browser


@pytest.fixture
def page(browser, server):
    """A page on the module's `server` (a dashboard process) that must throw no script error and
    ask for nothing but that server."""
    from dashboard_browser import open_page

    context, page = open_page(browser)
    yield page
    assert not page.errors, page.errors
    assert all(u.startswith(server) for u in page.requests), [u for u in page.requests if not u.startswith(server)]
    context.close()


@pytest.fixture(scope="session")
def pg_cluster():
    """One throwaway PostgreSQL cluster for the session (tests/postgres.py)."""
    from postgres import Cluster

    with Cluster() as cluster:
        yield cluster


@pytest.fixture
def postgres_url(pg_cluster) -> str:
    """A fresh, empty database on the session's cluster."""
    return pg_cluster.create_database()
