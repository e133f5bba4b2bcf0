"""The observatory with a real vLLM server as a rollout engine (`rollout_urls`, `--rollout-url`).

One vLLM server (vLLM's CPU build serving the shipped tiny-moe, `tests/vllm_server.py`) is sampled
through the worker's RemoteHost and agent loop; its runs sit in the matrix as a rollout row beside
an embedded precision, scored by our trainer engines. The figures are checked against a teacher
forcing done here of the token ids stored in the run's trajectories file. vLLM on the CPU returns
no routed experts, so its replay cells say why they are absent instead of failing the run.
"""

from __future__ import annotations


import numpy as np
import pytest

from helpers import ServiceProcess
from rollmarket.contracts import AgentTrajectory, DenseMismatchReport
from rollmarket.observatory import layout
from vllm_server import MOE, START_TIMEOUT_S, running_vllm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(START_TIMEOUT_S + 600)]


@pytest.fixture(scope="module")
def vllm(tmp_path_factory) -> ServiceProcess:
    """One real vLLM server for the module (a minute or two to start)."""
    yield from running_vllm(tmp_path_factory.mktemp("vllm") / "vllm.log")


@pytest.fixture(scope="module")
def observed(vllm, tmp_path_factory):
    """`rollmarket observe` (in process) with rollout engines bf16 (embedded) and vllm (by URL)."""
    from rollmarket.observatory.runner import ObserveSettings, run_observatory

    run = tmp_path_factory.mktemp("observe") / "run"
    settings = ObserveSettings(model=str(MOE), rollout_engines=["bf16", "vllm"], rollout_urls={"vllm": vllm.url + "/v1"},
                               trainer_engines=["fp32"], router_replay=True, n=3, lengths=[], max_steps=2,
                               max_tokens=32, concurrency=3)
    return run, run_observatory(settings, run)


def test_the_vllm_row_is_in_the_matrix_against_our_trainer_engines(observed):
    from rollmarket.agents import stitch
    from rollmarket.engines import TrainerEngine
    from rollmarket.observatory import dense_summary

    run, matrix = observed
    assert matrix.rollout_engines == ["bf16", "vllm"] and matrix.trainer_engines == ["fp32", "fp32+replay"]
    cells = {(c.rollout_engine, c.trainer_engine): c for c in matrix.cells}
    plain = cells[("vllm", "fp32")]
    assert plain.n == 3 and plain.absent is None and plain.tokens > 0
    assert 0 < plain.token_ess.mean <= 1 and np.isfinite(plain.mean_abs_delta.mean) and np.isfinite(plain.kl_k3.mean)
    assert plain.router_flip_rate is None  # vLLM on the CPU returns no routed experts to compare
    # The embedded row still has both cells, replay included.
    assert cells[("bf16", "fp32+replay")].n == 3 and cells[("bf16", "fp32+replay")].router_flip_rate.mean == 0.0

    runs = [AgentTrajectory.model_validate_json(line)
            for line in layout.trajectories_path(run, "vllm").read_text().splitlines()]
    assert len(runs) == 3 and all(s.routed_experts is None and s.logprobs is not None for r in runs for s in r.steps)
    dense = {d.trajectory_id: d for d in (DenseMismatchReport.model_validate_json(line)
                                          for line in layout.dense_path(run, "vllm", "fp32").read_text().splitlines())}
    engine = TrainerEngine.from_path(MOE, "fp32")
    for agent_run in runs:
        view = stitch(agent_run.steps)
        scored = engine.score(view.prompt_token_ids_P, view.response_token_ids_T)
        valid = view.action_mask_T.astype(bool) & ~view.tool_output_mask_T.astype(bool)
        expected = dense_summary(view.logprobs_T, scored.logprobs_T, mask=valid)
        report = dense[layout.trajectory_id(agent_run.task_id, agent_run.sample_index)]
        assert report.n_tokens == expected.n_tokens > 0
        # The observatory scores the runs as one padded batch, this check one sequence at a time: at
        # fp32 the summation order moves a logprob by ~1e-7 relative (up to ~1e-6 on a mean of 0.01).
        assert report.mean_abs_delta == pytest.approx(expected.mean_abs_delta, rel=1e-4, abs=1e-6)
        # vLLM samples in bf16: its logprobs are near fp32's, not equal.
        assert 0 < report.mean_abs_delta < 1.0


def test_vllm_replay_cell_says_why_it_is_absent(observed):
    run, matrix = observed
    cell = next(c for c in matrix.cells if (c.rollout_engine, c.trainer_engine) == ("vllm", "fp32+replay"))
    assert cell.n == 0 and cell.token_ess.mean is None and cell.router_replay
    assert "no routed experts" in cell.absent and "vLLM" in cell.absent
    assert not layout.dense_path(run, "vllm", "fp32+replay").exists()


def test_the_dashboard_shows_the_vllm_row(observed):
    from fastapi.testclient import TestClient

    from rollmarket.dashboard.app import create_dashboard_app

    run, matrix = observed
    client = TestClient(create_dashboard_app(run.parent))
    page = client.get(f"/runs/{run.name}.json").json()
    rows = {row["rollout_engine"]: row["tiles"] for row in page["tiles"]}
    assert list(rows) == ["bf16", "vllm"]
    plain, replay = rows["vllm"]
    expected = next(c for c in matrix.cells if (c.rollout_engine, c.trainer_engine) == ("vllm", "fp32"))
    assert plain["cell"]["token_ess"]["mean"] == expected.token_ess.mean
    assert replay["cell"]["absent"] and replay["cell"]["n"] == 0
    html = client.get(f"/runs/{run.name}").text
    assert 'data-rollout="vllm" data-trainer="fp32"' in html
    assert html.count('data-absent="1"') == 2  # its tile in the dense and in the router matrix
    assert "no routed experts" in html
