"""The marketplace page (`/market`) against a real exchange process with real worker clients.

The module drives one `rollmarket exchange serve` through the official clients: two workers with
different profiles deliver groups (one of them late, one refused at submission), a policy version
is published and acked, and a trainer fetches and decides. Every expected number is computed here
from what the clients sent and were answered (and, for times, from the exchange's audit log), never
by the code under test. The same numbers must come from the exchange's API (`--exchange`), from
its database file (`--exchange-db`) and from a run directory's copy (`?run=`); Chromium draws the
page, follows the exchange live, and opens the static export from file://.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from dashboard_browser import dashboard_process, open_page, shot
from helpers import TRAINER_TOKEN, ExchangeProcess, job, lease_one, policy, ready_worker, sha, trajectories
from rollmarket.client import Rejected
from rollmarket.dashboard import create_dashboard_app, export_static
from rollmarket.dashboard.market import MarketSource, db_report
from rollmarket.contracts import RejectionReason
from rollmarket.gate import budget_report, decide, reject
from rollmarket.localhost import free_port

ROOT = Path(__file__).resolve().parents[1]
RUN_ID = "20260101T000000Z-mkt001"
TRAINER_ID = "trainer-m"


class Market:
    """The exchange, its clients and a ledger of what they sent and were answered."""

    def __init__(self, tmp: Path):
        self.exchange = ExchangeProcess(db=tmp / "exchange.db", log=tmp / "exchange.log").start()
        self.trainer = self.exchange.trainer(trainer_id=TRAINER_ID)
        self.receipts: dict[str, tuple[str, object, int]] = {}  # group id -> (worker, receipt, tokens)
        self.leases: Counter = Counter()
        self.rejections: Counter = Counter()
        self.decisions: list[tuple[str, object]] = []  # (group id, GroupDecision), a group may be decided twice

    def submit(self, worker, worker_id: str, grant, seed: int):
        group = worker.seal(worker.group_for(grant, trajectories(2, tokens=8 + seed, seed=seed)))
        receipt = worker.submit(group)
        tokens = sum(len(t.response_token_ids) for t in group.trajectories)
        self.receipts[group.group_id] = (worker_id, receipt, tokens)
        return receipt

    def decide_all(self, veto: int | None = None) -> None:
        """Fetch every tier and decide each group: the `veto`-th is vetoed (quarantine), a quarantined
        one is rejected on a second look, the rest train."""
        fetched = [(tier, f.group) for tier in ("fresh", "replay", "quarantine")
                   for f in self.trainer.fetch(tier=tier, limit=64).groups]
        for i, (tier, group) in enumerate(fetched):
            if tier == "quarantine":
                decision = reject(group.group_id, [RejectionReason.missing_logprobs], decided_by=TRAINER_ID)
                self.trainer.report(group.group_id, decision)
                self.decisions.append((group.group_id, decision))
                continue
            logprobs = [t.logprobs.astype(np.float64) for t in group.trajectories]
            if i == veto:
                logprobs[0] = logprobs[0].copy()
                logprobs[0][0] += 40.0  # one token the trainer finds absurdly more likely: a veto
            decision = decide(budget_report(group, logprobs), decided_by=TRAINER_ID)
            self.trainer.report(group.group_id, decision)
            self.decisions.append((group.group_id, decision))

    def deliver(self, worker, worker_id: str, rollout_job, seed: int):
        self.trainer.enqueue(rollout_job)
        grant = lease_one(worker)
        self.leases[worker_id] += 1
        return self.submit(worker, worker_id, grant, seed)


@pytest.fixture(scope="module")
def market(tmp_path_factory) -> Market:
    m = Market(tmp_path_factory.mktemp("market"))
    m.trainer.publish_policy(policy(0))
    m.w1 = ready_worker(m.exchange.url, "w1", price_hint=2.5, device_type="h100", device_count=8, region="eu",
                        max_concurrent_groups=2)
    m.w2 = ready_worker(m.exchange.url, "w2", engine_name="vllm", max_concurrent_groups=2)
    m.deliver(m.w1, "w1", job(0), seed=0)
    m.deliver(m.w1, "w1", job(1), seed=1)
    m.deliver(m.w2, "w2", job(2), seed=2)
    m.decide_all(veto=1)
    # w2 holds a v0 lease while v1 is published and activated: its group arrives one version late.
    m.trainer.enqueue(job(3))
    held = lease_one(m.w2)
    m.leases["w2"] += 1
    m.trainer.publish_policy(policy(1), quorum=1)
    m.w1.ack_reload(1, sha("ckpt-1"))
    m.trainer.wait_for_quorum(1, timeout=15)
    m.submit(m.w2, "w2", held, seed=3)
    m.deliver(m.w1, "w1", job(4, version=1), seed=4)
    # A submission the exchange refuses: a precision the lease did not ask for.
    m.trainer.enqueue(job(5, version=1))
    grant = lease_one(m.w1)
    m.leases["w1"] += 1
    with pytest.raises(Rejected) as refused:
        m.w1.submit(m.w1.seal(m.w1.group_for(grant, trajectories(2, seed=5), precision_class="fp8")))
    m.rejections.update(refused.value.reasons)
    m.decide_all()  # a second round: the trainer waited for these, so it was idle in between
    yield m
    m.exchange.stop()


def twin_of(market: Market) -> dict:
    """The page's twin, served by the dashboard app reading the running exchange's API."""
    client = TestClient(create_dashboard_app(market.exchange.db.parent, MarketSource(
        exchange_url=market.exchange.url, trainer_token=TRAINER_TOKEN)))
    response = client.get("/market.json")
    assert response.status_code == 200, response.text
    return response.json()


def without_clock(page: dict) -> dict:
    report = dict(page["report"])
    report.pop("generated_at")
    return report


def events(market: Market, kind: str):
    return market.trainer.audit(kind=kind, limit=10_000).events


def test_the_twin_holds_what_the_clients_sent(market):
    page = twin_of(market)
    assert page["source"] == "exchange" and page["where"] == market.exchange.url
    report = page["report"]
    assert (report["active_version"], report["published_version"]) == (1, 1)

    accepted, tokens, by_worker = Counter(), Counter(), defaultdict(Counter)
    for worker_id, receipt, n in market.receipts.values():
        accepted[worker_id] += 1
        tokens[worker_id] += n
    for group_id, decision in market.decisions:
        by_worker[market.receipts[group_id][0]][decision.status.value] += 1
    workers = {w["worker_id"]: w for w in report["workers"]}
    assert sorted(workers) == ["w1", "w2"]
    for worker_id, w in workers.items():
        assert w["accepted"] == accepted[worker_id]
        assert w["accepted_tokens"] == tokens[worker_id]
        assert w["leases"] == market.leases[worker_id]
        assert w["decisions"] == dict(by_worker[worker_id])
    assert workers["w1"]["rejected"] == 1 and workers["w2"]["rejected"] == 0
    assert (workers["w1"]["device_type"], workers["w1"]["device_count"], workers["w1"]["region"]) == ("h100", 8, "eu")
    assert workers["w1"]["price_hint"] == 2.5 and workers["w2"]["engine_name"] == "vllm"
    assert workers["w1"]["engine_fingerprint"] == sha("fp-w1")
    assert all(0 <= w["quality"] <= 1 for w in workers.values())

    statuses = Counter(d.status.value for _, d in market.decisions)
    assert report["decisions"] == dict(statuses) and "quarantine" in statuses and "train" in statuses
    assert report["submission_rejections"] == dict(market.rejections) and market.rejections
    gate = Counter(r.value for _, d in market.decisions for r in d.rejection_reasons)
    assert report["gate_rejections"] == dict(gate) and gate

    # Timeline: every decision once, under its worker, its arrival tier and its status.
    timeline = report["timeline"]
    tiers = Counter(market.receipts[g][1].tier.value for g, _ in market.decisions)
    assert sum(sum(b["by_worker"].values()) for b in timeline) == len(market.decisions)
    assert sum((Counter(b["by_worker"]) for b in timeline), Counter()) == Counter(
        {w: sum(c.values()) for w, c in by_worker.items()})
    assert sum((Counter(b["by_tier"]) for b in timeline), Counter()) == tiers
    assert sum((Counter(b["by_status"]) for b in timeline), Counter()) == statuses
    assert sum(b["accepted_tokens"] for b in timeline) == sum(tokens.values())
    starts = [b["start"] for b in timeline]
    assert starts == sorted(starts) and report["bucket_s"] > 0

    lags = Counter(r.policy_lag_steps for _, r, _ in market.receipts.values())
    assert lags[1] == 1
    assert report["lag_histogram"] == [{"lag": lag, "groups": lags[lag]} for lag in range(max(lags) + 1)]

    times = [r.received_at.timestamp() for _, r, _ in market.receipts.values()]
    assert report["accepted_groups"] == len(market.receipts)
    assert report["accepted_tokens"] == sum(tokens.values())
    assert report["accepted_span_s"] == pytest.approx(max(times) - min(times), abs=1e-5)
    assert report["accepted_tokens_per_s"] == pytest.approx(sum(tokens.values()) / (max(times) - min(times)))


def test_reload_latency_and_trainer_idle_match_the_audit_log(market):
    report = twin_of(market)["report"]
    published = {e.subject: e.at.timestamp() for e in events(market, "policy.published")}
    acks = sorted((e.actor, int(e.subject.split(":")[1]), e.at.timestamp() - published[e.subject])
                  for e in events(market, "reload.acked"))
    assert [(w, v) for w, v, _ in acks] == [("w1", 0), ("w1", 1), ("w2", 0)]
    got = sorted((a["worker_id"], a["policy_version"], a["seconds"]) for a in report["reload_acks"])
    assert [(w, v) for w, v, _ in got] == [(w, v) for w, v, _ in acks]
    for (_, _, want), (_, _, seconds) in zip(acks, got):
        assert seconds == pytest.approx(want, abs=1e-3) and seconds >= 0
    assert report["reload_latency_max_s"] == pytest.approx(max(s for _, _, s in acks), abs=1e-3)

    # Busy from a group's first serving to its decision; the union of those over the span.
    first_served: dict[str, float] = {}
    serve_times = []
    for e in events(market, "groups.served"):
        serve_times.append(e.at.timestamp())
        for group_id in e.data["group_ids"]:
            first_served.setdefault(group_id, e.at.timestamp())
    decided: dict[str, float] = {}
    for e in events(market, "group.decided"):  # a quarantined group is served and decided again
        decided.setdefault(e.subject, e.at.timestamp())
    last_decision = max(e.at.timestamp() for e in events(market, "group.decided"))
    start, end = min(first_served.values()), max(serve_times + [last_decision])
    covered = np.zeros(200_001, bool)  # the span on a 200k-point grid: a union needs no interval code here
    grid = np.linspace(start, end, covered.size)
    for group_id, at in first_served.items():
        covered |= (grid >= at) & (grid <= decided[group_id])
    (trainer,) = report["trainers"]
    assert trainer["trainer_id"] == TRAINER_ID and trainer["groups"] == len(first_served)
    assert trainer["span_s"] == pytest.approx(end - start, abs=1e-6)
    assert trainer["idle_fraction"] == pytest.approx(1 - covered.mean(), abs=1e-3)
    assert trainer["idle_fraction"] > 0  # it waited between its two rounds


def test_the_database_file_and_a_run_directory_give_the_same_numbers(market, tmp_path):
    db = market.exchange.db
    live = without_clock(twin_of(market))
    client = TestClient(create_dashboard_app(tmp_path, MarketSource(exchange_db=db)))
    page = client.get("/market.json").json()
    assert page["source"] == "db" and without_clock(page) == live

    # A training run's own exchange.db, found under --runs at a campaign run's depth.
    run_dir = tmp_path / "camp" / "runs" / "cond__s0" / RUN_ID
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("")  # a training run's directory, as the dashboard finds them
    source = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    copy = sqlite3.connect(run_dir / "exchange.db")
    source.backup(copy)
    source.close()
    copy.close()
    before = sorted(os.listdir(run_dir))
    runs_only = TestClient(create_dashboard_app(tmp_path))
    page = runs_only.get(f"/market.json?run={RUN_ID}").json()
    assert page["source"] == "run" and page["run_id"] == RUN_ID and without_clock(page) == live
    assert sorted(os.listdir(run_dir)) == before, "reading wrote files beside the database"
    html = runs_only.get(f"/market?run={RUN_ID}")
    assert html.status_code == 200 and f"market.json?run={RUN_ID}" in html.text


@pytest.mark.parametrize("path, status, reason", [
    ("/market.json", 404, "no_market"),
    ("/market", 404, "no_market"),
    ("/market.json?run=20990101T000000Z-nope00", 404, "unknown_run"),
    ("/market.json?run=..%2F..%2Fetc", 404, "unknown_run"),
])
def test_no_market_or_an_unknown_run_is_a_typed_404(tmp_path, path, status, reason):
    response = TestClient(create_dashboard_app(tmp_path)).get(path)
    assert response.status_code == status
    if path.split("?")[0].endswith(".json"):
        assert response.json()["error"]["reasons"] == [reason]
    else:
        assert reason in response.text


def test_an_exchange_that_does_not_answer_is_a_typed_502(tmp_path):
    source = MarketSource(exchange_url=f"http://127.0.0.1:{free_port()}", trainer_token="x")
    response = TestClient(create_dashboard_app(tmp_path, source)).get("/market.json")
    assert response.status_code == 502
    assert response.json()["error"]["reasons"] == ["exchange_unreachable"]
    bad_db = tmp_path / "not.db"
    bad_db.write_text("not a database")
    response = TestClient(create_dashboard_app(tmp_path, MarketSource(exchange_db=bad_db))).get("/market.json")
    assert response.status_code == 502 and response.json()["error"]["reasons"] == ["unreadable_exchange_db"]


# ----------------------------------------------------------------------------- in the browser


def chart(page, canvas_id: str) -> dict[str, list[float]]:
    """A drawn chart's datasets, label -> values, as Chart.js holds them."""
    return page.evaluate("""id => Object.fromEntries(window.Chart.getChart(document.getElementById(id))
        .data.datasets.map(d => [d.label, d.data]))""", canvas_id)


