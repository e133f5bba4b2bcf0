"""The observatory dashboard, tested through its data and in a real browser.

Every page has a `.json` twin built from the same record, so the first half checks the twins
against what the fixture run wrote (tests/observatory_fixture.py). The second half starts the real
app (`rollmarket dashboard`) with uvicorn on loopback and drives Debian's chromium through
Playwright: tiles with the fixture's numbers and colours, a drawn chart, a tile click opening the
worst trajectory, the token hover, the side-by-side split, the metrics page, and the static export
from file:// with no network. Screenshots go to test-artifacts/dashboard/.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient
from rollmarket.cli.dashboard import dashboard as dashboard_command
from rollmarket.contracts import (
    AgentDivergenceReport,
    DenseMismatchReport,
    MatrixCell,
    ObservatoryMatrix,
    RouterMismatchReport,
)
from rollmarket.dashboard import create_dashboard_app, export_static
from rollmarket.dashboard.metrics import METRICS
from rollmarket.observatory import layout
from rollmarket.observatory.layout import TrajectoryView

from dashboard_browser import chart_pixels, dashboard_process, open_page, shot
from observatory_fixture import LOW_N, LOW_N_CELL, RUN_ID, write_fixture_run

ROOT = Path(__file__).resolve().parents[1]
OLD_RUN = "20250201T090000Z-0ld001"
BROKEN_RUN = "20250101T000000Z-b40ke0"
PROBE = "agent-0000#0@128"

EXPECTED_ESS_BAND = {("fp32", "fp32"): "green", ("fp32", "bf16"): "green", ("bf16", "fp32"): "amber",
                     ("bf16", "bf16"): "amber", ("fp8", "fp32"): "red", ("fp8", "bf16"): "red"}
EXPECTED_FLIP_BAND = {("fp32", "fp32"): "green", ("fp32", "bf16"): "green", ("bf16", "fp32"): "amber",
                      ("bf16", "bf16"): "amber", ("fp8", "fp32"): "red", ("fp8", "bf16"): "red"}


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    write_fixture_run(root / RUN_ID)
    write_fixture_run(root / OLD_RUN, created_at="2025-02-01T09:00:00Z", model="models/tiny-dense", moe=False)
    (root / BROKEN_RUN).mkdir()
    (root / BROKEN_RUN / layout.MATRIX).write_text("{not json")
    (root / "not-a-run").mkdir()  # no matrix.json: not listed
    return root


@pytest.fixture(scope="module")
def matrix(runs_dir) -> ObservatoryMatrix:
    return ObservatoryMatrix.model_validate_json((runs_dir / RUN_ID / layout.MATRIX).read_text())


@pytest.fixture(scope="module")
def client(runs_dir) -> TestClient:
    return TestClient(create_dashboard_app(runs_dir))


def views(runs_dir: Path, rollout: str) -> dict[str, TrajectoryView]:
    lines = layout.viewer_path(runs_dir / RUN_ID, rollout).read_text().splitlines()
    return {v.trajectory_id: v for v in map(TrajectoryView.model_validate_json, lines)}


def traj_url(rollout: str, tid: str, *, json_twin: bool = False, **query: str) -> str:
    url = f"/runs/{RUN_ID}/trajectory/{rollout}/{quote(tid, safe='')}{'.json' if json_twin else ''}"
    return url + ("?" + "&".join(f"{k}={v}" for k, v in query.items()) if query else "")


def cell(matrix: ObservatoryMatrix, rollout: str, trainer: str) -> MatrixCell:
    return next(c for c in matrix.cells if (c.rollout_engine, c.trainer_engine) == (rollout, trainer))


# ----------------------------------------------------------------------------- JSON twins


def test_index_lists_runs_newest_first(client, matrix):
    data = client.get("/index.json").json()
    assert [r["run_id"] for r in data["runs"]] == [RUN_ID, OLD_RUN, BROKEN_RUN]
    run = data["runs"][0]
    assert (run["model"], run["suite"], run["created_at"]) == (matrix.model, matrix.suite, matrix.created_at)
    assert run["rollout_engines"] == ["fp32", "bf16", "fp8"] and run["trainer_engines"] == ["fp32", "bf16"]
    assert (run["cells"], run["divergences"], run["moe"]) == (6, 2, True)
    assert data["runs"][1]["model"] == "models/tiny-dense" and data["runs"][1]["moe"] is False
    assert data["runs"][2]["error"] and data["runs"][2]["model"] is None
    page = client.get("/")
    assert page.status_code == 200 and RUN_ID in page.text and "unreadable" in page.text


def test_run_twin_matches_the_matrix(client, matrix):
    data = client.get(f"/runs/{RUN_ID}.json").json()
    assert data["rollout_engines"] == matrix.rollout_engines and data["trainer_engines"] == matrix.trainer_engines
    tiles = {(t["cell"]["rollout_engine"], t["cell"]["trainer_engine"]): t
             for row in data["tiles"] for t in row["tiles"]}
    assert len(tiles) == 6
    for (rollout, trainer), tile in tiles.items():
        expected = cell(matrix, rollout, trainer)
        assert tile["cell"] == expected.model_dump(mode="json")
        assert tile["ess_band"] == EXPECTED_ESS_BAND[(rollout, trainer)]
        assert tile["flip_band"] == EXPECTED_FLIP_BAND[(rollout, trainer)]
        ref = tile["trajectory"]
        assert (ref["rollout_engine"], ref["trainer_engine"], ref["trajectory_id"]) == (
            rollout, trainer, expected.worst_trajectory_id)
        assert ref["path"] == traj_url(rollout, expected.worst_trajectory_id, trainer=trainer)
        assert tile["cell"]["low_n"] == ((rollout, trainer) == LOW_N_CELL)
    assert tiles[LOW_N_CELL]["cell"]["n"] == LOW_N
    worst = max(matrix.cells, key=lambda c: abs(c.worst_token.delta))
    assert data["worst_token"]["worst_token"] == worst.worst_token.model_dump(mode="json")
    assert data["worst_token"]["trajectory"]["trajectory_id"] == worst.worst_trajectory_id
    assert len(data["cell_worst_tokens"]) == 6
    points = [p for s in data["length_scaling"] for p in s["points"]]
    expected = [p.model_dump(mode="json") for p in matrix.length_scaling]
    assert sorted(map(json.dumps, points)) == sorted(map(json.dumps, expected))
    assert [p["max_tokens"] for p in data["length_scaling"][0]["points"]] == [128, 512, 2048]
    assert data["position_scaling"] == [p.model_dump(mode="json") for p in matrix.position_scaling]
    assert [(b["start"], b["stop"]) for b in data["position_scaling"][0]["buckets"]] == [(0, 16), (16, 32), (32, 64)]
    html = client.get(f"/runs/{RUN_ID}").text
    # One row per (cell, bucket): 6 cells × 3 buckets, and each cell's count of tokens after an EOS.
    assert html.count('data-testid="position-row"') == 18
    assert html.count("7 tokens after an EOS excluded (10 probes)") == 6
    assert [r["report"] for r in data["divergence"]] == [d.model_dump(mode="json") for d in matrix.divergence]
    for row in data["divergence"]:
        assert (row["view"]["rollout_engine"], row["view"]["compare"]) == ("bf16", "fp8")
        assert row["report"]["kind"] == "tool_args" and row["report"]["first_divergent_step"] == 1
    assert data["config"]["settings"]["rollout_engines"] == ["fp32", "bf16", "fp8"]


def test_trajectory_twin_has_both_logprobs_of_every_token(client, runs_dir):
    view = views(runs_dir, "fp8")["agent-0003#1"]
    data = client.get(traj_url("fp8", "agent-0003#1", json_twin=True, trainer="bf16")).json()
    assert (data["rollout_engine"], data["trainer_engine"], data["compare"]) == ("fp8", "bf16", None)
    assert data["compare_options"] == ["fp32", "bf16"]
    turns = data["main"]["turns"]
    assert len(turns) == len(view.turns)
    for turn, expected in zip(turns, view.turns):
        assert [t["text"] for t in turn["tokens"]] == expected.tokens
        assert [t["rollout_logprob"] for t in turn["tokens"]] == expected.rollout_logprobs
        assert [t["trainer_logprob"] for t in turn["tokens"]] == expected.trainer_logprobs["bf16"]
        for t in turn["tokens"]:
            assert t["delta"] == pytest.approx(t["trainer_logprob"] - t["rollout_logprob"])
        assert turn["new_messages"] == expected.new_messages
        assert turn["tool_calls"] == [c.model_dump(mode="json") for c in expected.tool_calls]
    report = DenseMismatchReport.model_validate(data["main"]["report"])
    assert report.trajectory_id == "agent-0003#1" and report.trainer_engine == "bf16"
    # The viewer's largest-|Δ| token is the report's worst token.
    tokens = [t for turn in turns for t in turn["tokens"]]
    worst = next(t for t in tokens if t["position"] == data["main"]["worst_position"])
    assert worst["text"] == report.worst_token.token_text
    assert worst["delta"] == pytest.approx(report.worst_token.delta)
    assert RouterMismatchReport.model_validate(data["main"]["router"]).trajectory_id == "agent-0003#1"
    html = client.get(traj_url("fp8", "agent-0003#1", trainer="bf16"))
    assert html.status_code == 200 and 'data-testid="tokens"' in html.text


def test_trajectory_without_trainer_picks_one_that_scored_it(client, runs_dir):
    # fp8 x fp32 covers only the first 12 trajectories: a later one defaults to bf16.
    data = client.get(traj_url("fp8", "agent-0009#2", json_twin=True)).json()
    assert data["trainer_engine"] == "bf16" and data["main"]["has_trainer"]
    data = client.get(traj_url("fp8", "agent-0009#2", json_twin=True, trainer="fp32")).json()
    assert not data["main"]["has_trainer"]
    assert all(t["delta"] is None for turn in data["main"]["turns"] for t in turn["tokens"])


def test_side_by_side_marks_the_split(client, runs_dir):
    data = client.get(traj_url("bf16", "agent-0001#0", json_twin=True, trainer="bf16", compare="fp8")).json()
    assert data["compare"] == "fp8" and data["other"]["rollout_engine"] == "fp8"
    assert data["divergence"]["kind"] == "tool_args" and data["divergence"]["first_divergent_step"] == 1
    for side in (data["main"], data["other"]):
        assert [t["divergent"] for t in side["turns"]] == [False, True, False]
    split = data["main"]["turns"][1]
    at = split["split_at"]
    assert split["tokens"][at]["text"] == "+" and data["other"]["turns"][1]["tokens"][at]["text"] == "-"
    assert [t["text"] for t in split["tokens"][:at]] == [t["text"] for t in data["other"]["turns"][1]["tokens"][:at]]
    assert data["main"]["final_answer"] != data["other"]["final_answer"]
    # Without compare the divergence is offered, nothing is marked.
    alone = client.get(traj_url("bf16", "agent-0001#0", json_twin=True)).json()
    assert alone["divergence"]["task_id"] == "agent-0001"
    assert not any(t["divergent"] for t in alone["main"]["turns"])


def test_ids_with_hash_and_at_are_url_encoded(client):
    url = traj_url("fp32", PROBE, json_twin=True, trainer="fp32")
    assert "%23" in url and "%40" in url
    data = client.get(url).json()
    assert data["trajectory_id"] == PROBE and data["self_ref"]["path"] == traj_url("fp32", PROBE, trainer="fp32")
    assert client.get(traj_url("fp32", PROBE)).status_code == 200
    # Unencoded, '#' starts a fragment: the server sees 'agent-0000' and says so.
    bare = client.get(f"/runs/{RUN_ID}/trajectory/fp32/agent-0000#0.json")
    assert bare.status_code == 404
    hrefs = [h for h in re.findall(r'href="([^"]*)"', client.get(f"/runs/{RUN_ID}").text) if "/trajectory/" in h]
    assert hrefs
    for href in hrefs:
        path = href.split("?")[0]
        assert "#" not in path and "%23" in path, href


@pytest.mark.parametrize("path,query,reason", [
    ("/runs/nope", "", "unknown_run"),
    (traj_url("fp4", "agent-0001#0"), "", "unknown_rollout_engine"),
    (traj_url("fp8", "agent-0099#0"), "", "unknown_trajectory"),
    (traj_url("fp8", "agent-0001#0"), "?trainer=fp64", "unknown_trainer_engine"),
    (traj_url("fp8", "agent-0001#0"), "?compare=fp8", "unknown_compare_engine"),
])
def test_unknown_things_are_typed_404s(client, path, query, reason):
    response = client.get(path + ".json" + query)
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "not_found" and error["reasons"] == [reason] and error["message"]
    html = client.get(path + query)
    assert html.status_code == 404 and reason in html.text and "text/html" in html.headers["content-type"]


def test_a_run_id_cannot_leave_the_runs_dir(runs_dir):
    from rollmarket.dashboard.data import DashboardError, Runs

    for bad in ("..", ".", "../" + RUN_ID, ""):
        with pytest.raises(DashboardError):
            Runs(runs_dir / RUN_ID / "reports").run_dir(bad)


def test_unreadable_run_is_a_typed_500(client):
    response = client.get(f"/runs/{BROKEN_RUN}.json")
    assert response.status_code == 500
    assert response.json()["error"]["reasons"] == ["unreadable_run"]


def test_every_metric_is_explained(client):
    data = client.get("/metrics.json").json()
    documented = {m["name"] for m in data["metrics"]}
    assert len(documented) == len(data["metrics"]) == len(METRICS)
    identity = {"trajectory_id", "rollout_engine", "trainer_engine", "task_id", "sample_index", "engine_a", "engine_b",
                "steps_a", "steps_b", "num_layers", "top_k", "worst_layer", "worst_trajectory_id", "low_n",
                "top_delta_tokens"}
    fields = set()
    for model in (DenseMismatchReport, RouterMismatchReport, MatrixCell, AgentDivergenceReport):
        fields |= set(model.model_fields) - identity
    assert fields <= documented, f"metrics missing from the /metrics page: {sorted(fields - documented)}"
    for m in data["metrics"]:
        assert m["formula"] and m["meaning"], m["name"]
    by_name = {m["name"]: m for m in data["metrics"]}
    assert "0.99" in by_name["token_ess"]["bands"] and "15%" in by_name["router_flip_rate"]["bands"]
    # Our token ESS is only a neighbour of verl's (which clips the weights to [1/C, C]).
    assert by_name["token_ess"]["verl"].startswith("≈ rollout_corr/rollout_is_eff_sample_size")
    assert by_name["kl_k1"]["verl"] == "rollout_corr/kl"
    assert by_name["mean_abs_delta"]["slime"] == "train/train_rollout_logprob_abs_diff"
    html = client.get("/metrics").text
    assert all(f'data-metric="{name}"' in html for name in documented)


def test_pages_load_nothing_from_the_network(client, runs_dir):
    """Charts come from the vendored Chart.js: no script or stylesheet from http(s) on any page."""
    urls = ["/", "/metrics", f"/runs/{RUN_ID}", traj_url("fp8", "agent-0001#0", trainer="bf16", compare="bf16")]
    for url in urls:
        html = client.get(url).text
        sources = re.findall(r"<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)=\"([^\"]*)\"", html)
        assert sources, url
        assert not [s for s in sources if re.match(r"(https?:)?//", s)], (url, sources)
    run_page = client.get(f"/runs/{RUN_ID}").text
    assert "vendor/chart.js/chart.umd.min.js" in run_page
    chart = client.get("/static/vendor/chart.js/chart.umd.min.js")
    assert chart.status_code == 200 and "Chart.js v4" in chart.text[:200]
    assert client.get("/static/vendor/chart.js/LICENSE.md").status_code == 200
    assert client.get("/healthz").json()["ok"] is True


def test_static_export_links_resolve(runs_dir, tmp_path):
    out = tmp_path / "site"
    result = CliRunner().invoke(dashboard_command, ["--runs", str(runs_dir), "--static", str(out)])
    assert result.exit_code == 0, result.output
    html_files = list(out.rglob("*.html"))
    # 2 runs x 3 rollout engines x 31 viewer lines x 2 trainers, + 2 runs x 2 divergences x 2 sides x 2
    # trainers side by side, + index, metrics, questions and 2 run pages.
    assert len(html_files) == 2 * 3 * 31 * 2 + 2 * 2 * 2 * 2 + 5
    for page in html_files:
        assert page.with_suffix(".json").is_file(), page
        for target in re.findall(r"(?:src|href)=\"([^\"]*)\"", page.read_text()):
            assert not re.match(r"[a-z]+:", target), (page, target)
            path = unquote(urlsplit(target).path)
            assert (page.parent / path).resolve().is_file(), (page, target)
    index = json.loads((out / "index.json").read_text())
    assert [r["run_id"] for r in index["runs"]] == [RUN_ID, OLD_RUN, BROKEN_RUN]
    assert (out / "static" / "vendor" / "chart.js" / "LICENSE.md").is_file()


# ----------------------------------------------------------------------------- in the browser


@pytest.fixture(scope="module")
def server(runs_dir, tmp_path_factory):
    """`rollmarket dashboard` as a real process on a free loopback port."""
    with dashboard_process(runs_dir, tmp_path_factory.mktemp("dashboard") / "dashboard.log") as url:
        yield url


def test_run_page_renders_tiles_and_charts(page, server, matrix):
    page.goto(f"{server}/runs/{RUN_ID}")
    tiles = page.locator('[data-testid="dense-tile"]')
    assert tiles.count() == 6
    for c in matrix.cells:
        tile = page.locator(f'[data-testid="dense-tile"][data-rollout="{c.rollout_engine}"]'
                            f'[data-trainer="{c.trainer_engine}"]')
        band = EXPECTED_ESS_BAND[(c.rollout_engine, c.trainer_engine)]
        assert f"band-{band}" in tile.get_attribute("class")
        assert tile.locator('[data-testid="ess"]').inner_text() == f"{c.token_ess.mean:.4f}"
        assert tile.locator('[data-testid="n"]').inner_text() == f"n={c.n}"
        assert tile.locator('[data-testid="interval"]').inner_text() == f"[{c.token_ess.lo:.4f}, {c.token_ess.hi:.4f}]"
        assert tile.locator('[data-testid="mad"]').inner_text() == f"{c.mean_abs_delta.mean:.4f}"
        assert tile.locator('[data-testid="low-n"]').count() == (1 if c.low_n else 0)
        router = page.locator(f'[data-testid="router-tile"][data-rollout="{c.rollout_engine}"]'
                              f'[data-trainer="{c.trainer_engine}"]')
        assert f"band-{EXPECTED_FLIP_BAND[(c.rollout_engine, c.trainer_engine)]}" in router.get_attribute("class")
        assert router.locator('[data-testid="flip"]').inner_text() == f"{100 * c.router_flip_rate.mean:.1f}%"
        assert router.locator('[data-testid="tokens"]').inner_text() == f"{c.tokens:,} tok"
        assert router.locator('[data-testid="worst-layer"]').inner_text() == f"{100 * c.worst_layer_flip_rate:.1f}%"
    assert page.locator('[data-testid="low-n"]').inner_text() == "n < 30"
    worst = max(matrix.cells, key=lambda c: abs(c.worst_token.delta)).worst_token
    card = page.locator('[data-testid="worst-token"]')
    assert card.locator('[data-testid="delta"]').inner_text() == f"{worst.delta:+.4f}"
    assert worst.token_text in card.inner_text() and f"{worst.rollout_logprob:.4f}" in card.inner_text()
    for canvas in ("chart-ess", "chart-delta"):
        assert chart_pixels(page, canvas) > 2000, canvas
        assert page.evaluate(f"Chart.getChart(document.getElementById('{canvas}')).data.datasets.length") == 18
    assert page.locator('[data-testid="divergence"] tbody tr').count() == 2
    shot(page, "run")


def test_tile_click_opens_the_worst_trajectory(page, server, matrix, runs_dir):
    c = cell(matrix, "fp8", "bf16")
    page.goto(f"{server}/runs/{RUN_ID}")
    page.click('[data-testid="dense-tile"][data-rollout="fp8"][data-trainer="bf16"]')
    page.wait_for_url(re.compile(re.escape(traj_url("fp8", c.worst_trajectory_id, trainer="bf16")) + "$"))
    assert c.worst_trajectory_id in page.locator("h1").inner_text()
    assert page.locator('[data-testid="trainer-selected"]').inner_text() == "bf16"
    view = views(runs_dir, "fp8")[c.worst_trajectory_id]
    assert page.locator('[data-testid="turn"]').count() == len(view.turns)
    assert page.locator('[data-testid="tool-call"]').count() == sum(len(t.tool_calls) for t in view.turns)
    # The outlined token is the cell's worst token.
    assert page.locator("#worst").inner_text().replace("↵", "") == c.worst_token.token_text
    shot(page, "trajectory")


def test_hovering_a_token_shows_both_logprobs(page, server, runs_dir):
    view = views(runs_dir, "bf16")["agent-0002#0"]
    page.goto(server + traj_url("bf16", "agent-0002#0", trainer="bf16"))
    tip = page.locator("#tip")
    assert tip.is_hidden()
    index = 7
    token = page.locator('[data-testid="tokens"]').first.locator(".tok").nth(index)
    rollout, trainer = view.turns[0].rollout_logprobs[index], view.turns[0].trainer_logprobs["bf16"][index]
    title = token.get_attribute("title")
    assert f"{rollout:.4f}" in title and f"{trainer:.4f}" in title
    token.hover()
    tip.wait_for(state="visible")
    text = tip.inner_text()
    assert "rollout logprob" in text and "trainer (bf16) logprob" in text
    assert f"{rollout:.4f}" in text and f"{trainer:.4f}" in text
    assert f"{trainer - rollout:+.4f}" in text
    shot(page, "tooltip")
    page.mouse.move(1, 1)
    tip.wait_for(state="hidden")


def test_side_by_side_marks_the_divergent_turn(page, server):
    page.goto(f"{server}/runs/{RUN_ID}")
    page.locator('[data-testid="divergence"] tr[data-trajectory="agent-0001#0"] [data-testid="compare-link"]').click()
    page.wait_for_url(re.compile(r"compare=fp8"))
    sides = page.locator('[data-testid="side"]')
    assert sides.count() == 2
    assert [sides.nth(i).get_attribute("data-engine") for i in range(2)] == ["bf16", "fp8"]
    divergent = page.locator('[data-testid="turn"][data-divergent="true"]')
    assert divergent.count() == 2
    assert {divergent.nth(i).get_attribute("data-turn") for i in range(2)} == {"1"}
    assert "tool_args" in divergent.first.locator('[data-testid="divergent-badge"]').inner_text()
    assert page.locator('[data-testid="split-mark"]').count() == 2
    assert "split at turn 1" in page.locator('[data-testid="divergence-banner"]').inner_text()
    shot(page, "side-by-side")


def test_metrics_page_lists_every_metric(page, server):
    page.goto(f"{server}/metrics")
    rows = page.locator('[data-testid="metric"]')
    assert rows.count() == len(METRICS)
    assert {rows.nth(i).get_attribute("data-metric") for i in range(rows.count())} == {m.name for m in METRICS}
    shot(page, "metrics")
    page.goto(server + "/")
    assert page.locator('[data-testid="runs"] tbody tr').count() == 3
    shot(page, "index")


def test_static_export_works_from_files_without_network(browser, runs_dir, tmp_path, matrix):
    summary = export_static(runs_dir, tmp_path / "site")
    assert summary.runs == 2
    context, page = open_page(browser)
    requests, errors = page.requests, page.errors
    try:
        page.goto((tmp_path / "site" / "index.html").as_uri())
        page.click(f'text="{RUN_ID}"')
        page.wait_for_selector('[data-testid="dense-tile"]')
        c = cell(matrix, "bf16", "fp32")
        tile = page.locator('[data-testid="dense-tile"][data-rollout="bf16"][data-trainer="fp32"]')
        assert tile.locator('[data-testid="ess"]').inner_text() == f"{c.token_ess.mean:.4f}"
        assert chart_pixels(page, "chart-ess") > 2000
        shot(page, "static-run")
        tile.click()
        page.wait_for_selector('[data-testid="tokens"]')
        assert c.worst_trajectory_id in page.locator("h1").inner_text()
        page.locator(".tok").nth(3).hover()
        page.locator("#tip").wait_for(state="visible")
        page.go_back()
        page.locator('[data-testid="compare-link"]').first.click()
        page.wait_for_selector('[data-testid="turn"][data-divergent="true"]')
        assert page.locator('[data-testid="side"]').count() == 2
        shot(page, "static-side-by-side")
    finally:
        context.close()
    assert not errors, errors
    assert requests
    assert [u for u in requests if not u.startswith("file://")] == []


def dashboard_doc() -> str:
    """The '## Dashboard' section of docs/observatory.md."""
    text = (ROOT / "docs" / "observatory.md").read_text()
    assert "\n## Dashboard\n" in text, "docs/observatory.md has no '## Dashboard' section"
    return text.split("\n## Dashboard\n", 1)[1].split("\n## ", 1)[0]


def test_every_route_option_and_error_is_documented(runs_dir):
    from rollmarket.dashboard.data import Missing

    doc = dashboard_doc()
    app = create_dashboard_app(runs_dir)
    paths = {getattr(r, "path", None) for r in app.routes} - {None}
    paths = {p if p != "/static" else "/static/{path}" for p in paths}
    missing = [p for p in sorted(paths) if f"`{p}`" not in doc]
    assert not missing, f"routes missing from the dashboard docs: {missing}"
    options = [o for p in dashboard_command.params for o in p.opts if o.startswith("--")]
    assert not [o for o in options if f"`{o}`" not in doc]
    assert not [m.value for m in Missing if f"`{m.value}`" not in doc]


def test_a_dense_model_run_has_no_router_matrix(client):
    data = client.get(f"/runs/{OLD_RUN}.json").json()
    assert data["run"]["moe"] is False
    assert all(t["flip_band"] is None for row in data["tiles"] for t in row["tiles"])
    html = client.get(f"/runs/{OLD_RUN}").text
    assert 'data-testid="dense-tile"' in html and 'data-testid="router-tile"' not in html


def test_a_half_written_last_line_is_skipped_and_a_bad_line_is_a_typed_500(tmp_path):
    run = write_fixture_run(tmp_path / RUN_ID)
    client = TestClient(create_dashboard_app(tmp_path))
    path = run / layout.DIVERGENCE
    whole = path.read_text()
    path.write_text(whole + whole.splitlines()[0][:40])  # the writer is mid-line
    assert len(client.get(f"/runs/{RUN_ID}.json").json()["divergence"]) == 2
    path.write_text("{broken\n" + whole)
    response = client.get(f"/runs/{RUN_ID}.json")
    assert response.status_code == 500 and response.json()["error"]["reasons"] == ["unreadable_run"]
    assert "divergence.jsonl: line 1" in response.json()["error"]["message"]


def test_the_console_prints_every_tile_of_the_matrix(matrix):
    """`rollmarket observe` (and the demos' --observe) print the matrix with observatory.console:
    every tile's token ESS, its interval and n, and the router table when the run has router rates."""
    from rich.console import Console

    from rollmarket.observatory.console import print_matrix

    out = Console(record=True, width=400, color_system=None)
    print_matrix(matrix, out)
    text = out.export_text()
    for cell in matrix.cells:
        if cell.token_ess.mean is not None:
            assert f"{cell.token_ess.mean:.4f} [{cell.token_ess.lo:.4f}, {cell.token_ess.hi:.4f}]" in text
            assert f"n={cell.n}" in text
    has_router = any(c.router_flip_rate is not None for c in matrix.cells)
    assert ("router flip rate" in text) == has_router
