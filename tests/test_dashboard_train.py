"""The runs index of every kind and the training run page, through their twins and in Chromium.

Runs are written in code (tests/training_fixture.py): two finished training runs, a running one, a
demo inside a campaign, a collect run and an observatory run. Expected numbers are recomputed here
from the files (the t quantiles are a table, not scipy). The browser half starts the real
`rollmarket dashboard` and drives Debian's chromium: the number of points chart.js holds, the
metric chooser, an overlay, a live update of the running run, the index's filter and sort, and the
static export from file://. Screenshots go to test-artifacts/dashboard/.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from rollmarket.agents.probe import Capability, ProbeReport
from rollmarket.dashboard import create_dashboard_app, export_static

from dashboard_browser import dashboard_process, open_page, shot
from training_fixture import write_training_run

ROOT = Path(__file__).resolve().parents[1]
DONE = "20261101T100000Z-d0e001"
OTHER = "20261102T100000Z-d0e002"
LIVE = "20261103T100000Z-11fe01"
DEMO = "20261104T100000Z-de0001"
COLLECT = "20261105T100000Z-c011ec"
OBSERVE = "20261106T100000Z-0b5e01"
STALE = "20261020T100000Z-dead01"
CAMPAIGN = "camp-a"
T975 = {4: 2.7764451052, 5: 2.5705818366}
"""Student t 97.5% quantiles by degrees of freedom (from a table)."""


PROBES = {name: ProbeReport(url=f"http://127.0.0.1:9/{name}/v1", model="tiny-moe", probed_at=at, capabilities=tuple(
    Capability(name=cap, status=status, detail="written in code") for cap, status in caps.items()))
    for name, at, caps in (
        ("older", "2026-11-01T10:00:00+00:00", {"chat": "yes", "routed_experts": "no"}),
        ("vllm-a", "2026-11-20T10:00:00+00:00", {"chat": "yes", "streaming": "partial", "routed_experts": "yes",
                                                 "prompt_logprobs": "no"}))}
"""Probe reports `rollmarket probe --out RUNS/probes/NAME.json` would save, written in code."""


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    write_training_run(root / DONE, 12, eval_every=3, tasks=5, seed=1)
    write_training_run(root / OTHER, 8, eval_every=4, tasks=6, seed=2)
    write_training_run(root / LIVE, 3, planned=20, finished=False, seed=3)
    stale = write_training_run(root / STALE, 2, planned=9, finished=False, seed=4, generations=False)
    old = time.time() - 3600
    for f in stale.iterdir():
        os.utime(f, (old, old))
    camp = root / CAMPAIGN
    run = write_training_run(camp / "runs" / "base__s1" / DEMO, 4, demo=True, seed=5)
    (camp / "campaign.json").write_text(json.dumps({"name": CAMPAIGN, "runs": [
        {"condition": "base", "seed": 1, "dir": str(run), "status": "done"},
        {"condition": "base", "seed": 2, "dir": None, "status": "pending"}]}))
    (root / COLLECT).mkdir()
    (root / COLLECT / "config.json").write_text(json.dumps({"tasks": "calc", "num_tasks": 5, "repeats": 2,
                                                           "model_url": "http://x", "out": "x.jsonl"}))
    (root / COLLECT / "summary.json").write_text(json.dumps({"done": 8, "skipped": 2, "pass_rate": 0.625,
                                                            "mean_reward": 0.5}))
    from observatory_fixture import write_fixture_run

    write_fixture_run(root / OBSERVE)
    (root / "probes").mkdir()
    for name, report in PROBES.items():
        (root / "probes" / f"{name}.json").write_text(report.model_dump_json())
    (root / "probes" / "broken.json").write_text('{"url": "x"}')
    return root


@pytest.fixture(scope="module")
def client(runs_dir) -> TestClient:
    return TestClient(create_dashboard_app(runs_dir))


# ----------------------------------------------------------------------------- the index


def test_index_lists_every_kind_with_status_and_headline(client, runs_dir):
    data = client.get("/index.json").json()
    by_id = {e["run_id"]: e for e in data["entries"]}
    assert {i: (e["kind"], e["status"]) for i, e in by_id.items()} == {
        DONE: ("train", "finished"), OTHER: ("train", "finished"), LIVE: ("train", "running"),
        STALE: ("train", "crashed"), DEMO: ("demo", "finished"), CAMPAIGN: ("campaign", "crashed"),
        COLLECT: ("collect", "finished"), OBSERVE: ("observe", "finished")}
    metrics = rows(runs_dir / DONE / "metrics.jsonl")
    done = by_id[DONE]
    assert (done["steps_done"], done["steps_planned"]) == (12, 12)
    last_eval = [r for r in metrics if "eval/pass@1" in r][-1]
    assert done["pass1"] == pytest.approx(last_eval["eval/pass@1"])
    assert done["accuracy"] == pytest.approx(last_eval["eval/accuracy/mean"])
    assert done["mean_reward"] == pytest.approx(metrics[-1]["critic/rewards/mean"])
    assert (by_id[LIVE]["steps_done"], by_id[LIVE]["steps_planned"]) == (3, 20)
    assert by_id[DEMO]["campaign"] == CAMPAIGN and by_id[DEMO]["path"] == f"{CAMPAIGN}/runs/base__s1/{DEMO}"
    assert (by_id[CAMPAIGN]["steps_done"], by_id[CAMPAIGN]["steps_planned"], by_id[CAMPAIGN]["unit"]) == (1, 2, "runs")
    assert (by_id[COLLECT]["steps_done"], by_id[COLLECT]["steps_planned"], by_id[COLLECT]["accuracy"]) == (10, 10, 0.625)
    assert by_id[OBSERVE]["observatory"] and (by_id[OBSERVE]["steps_done"], by_id[OBSERVE]["unit"]) == (6, "cells")
    assert by_id[DONE]["started_at"] == "2026-11-01T10:00:00+00:00"
    # Newest first by default (a campaign's start is its campaign.json's mtime: now); the observatory's own
    # list is still there.
    assert [e["run_id"] for e in data["entries"]][:3] == [CAMPAIGN, OBSERVE, COLLECT]
    assert [r["run_id"] for r in data["runs"]] == [OBSERVE]


def test_index_lists_saved_probe_reports(client):
    probes = client.get("/index.json").json()["probes"]
    assert [p["name"] for p in probes] == ["vllm-a", "older", "broken"]  # newest first, unreadable last
    for entry in probes[:2]:
        report = PROBES[entry["name"]]
        assert (entry["url"], entry["model"], entry["probed_at"]) == (report.url, report.model, report.probed_at)
        assert entry["counts"] == {s: sum(c.status == s for c in report.capabilities) for s in ("yes", "partial", "no")}
    assert probes[1]["counts"] == {"yes": 1, "partial": 0, "no": 1}
    assert probes[2]["error"] and probes[2]["url"] is None
    html = client.get("/").text
    assert 'href="probe/vllm-a"' in html and 'href="probe/broken"' not in html
    # The filters narrow runs, not the probes.
    assert len(client.get("/index.json?kind=campaign").json()["probes"]) == 3


def test_index_filters_and_sorts_on_the_server(client):
    def ids(query: str) -> list[str]:
        return [e["run_id"] for e in client.get("/index.json?" + query).json()["entries"]]

    assert ids("kind=train&sort=run_id") == [STALE, DONE, OTHER, LIVE]
    assert ids("status=running") == [LIVE]
    assert ids("q=base__s1") == [DEMO]
    # Descending by steps: runs without steps go last.
    steps = client.get("/index.json?sort=-steps_done").json()["entries"]
    values = [e["steps_done"] for e in steps]
    present = [v for v in values if v is not None]
    assert present == sorted(present, reverse=True) and values[:len(present)] == present
    for query, parameter in (("kind=nope", "kind"), ("status=done", "status"), ("sort=colour", "sort")):
        response = client.get("/index.json?" + query)
        assert response.status_code == 400, query
        error = response.json()["error"]
        assert error["reasons"] == ["bad_query"] and error["details"]["parameter"] == parameter
        assert client.get("/?" + query).status_code == 400


def test_a_campaign_runs_while_its_lock_is_held(tmp_path):
    """The campaign process holds CAMPAIGN_DIR/.lock (flock): held, the campaign and its unfinished run
    are running; released, both are crashed, however fresh the run's files."""
    import fcntl

    camp = tmp_path / CAMPAIGN
    run = write_training_run(camp / "runs" / "base__s1" / LIVE, 2, planned=5, finished=False)
    (camp / "campaign.json").write_text(json.dumps({"name": CAMPAIGN, "runs": [
        {"condition": "base", "seed": 1, "dir": str(run), "status": "running"}]}))
    client = TestClient(create_dashboard_app(tmp_path))

    def statuses() -> dict[str, str]:
        return {e["run_id"]: e["status"] for e in client.get("/index.json").json()["entries"]}

    fd = os.open(camp / ".lock", os.O_CREAT | os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert statuses() == {CAMPAIGN: "running", LIVE: "running"}
        fcntl.flock(fd, fcntl.LOCK_UN)
        assert statuses() == {CAMPAIGN: "crashed", LIVE: "crashed"}
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- the training page


def t_interval(values: list[float]) -> tuple[float, float, float]:
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = T975[n - 1] * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def test_train_twin_has_every_numeric_column_and_the_eval_band(client, runs_dir):
    data = client.get(f"/train/{DONE}.json").json()
    metrics = rows(runs_dir / DONE / "metrics.jsonl")
    series = data["metrics"]
    assert series["steps"] == list(range(13)) and series["last_step"] == 12
    numeric = {k for r in metrics for k, v in r.items()
               if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert series["names"] == sorted(numeric)  # labels (condition) and nulls (actor/kl_ref) are not columns
    # The page carries only what its default charts draw; every column is in the metrics twin.
    drawn = {k for p in data["panels"] for k in p["keys"]}
    assert set(series["columns"]) == drawn & numeric and "mean_reward" not in series["columns"]
    series = client.get(f"/train/{DONE}/metrics.json").json()
    assert set(series["columns"]) == numeric
    assert "condition" not in series["columns"] and "actor/kl_ref" not in series["columns"]
    assert series["columns"]["actor/grad_norm"] == [r.get("actor/grad_norm") for r in metrics]
    wall = 0.0
    for i, r in enumerate(metrics):
        wall += r.get("timing_s/step", 0.0)
        assert series["wall_s"][i] == pytest.approx(wall)
    assert series["tokens"][-1] == sum(r.get("perf/total_num_tokens", 0) for r in metrics)
    evals = rows(runs_dir / DONE / "evals.jsonl")
    steps = sorted({r["step"] for r in evals})
    assert steps == [0, 3, 6, 9, 12]
    points = {(p["step"], p["metric"]): p for p in series["evals"]}
    assert len(points) == 2 * len(steps)
    for step in steps:
        at = [r for r in evals if r["step"] == step]
        pass1 = [sum(r["sampled_passed"]) / len(r["sampled_passed"]) for r in at]
        mean, lo, hi = t_interval(pass1)
        p = points[(step, "eval/pass@1")]
        assert p["n_tasks"] == 5 and p["mean"] == pytest.approx(mean)
        assert (p["lo"], p["hi"]) == (pytest.approx(lo), pytest.approx(hi))
        greedy = [float(r["greedy_passed"]) for r in at]
        assert points[(step, "eval/accuracy/mean")]["mean"] == pytest.approx(sum(greedy) / len(greedy))
        # The band's mean is what the loop logged for the step.
        logged = next(r for r in metrics if r["step"] == step)
        assert p["mean"] == pytest.approx(logged["eval/pass@1"])
    panels = {p["id"]: p for p in data["panels"]}
    assert panels["heldout"]["band"] and panels["gate"]["kind"] == "stacked"
    assert panels["gate"]["keys"] == ["gate/train", "gate/train_with_correction", "gate/replay", "gate/quarantine"]
    assert panels["ess"]["keys"] == ["mismatch/bf16/token_ess_mean", "mismatch/fp8/token_ess_mean"]
    assert panels["flips"]["keys"] == ["mismatch/bf16/router_flip_rate", "mismatch/fp8/router_flip_rate"]
    assert panels["kl"]["keys"] == ["actor/ppo_kl"]  # actor/kl_ref is null throughout: no line
    assert "timing_s/step" in panels["timings"]["keys"] and panels["throughput"]["keys"] == ["perf/throughput"]
    assert data["groups"]["gate"] == sorted(panels["gate"]["keys"])
    assert data["rollouts"] is True and data["overlays"] == []


def test_metrics_twin_gives_only_newer_steps(client, runs_dir):
    data = client.get(f"/train/{DONE}/metrics.json?after=7").json()
    assert data["steps"] == [8, 9, 10, 11, 12] and data["after"] == 7
    assert all(len(v) == 5 for v in data["columns"].values())
    assert sorted({p["step"] for p in data["evals"]}) == [9, 12]
    assert client.get(f"/train/{DONE}/metrics.json?after=12").json()["steps"] == []
    # The server's own time rides along (benchmarks/dashboard_open.py reads it).
    assert re.fullmatch(r"app;dur=\d+\.\d", client.get(f"/train/{DONE}/metrics.json?after=7").headers["server-timing"])
    bad = client.get(f"/train/{DONE}/metrics.json?after=seven")
    assert bad.status_code == 400 and bad.json()["error"]["details"]["parameter"] == "after"


def test_chosen_metrics_are_fetched_by_key(client, runs_dir):
    metrics = rows(runs_dir / DONE / "metrics.jsonl")
    picked = client.get(f"/train/{DONE}/columns.json?keys=mean_reward&keys=seed&keys=no/such").json()
    assert picked["run_id"] == DONE and picked["last_step"] == 12
    assert picked["columns"] == {"mean_reward": [r.get("mean_reward") for r in metrics],
                                 "seed": [r.get("seed") for r in metrics]}  # a key the run lacks is absent
    poll = client.get(f"/train/{DONE}/metrics.json?after=10&keys=seed").json()
    assert poll["steps"] == [11, 12] and poll["columns"] == {"seed": [1.0, 1.0]}
    assert "mean_reward" in poll["names"]
    for url in (f"/train/{DONE}/columns.json", f"/train/{DONE}/columns.json?keys="):
        bad = client.get(url)
        assert bad.status_code == 400 and bad.json()["error"]["details"]["parameter"] == "keys", url
    assert client.get("/train/nope/columns.json?keys=seed").json()["error"]["reasons"] == ["unknown_run"]


def test_an_appended_row_is_read_incrementally(tmp_path):
    run = write_training_run(tmp_path / LIVE, 2, planned=5, finished=False)
    client = TestClient(create_dashboard_app(tmp_path))
    assert client.get(f"/train/{LIVE}/metrics.json").json()["last_step"] == 2
    path = run / "metrics.jsonl"
    with open(path, "a") as f:
        f.write(json.dumps({"step": 3, "critic/rewards/mean": 0.75, "new/key": 1.5}) + "\n")
        f.write('{"step": 4, "critic/rew')  # the writer is mid-line
    data = client.get(f"/train/{LIVE}/metrics.json?after=2").json()
    assert data["steps"] == [3] and data["columns"]["critic/rewards/mean"] == [0.75]
    assert data["columns"]["new/key"] == [1.5]
    full = client.get(f"/train/{LIVE}/metrics.json").json()
    assert full["columns"]["new/key"] == [None, None, None, 1.5]
    with open(path, "a") as f:
        f.write('ards/mean": 0.5}\n')
    assert client.get(f"/train/{LIVE}/metrics.json?after=3").json()["columns"]["critic/rewards/mean"] == [0.5]
    # A file rewritten shorter (a resume's repair) is read again from the start.
    path.write_text("".join(line + "\n" for line in path.read_text().splitlines()[:2]))
    assert client.get(f"/train/{LIVE}/metrics.json").json()["steps"] == [0, 1]


def test_overlay_and_unknown_runs(client):
    data = client.get(f"/train/{DONE}.json?overlay={OTHER},{DEMO}").json()
    assert [o["run_id"] for o in data["overlays"]] == [OTHER, DEMO]
    assert data["overlays"][0]["steps"] == list(range(9))
    for url, reason in ((f"/train/{OTHER}x", "unknown_run"), (f"/train/{OBSERVE}", "unknown_run"),
                        (f"/train/{DONE}?overlay=nope", "unknown_run")):
        for suffix in (".json", ""):
            path, _, query = url.partition("?")
            response = client.get(path + suffix + (f"?{query}" if query else ""))
            assert response.status_code == 404, url
            if suffix:
                assert response.json()["error"]["reasons"] == [reason]


def test_train_page_links_rollouts_campaign_and_twin(client):
    html = client.get(f"/train/{DEMO}").text
    assert f'href="{DEMO}/rollouts"' in html and f'href="../campaigns/{CAMPAIGN}"' in html
    assert f'href="{DEMO}.json"' in html
    assert 'id="train-data"' in html and "train.js" in html
    inline = json.loads(re.search(r'<script type="application/json" id="train-data">(.*?)</script>', html, re.S)
                        .group(1))
    assert inline == client.get(f"/train/{DEMO}.json").json()
    index = client.get("/").text
    assert f'href="train/{DEMO}"' in index and f'href="runs/{OBSERVE}"' in index
    assert f'href="campaigns/{CAMPAIGN}"' in index


def test_reading_writes_nothing(client, runs_dir):
    def snapshot() -> dict[str, tuple[int, int]]:
        return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in runs_dir.rglob("*")}

    before = snapshot()
    for url in ("/", "/index.json?sort=pass1", f"/train/{DONE}", f"/train/{DONE}.json?overlay={OTHER}",
                f"/train/{LIVE}/metrics.json?after=1", "/train/nope", f"/runs/{OBSERVE}"):
        client.get(url)
    assert snapshot() == before


def test_the_training_pages_never_import_torch(runs_dir):
    """The dashboard is a service: serving the index and a training page, its poll and the interval
    band (scipy) loads neither torch nor transformers."""
    code = (f"import sys; from fastapi.testclient import TestClient; "
            f"from rollmarket.dashboard import create_dashboard_app; c = TestClient(create_dashboard_app({str(runs_dir)!r})); "
            f"assert all(c.get(u).status_code == 200 for u in ('/', '/train/{DONE}', '/train/{LIVE}/metrics.json?after=1')); "
            f"print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# ----------------------------------------------------------------------------- in the browser


@pytest.fixture(scope="module")
def server(runs_dir, tmp_path_factory):
    """`rollmarket dashboard` as a real process on a free loopback port."""
    with dashboard_process(runs_dir, tmp_path_factory.mktemp("dashboard") / "dashboard.log") as url:
        yield url


def dataset_lengths(page, canvas_id: str) -> dict[str, int]:
    """Points per dataset of a chart, by label (bands left out)."""
    return page.evaluate("""id => {
        const chart = Chart.getChart(document.getElementById(id));
        const out = {};
        chart.data.datasets.filter(d => !d.band).forEach(d => { out[d.label] = d.data.length; });
        return out; }""", canvas_id)


def test_training_page_draws_each_metric_with_its_points(page, server, runs_dir):
    metrics = rows(runs_dir / DONE / "metrics.jsonl")
    page.goto(f"{server}/train/{DONE}")
    page.wait_for_selector("#chart-rewards")
    rewards = sum(1 for r in metrics if r.get("critic/rewards/mean") is not None)
    assert dataset_lengths(page, "chart-rewards") == {"critic/rewards/mean": rewards} and rewards == 12
    evals = {r["step"] for r in rows(runs_dir / DONE / "evals.jsonl")}
    assert dataset_lengths(page, "chart-heldout") == {"eval/pass@1": len(evals), "eval/accuracy/mean": len(evals)}
    bands = page.evaluate("Chart.getChart(document.getElementById('chart-heldout')).data.datasets"
                          ".filter(d => d.band).map(d => d.data.length)")
    assert bands == [len(evals)] * 4
    assert page.evaluate("Chart.getChart(document.getElementById('chart-gate')).config.type") == "bar"
    assert len(dataset_lengths(page, "chart-gate")) == 4
    charts = page.locator('[data-testid="chart"]').count()
    # The metric chooser adds a chart of the chosen key, which the page did not carry: it is fetched.
    assert "mean_reward" not in page.evaluate("JSON.parse(document.getElementById('train-data').textContent)"
                                              ".metrics.columns")
    page.select_option('[data-testid="metric-choice"]', "mean_reward")
    with page.expect_response(lambda r: "/columns.json?keys=mean_reward" in r.url):
        page.click('[data-testid="add-chart"]')
    page.wait_for_selector("#chart-custom-1")
    assert page.locator('[data-testid="chart"]').count() == charts + 1
    chosen = sum(1 for r in metrics if "mean_reward" in r)
    assert chosen == 12 and dataset_lengths(page, "chart-custom-1") == {"mean_reward": chosen}
    # The x axis: wall time puts the last point at the sum of timing_s/step.
    page.select_option('[data-testid="x-axis"]', "wall_s")
    last_x = page.evaluate("Chart.getChart(document.getElementById('chart-rewards')).data.datasets[0].data.at(-1).x")
    assert last_x == pytest.approx(sum(r.get("timing_s/step", 0) for r in metrics))
    # Smoothing changes the drawn values but not their number; log scale switches the axis.
    raw = page.evaluate("Chart.getChart(document.getElementById('chart-rewards')).data.datasets[0].data.map(p => p.y)")
    page.locator('[data-testid="smoothing"]').fill("0.9")
    smooth = page.evaluate("Chart.getChart(document.getElementById('chart-rewards')).data.datasets[0].data.map(p => p.y)")
    assert len(smooth) == len(raw) and smooth[0] == raw[0] and smooth[-1] != raw[-1]
    page.check('[data-testid="log-scale"]')
    assert page.evaluate("Chart.getChart(document.getElementById('chart-rewards')).scales.y.type") == "logarithmic"
    shot(page, "train")


def test_overlay_draws_both_runs(page, server):
    page.goto(f"{server}/train/{DONE}?overlay={OTHER}")
    page.wait_for_selector("#chart-rewards")
    assert dataset_lengths(page, "chart-rewards") == {f"critic/rewards/mean · {DONE}": 12,
                                                      f"critic/rewards/mean · {OTHER}": 8}
    shot(page, "train-overlay")


def test_a_running_run_follows_its_metrics_file(page, server, runs_dir):
    page.goto(f"{server}/train/{LIVE}")
    page.wait_for_selector("#chart-rewards")
    assert page.locator('[data-testid="live"]').count() == 1
    assert dataset_lengths(page, "chart-rewards") == {"critic/rewards/mean": 3}
    with open(runs_dir / LIVE / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 4, "critic/rewards/mean": 0.9, "timing_s/step": 2.0}) + "\n")
    page.wait_for_function("Chart.getChart(document.getElementById('chart-rewards')).data.datasets[0].data.length == 4",
                           timeout=30_000)
    last = page.evaluate("Chart.getChart(document.getElementById('chart-rewards')).data.datasets[0].data.at(-1)")
    assert last == {"x": 4, "y": 0.9}
    assert page.locator('[data-testid="last-step"]').inner_text() == "4"
    shot(page, "train-live")