def test_the_page_draws_and_follows_a_running_exchange(market, browser, tmp_path):
    env = {**os.environ, "ROLLMARKET_TRAINER_TOKEN": TRAINER_TOKEN}
    with dashboard_process(tmp_path, tmp_path / "dashboard.log", "--exchange", market.exchange.url, env=env) as url:
        context, page = open_page(browser)
        requests, errors = page.requests, page.errors
        try:
            page.goto(url + "/market")
            report = twin_of(market)["report"]
            rows = page.locator('[data-testid="market-workers"] tbody tr')
            assert rows.count() == 2 and rows.nth(0).locator("td").nth(0).inner_text() == "w1"
            fingerprints = page.locator('[data-testid="market-fingerprints"] tbody tr')
            assert report["fingerprints"] and fingerprints.count() == len(report["fingerprints"])
            assert fingerprints.nth(0).locator("td").nth(0).inner_text() == report["fingerprints"][0][
                "engine_fingerprint"][:12]
            by_worker = chart(page, "chart-by-worker")
            assert {k: sum(v) for k, v in by_worker.items()} == {
                w["worker_id"]: sum(w["decisions"].values()) for w in report["workers"]}
            assert chart(page, "chart-lag") == {"groups": [b["groups"] for b in report["lag_histogram"]]}
            assert sum(sum(v) for v in chart(page, "chart-by-tier").values()) == sum(report["decisions"].values())
            shot(page, "market")

            # Live: one more group reaches the exchange; the page shows it without reloading.
            page.evaluate("window.notReloaded = true")
            cell = page.locator('[data-field="accepted_groups"]')
            before = int(cell.inner_text())
            market.deliver(market.w1, "w1", job(6, version=1), seed=6)
            page.wait_for_function("n => document.querySelector('[data-field=\"accepted_groups\"]').textContent == n",
                                   arg=str(before + 1), timeout=60_000)
            assert page.evaluate("window.notReloaded") is True
            shot(page, "market-live")
            assert not errors, errors
            assert all(u.startswith(url) for u in requests), [u for u in requests if not u.startswith(url)]
        finally:
            context.close()


