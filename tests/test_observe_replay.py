"""Router replay in the observatory (`<engine>+replay` trainer engines) on the shipped tiny MoE.

Each cell is shown with and without replay. The replay cells' numbers are checked against a
teacher forcing done here: the stored rollout's experts replayed through `TrainerEngine` and the
experts its forward used read back from each layer's `mlp.experts` inputs (not from the engine's
capture or the runner), so "router flips are zero" is counted, not assumed. The FSDP engine
(gloo, 2 ranks, as the observatory runs it) replays like the single-process engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from rollmarket.contracts import AgentTrajectory, DenseMismatchReport, ObservatoryMatrix, RouterMismatchReport
from rollmarket.observatory import layout
from rollmarket.observatory.engines import EngineNameError, ReplayUnavailable, parse_trainer, with_replay_twins
from rollmarket.observatory.runner import ObserveSettings, run_observatory

REPO = Path(__file__).resolve().parents[1]
MOE = REPO / "models" / "tiny-moe"
DENSE = REPO / "models" / "tiny-dense"


def small(**kw) -> ObserveSettings:
    base = dict(model=str(MOE), rollout_engines=["fp8"], trainer_engines=["fp32"], n=3, lengths=[],
                max_steps=2, max_tokens=32, concurrency=3)
    return ObserveSettings(**{**base, **kw})


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    """fp8 rollouts (3 agent runs, two 24-token probes) × fp32 with and without replay, and
    fsdp-bf16+replay (one FSDP launch: its plain twin is the FSDP engine's own tests' business)."""
    run = tmp_path_factory.mktemp("replay") / "run"
    matrix = run_observatory(small(trainer_engines=["fp32", "fp32+replay", "fsdp-bf16+replay"], lengths=[24],
                                   length_n=2), run)
    return run, matrix


def test_engine_names_parse_and_bad_ones_are_typed_errors():
    assert parse_trainer("fsdp-bf16+replay") == parse_trainer("fsdp-bf16+replay")
    name = parse_trainer("fsdp-bf16+replay")
    assert (name.precision, name.fsdp, name.replay, name.base) == ("bf16", True, True, "fsdp-bf16")
    assert (parse_trainer("fp8").fsdp, parse_trainer("fp8").replay) == (False, False)
    for bad in ("replay", "bf16+replay+replay", "fsdp-fp4", "bf16 +replay", "+replay", "fsdp-"):
        with pytest.raises(EngineNameError):
            parse_trainer(bad)
    assert with_replay_twins(["fp32", "fsdp-bf16+replay"]) == ["fp32", "fp32+replay", "fsdp-bf16", "fsdp-bf16+replay"]
    with pytest.raises(ValidationError, match="bf17"):
        small(trainer_engines=["bf17+replay"])
    # Settings saved with the twins validate to the same list (config.json round-trips).
    settings = small(trainer_engines=["fp32"], router_replay=True)
    assert ObserveSettings.model_validate(settings.model_dump()).trainer_engines == ["fp32", "fp32+replay"]


def test_replay_on_a_dense_model_is_refused_before_anything_is_written(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(ReplayUnavailable, match="MoE"):
        run_observatory(small(model=str(DENSE), trainer_engines=["fp32+replay"]), run)
    assert not run.exists()


def test_every_cell_sits_beside_its_replay_twin(observed):
    run, matrix = observed
    assert matrix.trainer_engines == ["fp32", "fp32+replay", "fsdp-bf16+replay"]
    assert ObservatoryMatrix.model_validate_json((run / "matrix.json").read_text()) == matrix
    cells = {c.trainer_engine: c for c in matrix.cells}
    for name, cell in cells.items():
        assert cell.router_replay == name.endswith("+replay") and cell.absent is None
        assert cell.n == 3 and cell.token_ess.mean is not None and cell.kl_k3.mean is not None
        assert cell.router_flip_rate is not None
    # fp8 rollouts route differently from a trainer at another precision; replay removes it.
    assert cells["fp32"].router_flip_rate.mean > 0
    for replayed in ("fp32+replay", "fsdp-bf16+replay"):
        assert cells[replayed].router_flip_rate.mean == 0.0
        assert cells[replayed].token_expert_disagreement_rate.mean == 0.0
    points = {(p.trainer_engine, p.max_tokens) for p in matrix.length_scaling}
    assert points == {(t, 24) for t in matrix.trainer_engines}


def test_replay_reports_match_a_replayed_forward_done_here(observed):
    """The fp32+replay reports against: the stitched run's experts replayed through the engine, the
    experts used read from the expert modules' inputs, flips counted with numpy."""
    from test_router_replay import ExpertInputs

    from rollmarket.agents import stitch
    from rollmarket.engines import TrainerEngine
    from rollmarket.engines.routing import OWN_ROUTING
    from rollmarket.observatory import dense_summary

    run, _ = observed
    runs = [AgentTrajectory.model_validate_json(line)
            for line in layout.trajectories_path(run, "fp8").read_text().splitlines()]
    dense = {d.trajectory_id: d for d in (DenseMismatchReport.model_validate_json(line) for line in
                                          layout.dense_path(run, "fp8", "fp32+replay").read_text().splitlines())}
    plain = {d.trajectory_id: d for d in (DenseMismatchReport.model_validate_json(line) for line in
                                          layout.dense_path(run, "fp8", "fp32").read_text().splitlines())}
    router = {r.trajectory_id: r for r in (RouterMismatchReport.model_validate_json(line) for line in
                                           layout.router_path(run, "fp8", "fp32+replay").read_text().splitlines())}
    engine = TrainerEngine.from_path(MOE, "fp32")
    changed = 0
    for agent_run in runs:
        tid = layout.trajectory_id(agent_run.task_id, agent_run.sample_index)
        view = stitch(agent_run.steps)
        P, T = view.prompt_token_ids_P.size, view.response_token_ids_T.size
        produced = view.action_mask_T.astype(bool)
        valid = produced & ~view.tool_output_mask_T.astype(bool)
        replay = np.where(produced[:, None, None], view.routed_experts_TLK, OWN_ROUTING).astype(np.int16)
        with ExpertInputs(engine.loaded.model) as used:
            scored = engine.score(view.prompt_token_ids_P, view.response_token_ids_T, replayed_experts_TLK=replay)
        used_TLK = used.indices_NLK()[P - 1:P - 1 + T]
        flips = int((used_TLK[valid][..., 0] != view.routed_experts_TLK[valid][..., 0]).sum())
        assert flips == 0 and router[tid].router_flip_rate == 0.0 and router[tid].n_tokens == int(valid.sum())
        expected = dense_summary(view.logprobs_T, scored.logprobs_T, mask=valid)
        assert dense[tid].n_tokens == expected.n_tokens
        # The observatory scores runs in padded batches, this loop one at a time: at fp32 that moves
        # a token's logprob by ~1e-6 (summation order), the mean |Δ| by up to a few 1e-7.
        assert dense[tid].mean_abs_delta == pytest.approx(expected.mean_abs_delta, rel=1e-4, abs=1e-6)
        assert dense[tid].token_ess == pytest.approx(expected.token_ess, rel=1e-6)
        changed += dense[tid].mean_abs_delta != plain[tid].mean_abs_delta
    assert changed >= 1  # replay changed the trainer's numbers on at least one run
    viewer = [layout.TrajectoryView.model_validate_json(line)
              for line in layout.viewer_path(run, "fp8").read_text().splitlines()]
    assert all(set(turn.trainer_logprobs) == {"fp32", "fp32+replay", "fsdp-bf16+replay"}
               for view in viewer for turn in view.turns)