def test_an_overlaid_running_run_follows_its_file(page, server, runs_dir):
    """The overlay is the running run: its dashed curve grows as its file does, the page's own stays."""
    def rewards() -> int:
        return sum(1 for r in rows(runs_dir / LIVE / "metrics.jsonl") if "critic/rewards/mean" in r)

    page.goto(f"{server}/train/{DONE}?overlay={LIVE}")
    page.wait_for_selector("#chart-rewards")
    assert "the running runs" in page.locator('[data-testid="live"]').inner_text()
    before = rewards()
    assert dataset_lengths(page, "chart-rewards") == {f"critic/rewards/mean · {DONE}": 12,
                                                      f"critic/rewards/mean · {LIVE}": before}
    last = max(r["step"] for r in rows(runs_dir / LIVE / "metrics.jsonl"))
    with open(runs_dir / LIVE / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": last + 1, "critic/rewards/mean": 0.4}) + "\n")
    page.wait_for_function("n => Chart.getChart(document.getElementById('chart-rewards')).data.datasets[1]"
                           ".data.length == n", arg=before + 1, timeout=30_000)
    assert dataset_lengths(page, "chart-rewards") == {f"critic/rewards/mean · {DONE}": 12,
                                                      f"critic/rewards/mean · {LIVE}": before + 1}
    assert page.locator('[data-testid="status"]').inner_text() == "finished"


def test_index_filters_and_sorts_in_the_page(page, server):
    page.goto(server + "/")
    table = page.locator('[data-testid="runs"] tbody tr')
    assert table.count() == 8
    page.select_option('[data-testid="filter-kind"]', "train")
    visible = page.locator('[data-testid="runs"] tbody tr:visible')
    assert sorted(visible.nth(i).get_attribute("data-run") for i in range(visible.count())) == sorted(
        [DONE, OTHER, LIVE, STALE])
    page.select_option('[data-testid="filter-status"]', "crashed")
    assert [visible.nth(i).get_attribute("data-run") for i in range(visible.count())] == [STALE]
    assert page.locator('[data-testid="shown"]').inner_text() == "1 of 8 runs"
    page.select_option('[data-testid="filter-status"]', "")
    page.select_option('[data-testid="filter-kind"]', "")
    page.fill('[data-testid="filter-text"]', "camp-a")
    assert sorted(visible.nth(i).get_attribute("data-run") for i in range(visible.count())) == sorted([CAMPAIGN, DEMO])
    page.fill('[data-testid="filter-text"]', "")
    page.click('th[data-key="steps_done"]')  # ascending; runs without steps last
    order = [table.nth(i).get_attribute("data-run") for i in range(table.count())]
    assert order[:2] == [CAMPAIGN, STALE]
    page.click('th[data-key="steps_done"]')
    order = [table.nth(i).get_attribute("data-run") for i in range(table.count())]
    assert order[:2] == [DONE, COLLECT]
    shot(page, "runs-index")
    probes = page.locator('[data-testid="probes"] tbody tr')
    assert [probes.nth(i).get_attribute("data-probe") for i in range(probes.count())] == ["vllm-a", "older", "broken"]
    page.click('a:text-is("vllm-a")')
    page.wait_for_selector('[data-capability="streaming"][data-status="partial"]')
    page.go_back()
    page.click(f'a:text-is("{DONE}")')
    page.wait_for_selector("#chart-rewards")


def test_static_export_draws_training_pages_from_files(browser, runs_dir, tmp_path):
    summary = export_static(runs_dir, tmp_path / "site")
    assert summary.training == 5  # DONE, OTHER, LIVE, STALE and the demo
    assert (tmp_path / "site" / "train" / f"{DONE}.json").is_file()
    context, page = open_page(browser)
    requests, errors = page.requests, page.errors
    try:
        page.goto((tmp_path / "site" / "index.html").as_uri())
        page.click(f'a:text-is("{DONE}")')
        page.wait_for_selector("#chart-rewards")
        assert dataset_lengths(page, "chart-rewards") == {"critic/rewards/mean": 12}
        # A metric the page does not carry loads from its own file beside the page.
        page.select_option('[data-testid="metric-choice"]', "mean_reward")
        page.click('[data-testid="add-chart"]')
        page.wait_for_selector("#chart-custom-1")
        assert dataset_lengths(page, "chart-custom-1") == {"mean_reward": 12}
        assert any(u.endswith(f"/train/{DONE}/columns/mean_reward.js") for u in requests)
        page.goto((tmp_path / "site" / "index.html").as_uri())
        assert page.locator('[data-testid="probes"] tbody tr').count() == 3
        page.click('a:text-is("vllm-a")')
        page.wait_for_selector('[data-capability="streaming"][data-status="partial"]')
        page.goto((tmp_path / "site" / "train" / f"{LIVE}.html").as_uri())
        page.wait_for_selector("#chart-rewards")
        assert page.locator('[data-testid="live"]').count() == 0  # nothing to poll from a file
        shot(page, "static-train")
    finally:
        context.close()
    assert not errors, errors
    assert [u for u in requests if not u.startswith("file://")] == []


def test_gate_bars_sum_steps_when_they_outnumber_the_pixels(browser, tmp_path):
    """901 steps (0…900) cannot be 901 bars a tier on a 426-px canvas: each bar sums 3 steps
    (⌈901 / 400⌉), and the bars still add up to every decision in the file."""
    run = write_training_run(tmp_path / "runs" / DONE, 900, eval_every=300, generations=False)
    export_static(tmp_path / "runs", tmp_path / "site")
    metrics = rows(run / "metrics.jsonl")
    context, page = open_page(browser)
    try:
        page.goto((tmp_path / "site" / "train" / f"{DONE}.html").as_uri())
        page.wait_for_selector("#chart-gate")
        drawn = page.evaluate("Object.fromEntries(Chart.getChart(document.getElementById('chart-gate')).data.datasets"
                              ".map(d => [d.label, d.data.map(p => [p.x, p.y])]))")
        assert page.locator('[data-testid="bar-steps"]').inner_text().strip() == "(each bar sums 3 steps)"
    finally:
        context.close()
    for tier in ("gate/train", "gate/train_with_correction", "gate/replay", "gate/quarantine"):
        points = [(r["step"], r[tier]) for r in metrics if tier in r]
        assert len(drawn[tier]) == math.ceil(len(points) / 3) == 300
        assert [x for x, _ in drawn[tier]] == [s for s, _ in points[::3]]
        assert sum(y for _, y in drawn[tier]) == sum(v for _, v in points)