def test_the_static_export_opens_from_files(market, browser, tmp_path):
    out = tmp_path / "site"
    summary = export_static(tmp_path / "runs-none", out, exchange_db=market.exchange.db)
    assert summary.runs == 0
    twin = json.loads((out / "market.json").read_text())
    assert twin["source"] == "db"
    expected = db_report(market.exchange.db).model_dump(mode="json")
    assert {k: v for k, v in twin["report"].items() if k != "generated_at"} == {
        k: v for k, v in expected.items() if k != "generated_at"}
    index = (out / "index.html").read_text()
    assert 'data-testid="nav-market"' in index
    context, page = open_page(browser)
    requests, errors = page.requests, page.errors
    try:
        page.goto((out / "market.html").as_uri())
        page.wait_for_function("document.body.dataset.drawn")
        assert page.locator('[data-field="accepted_groups"]').inner_text() == str(twin["report"]["accepted_groups"])
        assert sum(sum(v) for v in chart(page, "chart-by-worker").values()) == sum(twin["report"]["decisions"].values())
        shot(page, "market-static")
        assert not errors, errors
        assert [u for u in requests if not u.startswith("file://")] == []
    finally:
        context.close()


def test_every_marketplace_error_is_documented():
    from rollmarket.dashboard.data import Missing

    market = (Missing.no_market, Missing.run, Missing.exchange_unreachable, Missing.unreadable_exchange_db)
    doc = (ROOT / "docs" / "observatory.md").read_text().split("\n## Dashboard\n", 1)[1]
    assert not [m.value for m in market if f"`{m.value}`" not in doc]
