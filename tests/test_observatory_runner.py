"""`rollmarket observe` on the shipped tiny MoE: the matrix, the reports and the divergence it writes
agree with an independent teacher forcing of the same stored tokens."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rollmarket.contracts import AgentTrajectory, DenseMismatchReport, ObservatoryMatrix, RouterMismatchReport
from rollmarket.observatory import layout

REPO = Path(__file__).resolve().parents[1]
MOE = REPO / "models" / "tiny-moe"
pytestmark = pytest.mark.timeout(660)  # the module's observe run may take 600 s on a loaded box


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    runs = tmp_path_factory.mktemp("observe")
    done = subprocess.run(
        [sys.executable, "-m", "rollmarket", "observe", "--model", str(MOE), "--suite", "agent",
         "--rollout-engines", "fp32,fp8", "--trainer-engines", "fp32,fsdp-bf16", "--n", "6", "--lengths", "32,96",
         "--length-n", "3", "--max-tokens", "64", "--runs-dir", str(runs)],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    [run] = list(runs.iterdir())
    return run, done.stderr


def test_the_matrix_has_every_tile_with_n_and_intervals(observed):
    run, _ = observed
    matrix = ObservatoryMatrix.model_validate_json((run / "matrix.json").read_text())
    assert [(c.rollout_engine, c.trainer_engine) for c in matrix.cells] == [
        ("fp32", "fp32"), ("fp8", "fp32"), ("fp32", "fsdp-bf16"), ("fp8", "fsdp-bf16")]
    cells = {(c.rollout_engine, c.trainer_engine): c for c in matrix.cells}
    for cell in matrix.cells:
        assert cell.n == 6 and cell.low_n and cell.tokens > 0
        e = cell.token_ess
        assert e.n == 6 and e.lo <= e.mean <= e.hi <= 1.0
        assert cell.router_flip_rate is not None and cell.worst_layer in range(4)
    # fp32 sampling scored at fp32 agrees (KV cache vs one forward pass: rounding only); fp8 does not.
    same = cells[("fp32", "fp32")]
    assert same.token_ess.mean > 0.9999 and same.mean_abs_delta.mean < 1e-3
    assert cells[("fp8", "fp32")].mean_abs_delta.mean > same.mean_abs_delta.mean
    assert cells[("fp8", "fp32")].worst_token is not None


def test_reports_match_an_independent_teacher_forcing(observed):
    from rollmarket.agents import stitch
    from rollmarket.engines import TrainerEngine

    run, _ = observed
    runs = [AgentTrajectory.model_validate_json(line)
            for line in layout.trajectories_path(run, "fp8").read_text().splitlines()]
    dense = [DenseMismatchReport.model_validate_json(line)
             for line in layout.dense_path(run, "fp8", "fp32").read_text().splitlines()]
    router = [RouterMismatchReport.model_validate_json(line)
              for line in layout.router_path(run, "fp8", "fp32").read_text().splitlines()]
    assert len(runs) == len(dense) == len(router) == 6
    trainer = TrainerEngine.from_path(MOE, "fp32")
    deltas = []
    for agent_run, report, routes in zip(runs, dense, router):
        assert report.trajectory_id == f"{agent_run.task_id}#0" == routes.trajectory_id
        view = stitch(agent_run.steps)
        scored = trainer.score(view.prompt_token_ids_P, view.response_token_ids_T)
        valid = view.action_mask_T.astype(bool)
        delta = (scored.logprobs_T - view.logprobs_T)[valid].astype(np.float64)
        w = np.exp(np.clip(delta, -20, 20))
        assert report.n_tokens == int(valid.sum())
        assert report.token_ess == pytest.approx(w.sum() ** 2 / (w.size * (w * w).sum()), abs=1e-6)
        assert report.mean_abs_delta == pytest.approx(np.abs(delta).mean(), abs=1e-6)
        top1 = view.routed_experts_TLK[valid][..., 0] != scored.routed_experts_TLK[valid][..., 0]
        assert routes.router_flip_rate == pytest.approx(top1.mean(), abs=1e-9)
        deltas.append(delta)
    # The tile's verl figures, the six runs as verl's batch: k1 and the ESS of weights in [1/2, 2].
    matrix = ObservatoryMatrix.model_validate_json((run / "matrix.json").read_text())
    [tile] = [c for c in matrix.cells if (c.rollout_engine, c.trainer_engine) == ("fp8", "fp32")]
    every = np.concatenate(deltas)
    clipped = np.clip(np.exp(np.clip(every, -20, 20)), 0.5, 2.0)
    assert tile.rollout_corr.kl == pytest.approx(-every.mean(), abs=1e-6)
    assert tile.rollout_corr.rollout_is_eff_sample_size == pytest.approx(clipped.mean() ** 2 / (clipped ** 2).mean(),
                                                                         abs=1e-6)


def test_length_probes_are_sampled_to_their_length(observed):
    run, _ = observed
    matrix = ObservatoryMatrix.model_validate_json((run / "matrix.json").read_text())
    points = {(p.rollout_engine, p.trainer_engine, p.max_tokens): p for p in matrix.length_scaling}
    assert set(points) == {(r, t, L) for r in ("fp32", "fp8") for t in ("fp32", "fsdp-bf16") for L in (32, 96)}
    for (_, _, length), point in points.items():
        assert point.mean_response_tokens == length and point.token_ess.n == 3
    # Probes hold no tool output, so every token their reports leave out came after an EOS; the
    # position profile covers exactly the tokens the reports do, position 0 in every probe.
    profiles = {(p.rollout_engine, p.trainer_engine): p for p in matrix.position_scaling}
    assert set(profiles) == {(r, t) for r in ("fp32", "fp8") for t in ("fp32", "fsdp-bf16")}
    for (rollout, trainer), profile in profiles.items():
        path = run / "reports" / f"{layout.pair(rollout, trainer)}.lengths.dense.jsonl"
        reports = [DenseMismatchReport.model_validate_json(line) for line in path.read_text().splitlines()]
        assert len(reports) == profile.n_trajectories == 6
        after = {L: sum(r.response_length - r.n_tokens for r in reports if r.response_length == L) for L in (32, 96)}
        for L in (32, 96):
            point = points[(rollout, trainer, L)]
            assert point.tokens_after_eos == after[L]
            assert point.mean_valid_tokens == pytest.approx(L - after[L] / 3)
        assert profile.tokens_after_eos == after[32] + after[96]
        assert sum(b.n_tokens for b in profile.buckets) == sum(r.n_tokens for r in reports)
        assert (profile.buckets[0].start, profile.buckets[0].stop, profile.buckets[0].n_trajectories) == (0, 16, 6)


def test_divergence_ties_the_split_to_tokens_and_the_viewer_has_every_run(observed):
    run, _ = observed
    matrix = ObservatoryMatrix.model_validate_json((run / "matrix.json").read_text())
    assert len(matrix.divergence) == 6  # every fp8 run compared with the fp32 run of the same task and seed
    fp32 = {json.loads(line)["task_id"]: AgentTrajectory.model_validate_json(line)
            for line in layout.trajectories_path(run, "fp32").read_text().splitlines()}
    for report in matrix.divergence:
        assert report.engine_a == "fp32" and report.engine_b == "fp8"
        if report.first_divergent_step is None:
            assert report.kind.value == "none" and report.final_answer_match_strict
            continue
        step = fp32[report.task_id].steps[report.first_divergent_step]
        if report.split_turn is not None:
            assert report.split_turn.n_tokens == step.num_response_tokens
            assert report.top_delta_tokens and all(t.position < step.num_response_tokens
                                                   for t in report.top_delta_tokens)
    views = [layout.TrajectoryView.model_validate_json(line)
             for line in layout.viewer_path(run, "fp8").read_text().splitlines()]
    assert len(views) == 6
    for view in views:
        for turn in view.turns:
            assert len(turn.tokens) == len(turn.rollout_logprobs) == len(turn.trainer_logprobs["fp32"])
            assert set(turn.trainer_logprobs) == {"fp32", "fsdp-bf16"}


def test_the_dashboard_serves_a_real_run(observed):
    """The dashboard was built against a fixture; here it reads what `observe` really wrote."""
    from urllib.parse import quote

    from fastapi.testclient import TestClient

    from rollmarket.dashboard.app import create_dashboard_app

    run, _ = observed
    client = TestClient(create_dashboard_app(run.parent))
    assert [r["run_id"] for r in client.get("/index.json").json()["runs"]] == [run.name]
    page = client.get(f"/runs/{run.name}.json").json()
    matrix = ObservatoryMatrix.model_validate_json((run / "matrix.json").read_text())
    assert page["rollout_engines"] == matrix.rollout_engines and page["trainer_engines"] == matrix.trainer_engines
    assert client.get(f"/runs/{run.name}").status_code == 200
    for cell in matrix.cells:
        tid = quote(cell.worst_trajectory_id, safe="")
        other = "fp8" if cell.rollout_engine == "fp32" else "fp32"
        url = f"/runs/{run.name}/trajectory/{cell.rollout_engine}/{tid}?trainer={cell.trainer_engine}&compare={other}"
        assert client.get(url).status_code == 200, url
        data = client.get(url.replace(f"/{tid}?", f"/{tid}.json?")).json()
        assert data["trajectory_id"] == cell.worst_trajectory_id