def test_fsdp_replay_equals_the_single_process_replay(observed):
    """fsdp-bf16+replay (2 gloo ranks) against the single-process bf16 engine replaying the same experts."""
    from rollmarket.agents import stitch
    from rollmarket.engines import TrainerEngine
    from rollmarket.engines.routing import replayable

    run, _ = observed
    runs = [AgentTrajectory.model_validate_json(line)
            for line in layout.trajectories_path(run, "fp8").read_text().splitlines()]
    fsdp = {d.trajectory_id: d for d in (DenseMismatchReport.model_validate_json(line) for line in
                                         layout.dense_path(run, "fp8", "fsdp-bf16+replay").read_text().splitlines())}
    engine = TrainerEngine.from_path(MOE, "bf16")
    views = [stitch(r.steps) for r in runs]
    scored = engine.score_batch([(v.prompt_token_ids_P, v.response_token_ids_T) for v in views],
                                replayed_experts=[replayable(v.routed_experts_TLK, v.action_mask_T) for v in views])
    viewer = {v.trajectory_id: v for v in (layout.TrajectoryView.model_validate_json(line)
                                           for line in layout.viewer_path(run, "fp8").read_text().splitlines())}
    for agent_run, view, single in zip(runs, views, scored):
        tid = layout.trajectory_id(agent_run.task_id, agent_run.sample_index)
        stored = np.concatenate([t.trainer_logprobs["fsdp-bf16+replay"] for t in viewer[tid].turns])
        valid = view.action_mask_T.astype(bool)
        # bf16: half an ulp of a logit (the FSDP engine's own tolerance, test_engines_fsdp.py).
        np.testing.assert_allclose(stored, single.logprobs_T[valid], atol=2e-2, rtol=0)
        assert fsdp[tid].n_tokens == int((valid & ~view.tool_output_mask_T.astype(bool)).sum())


def test_fsdp_engine_replays_given_experts(tmp_path):
    """score_with_fsdp with replayed experts: the experts its forward used are the replayed ones
    (None and OWN_ROUTING rows route themselves), and logprobs equal the single-process replay."""
    from rollmarket.engines import TrainerEngine
    from rollmarket.engines.fsdp import score_with_fsdp
    from rollmarket.engines.routing import OWN_ROUTING

    rng = np.random.default_rng(1)
    shapes = [(30, 25), (3, 6), (12, 40)]
    pairs = [(rng.integers(3, 1500, p).tolist(), rng.integers(3, 1500, r).tolist()) for p, r in shapes]
    experts = [np.stack([[rng.permutation(8)[:2] for _ in range(4)] for _ in range(r)]).astype(np.int16)
               for _, r in shapes]
    experts[0][:5] = OWN_ROUTING
    replays = [experts[0], None, experts[2]]
    fsdp = score_with_fsdp(MOE, "fp32", pairs, world_size=2, backend="gloo", replayed_experts=replays)
    single = TrainerEngine.from_path(MOE, "fp32")
    replayed = single.score_batch(pairs, replayed_experts=replays)
    own = single.score_batch(pairs)
    for i, (a, b, c) in enumerate(zip(fsdp, replayed, own)):
        np.testing.assert_allclose(a.logprobs_T, b.logprobs_T, atol=1e-5, rtol=0)
        if replays[i] is None:
            np.testing.assert_array_equal(a.routed_experts_TLK, c.routed_experts_TLK)
            continue
        given = replays[i][:, 0, 0] != OWN_ROUTING
        np.testing.assert_array_equal(a.routed_experts_TLK[given], replays[i][given])
        np.testing.assert_array_equal(a.routed_experts_TLK[~given], c.routed_experts_TLK[~given])
        assert np.abs(a.logprobs_T - c.logprobs_T).max() > 1e-4
    with pytest.raises(ValueError, match="replayed expert arrays"):
        score_with_fsdp(MOE, "fp32", pairs, world_size=2, backend="gloo", replayed_experts=replays[:2])


def test_rollouts_without_routed_experts_give_replay_cells_that_say_why(observed, tmp_path):
    """Runs read from a file whose engine returned no routed experts: the plain cell has numbers,
    the replay cell says why it has none; the run's other rollout engine is replayed as usual."""
    run, _ = observed
    lines = layout.trajectories_path(run, "fp8").read_text().splitlines()
    stripped = tmp_path / "no-experts.jsonl"
    with open(stripped, "w") as out:
        for line in lines:
            record = json.loads(line)
            for step in record["steps"]:
                step["routed_experts"] = None
            out.write(json.dumps(record) + "\n")
    from rollmarket.observatory.runner import _Run, _score, replay_problem

    matrix = run_observatory(small(rollout_engines=["fp8", "remote"], from_rollouts={"remote": str(stripped)},
                                   trainer_engines=["fp32+replay"], router_replay=True), tmp_path / "run")
    cells = {(c.rollout_engine, c.trainer_engine): c for c in matrix.cells}
    absent = cells[("remote", "fp32+replay")]
    assert absent.n == 0 and absent.token_ess.mean is None and "no routed experts" in absent.absent
    assert cells[("remote", "fp32")].n == 3 and cells[("remote", "fp32")].absent is None
    assert cells[("fp8", "fp32+replay")].n == 3 and cells[("fp8", "fp32+replay")].router_flip_rate.mean == 0.0
    assert not layout.dense_path(tmp_path / "run", "remote", "fp32+replay").exists()
    # Asked directly, the scorer refuses with the typed error the cell's text comes from.
    bare = [_Run("x", np.array([1]), np.array([2, 3]), np.zeros(2, np.float32), np.ones(2, bool), None, [0])]
    with pytest.raises(ReplayUnavailable, match="no routed experts") as caught:
        _score(small(), "fp32+replay", bare)
    assert str(caught.value) == replay_problem(bare)


def test_the_console_and_dashboard_show_replay_side_by_side(observed, tmp_path):
    from fastapi.testclient import TestClient
    from rich.console import Console

    from rollmarket.dashboard.app import create_dashboard_app
    from rollmarket.observatory.console import print_matrix

    run, matrix = observed
    console = Console(record=True, width=240)
    print_matrix(matrix, console)
    text = console.export_text()
    assert all(name in text for name in matrix.trainer_engines) and "k3" in text
    client = TestClient(create_dashboard_app(run.parent))
    page = client.get(f"/runs/{run.name}.json").json()
    assert page["trainer_engines"] == ["fp32", "fp32+replay", "fsdp-bf16+replay"]
    [row] = page["tiles"]
    assert [t["cell"]["router_replay"] for t in row["tiles"]] == [False, True, True]
    assert [t["cell"]["router_flip_rate"]["mean"] == 0.0 for t in row["tiles"]] == [False, True, True]
    html = client.get(f"/runs/{run.name}").text
    assert html.count('data-testid="replay"') == 4  # two replay tiles in each of the two matrices


@pytest.mark.parametrize("args, needle", [
    (["--model", str(DENSE), "--trainer-engines", "bf16+replay"], "needs an MoE model"),
    (["--model", str(MOE), "--trainer-engines", "fp32,bf16+rplay"], "unknown trainer engine 'bf16+rplay'"),
])
def test_observe_refuses_bad_replay_in_one_line_and_writes_nothing(tmp_path, args, needle):
    import subprocess
    import sys

    runs = tmp_path / "runs"
    done = subprocess.run([sys.executable, "-m", "rollmarket", "observe", *args, "--n", "1", "--runs-dir", str(runs)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("error: ") and needle in line and "Traceback" not in done.stderr
    assert not runs.exists()
