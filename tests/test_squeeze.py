"""`rollmarket squeeze RUN` (research/squeeze.py): LoRA rank analysis of a trained adapter.

Constructed adapters with chosen singular values lock the formulas (hand-worked energies and ranks,
and numpy's SVD of the full product as an independent check); one real LoRA training step gives a
real adapter, checked against the update the run published in its merged weights.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import save_file

from rollmarket.research.squeeze import (BadRetention, NoAdapter, NoCheckpoint, NotARun, analyse, energy_columns,
                                         energy_kept, lora_singular_values, rank_for, squeeze_run)

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "models" / "tiny-moe")


def adapter_with(sigma: list[float], out: int = 12, inp: int = 10, scale: float = 2.0, seed: int = 0):
    """(A r × in, B out × r) whose update scale·B·A has exactly the singular values `sigma`:
    B = U·diag(σ)/scale and A = Vᵀ with U, V orthonormal columns."""
    rng = np.random.default_rng(seed)
    u_OR, _ = np.linalg.qr(rng.normal(size=(out, len(sigma))))
    v_IR, _ = np.linalg.qr(rng.normal(size=(inp, len(sigma))))
    return v_IR.T.copy(), u_OR * (np.asarray(sigma) / scale)


def test_singular_values_are_recovered_without_the_full_product():
    a_RI, b_OR = adapter_with([3.0, 2.0, 1.0, 0.5], scale=2.0)
    sigma = lora_singular_values(a_RI, b_OR, scale=2.0)
    np.testing.assert_allclose(sigma, [3.0, 2.0, 1.0, 0.5], rtol=1e-10)
    # Independently: numpy's SVD of the full out × in update.
    np.testing.assert_allclose(sigma, np.linalg.svd(2.0 * b_OR @ a_RI, compute_uv=False)[:4], rtol=1e-10)


def test_rank_deficient_and_wide_adapters():
    # One direction only: the rest are zeros, and rank 1 keeps everything.
    a_RI, b_OR = adapter_with([2.0, 0.0, 0.0, 0.0], scale=1.0)
    sigma = lora_singular_values(a_RI, b_OR, scale=1.0)
    np.testing.assert_allclose(sigma, [2.0, 0.0, 0.0, 0.0], atol=1e-12)
    assert rank_for(energy_kept(sigma), 0.95) == 1
    # out < r: the update has rank ≤ out; the singular values still come out r long, padded with zeros.
    rng = np.random.default_rng(1)
    a_RI, b_OR = rng.normal(size=(6, 9)), rng.normal(size=(3, 6))
    full = np.linalg.svd(0.5 * b_OR @ a_RI, compute_uv=False)
    np.testing.assert_allclose(lora_singular_values(a_RI, b_OR, scale=0.5), [*full, 0, 0, 0], atol=1e-12)


def test_energy_and_rank_by_hand():
    # σ² = 9, 4, 1, 0.25; total 14.25.
    energy = energy_kept(np.array([3.0, 2.0, 1.0, 0.5]))
    np.testing.assert_allclose(energy, [9 / 14.25, 13 / 14.25, 14 / 14.25, 1.0])
    assert [rank_for(energy, x) for x in (0.6, 0.9, 0.95, 0.99, 1.0)] == [1, 2, 3, 4, 4]
    assert energy_kept(np.zeros(4)) is None and rank_for(None, 0.95) is None
    # The table's columns: every rank up to 8, then powers of two and r.
    assert energy_columns(4) == [1, 2, 3, 4] and energy_columns(12) == [1, 2, 4, 8, 12]


def test_aggregate_over_modules_by_hand():
    """Module ranks at retention 0.9: one direction → 1; σ = 3, 2, 1, .5 → 2 (E(2) = .912);
    σ = 2, 1, 1, 1 → 4 (E = 4/7, 5/7, 6/7, 1). Max 4, median 2. The mean energy at k = 2 is
    (1 + 13/14.25 + 5/7)/3 = .875 and at k = 3 (1 + 14/14.25 + 6/7)/3 = .946: the guide's rule says 3.
    A module whose B is still zero is left out and counted."""
    scale = 16 / 4
    adapters = {
        "m.one": adapter_with([1.0, 0, 0, 0], scale=scale, seed=1),
        "m.two": adapter_with([3.0, 2.0, 1.0, 0.5], scale=scale, seed=2),
        "m.four": adapter_with([2.0, 1.0, 1.0, 1.0], scale=scale, seed=3),
        "m.zero": (np.ones((4, 10)), np.zeros((12, 4))),
    }
    report = analyse(adapters, r=4, alpha=16, retention=0.9)
    by_name = {m.module: m for m in report.modules}
    assert {n: m.rank for n, m in by_name.items()} == {"m.one": 1, "m.two": 2, "m.four": 4, "m.zero": None}
    np.testing.assert_allclose(by_name["m.four"].singular_values, [2, 1, 1, 1], rtol=1e-10)
    assert (report.recommended_rank, report.median_rank, report.mean_energy_rank) == (4, 2.0, 3)
    assert report.zero_modules == 1 and report.scale == 4.0
    np.testing.assert_allclose(report.mean_energy[1], (1 + 13 / 14.25 + 5 / 7) / 3)
    np.testing.assert_allclose(report.min_energy[0], 4 / 7)


# -- a real run -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    """One real LoRA training step of the tiny MoE through the closed loop (as tests/test_train_loop.py)."""
    from rollmarket.train.config import resolve
    from rollmarket.train.loop import Trainer

    tmp = tmp_path_factory.mktemp("squeeze")
    overrides = [
        f"model.path={json.dumps(MODEL)}", "rollout.suite=arithmetic", "rollout.groups_per_step=2",
        "rollout.group_size=2", "rollout.temperature=2.0", "rollout.max_tokens=48", "agent.max_turns=3",
        "local.lease_ttl_s=8", f"runs_root={json.dumps(str(tmp))}", "loop.steps=2", "rollout.precisions=['bf16']",
        "local.workers=['bf16']", "eval.tasks=0", "lora.enabled=true", "lora.r=4", "optim.lr=5e-3",
        "squeeze.min_variance_retention=0.9",
    ]
    return Trainer(resolve(None, overrides), local=True).run()


def test_a_real_adapter_gives_squeeze_json_matching_the_published_update(lora_run):
    """The singular values squeeze reads from the adapters equal those of (published − base) weights,
    the update the run merged into its checkpoint: an independent path through peft's own merge."""
    import torch
    from safetensors.torch import load_file

    from rollmarket.cli.main import main

    result = CliRunner().invoke(main, ["squeeze", str(lora_run), "--json"], prog_name="rollmarket")
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    written = json.loads((lora_run / "squeeze.json").read_text())
    assert printed == written
    assert written["retention"] == 0.9  # the run's own setting
    assert (written["lora_r"], written["lora_alpha"], written["checkpoint"]) == (4, 16.0, "v0002")
    # 4 attention projections in each of the tiny MoE's layers.
    layers = json.loads((Path(MODEL) / "config.json").read_text())["num_hidden_layers"]
    assert len(written["modules"]) == 4 * layers
    assert written["zero_modules"] == 0, "two steps at lr 5e-3 moved every adapter"

    trained = load_file(str(lora_run / "checkpoints" / "v0002" / "model.safetensors"))
    base = load_file(str(Path(MODEL) / "model.safetensors"))
    for module in written["modules"]:
        key = module["module"] + ".weight"
        delta = (trained[key].to(torch.float64) - base[key].to(torch.float64)).numpy()
        full = np.linalg.svd(delta, compute_uv=False)[:4]
        # The published weights are float32 sums W + ΔW: rounding of W limits the agreement.
        np.testing.assert_allclose(module["singular_values"], full, atol=2e-6 + 1e-3 * full[0])
        energy = np.cumsum(np.square(module["singular_values"])) / np.sum(np.square(module["singular_values"]))
        assert module["rank"] == 1 + int(np.argmax(energy >= 0.9 - 1e-12))
    assert written["recommended_rank"] == max(m["rank"] for m in written["modules"])


def test_the_table_names_the_recommendation(lora_run):
    from rollmarket.cli.main import main

    result = CliRunner().invoke(main, ["squeeze", str(lora_run), "--retention", "0.5"], prog_name="rollmarket")
    assert result.exit_code == 0, result.output
    assert "recommended rank" in result.stdout and "rank for 50%" in result.stdout
    assert json.loads((lora_run / "squeeze.json").read_text())["retention"] == 0.5


def test_squeeze_never_imports_torch(lora_run):
    code = ("import sys\nfrom rollmarket.cli.main import main\n"
            f"try:\n    main(['squeeze', {str(lora_run)!r}, '--json'])\nexcept SystemExit as e:\n    assert e.code == 0, e\n"
            "assert 'torch' not in sys.modules, 'squeeze imported torch'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


# -- errors ---------------------------------------------------------------------------------------


def fake_run(tmp_path: Path, *, lora: bool, checkpoint: bool) -> Path:
    """A run directory's shape, for the cases a real run cannot reach cheaply."""
    run = tmp_path / "run"
    (run).mkdir()
    (run / "config.json").write_text(json.dumps({"config": {"lora": {"enabled": lora, "r": 4, "alpha": 8}}}))
    if checkpoint:
        state = run / "checkpoints" / "v0001" / "trainer"
        state.mkdir(parents=True)
        (state / "state.json").write_text("{}")
        if lora:
            a_RI, b_OR = adapter_with([1.0, 0.5, 0, 0], scale=2.0)
            save_file({"base_model.model.layer.q_proj.lora_A.default.weight": a_RI.astype(np.float32),
                       "base_model.model.layer.q_proj.lora_B.default.weight": b_OR.astype(np.float32)},
                      str(state / "adapters.safetensors"))
    return run


def test_a_constructed_run_squeezes(tmp_path):
    run = fake_run(tmp_path, lora=True, checkpoint=True)
    report = squeeze_run(run)
    assert report.retention == 0.95 and report.checkpoint == "v0001"
    np.testing.assert_allclose(report.modules[0].singular_values, [1.0, 0.5, 0, 0], atol=1e-6)
    assert report.recommended_rank == 2  # E(1) = 1/1.25 = 0.8 < 0.95


@pytest.mark.parametrize("lora,checkpoint,error,needle", [
    (False, True, NoAdapter, "full fine-tune"),
    (True, False, NoCheckpoint, "no checkpoint"),
])
def test_runs_without_an_adapter_or_checkpoint_are_typed_errors(tmp_path, lora, checkpoint, error, needle):
    run = fake_run(tmp_path, lora=lora, checkpoint=checkpoint)
    with pytest.raises(error, match=needle):
        squeeze_run(run)
    assert not (run / "squeeze.json").exists()


def test_a_directory_that_is_not_a_run(tmp_path):
    with pytest.raises(NotARun, match="not a training run"):
        squeeze_run(tmp_path)


@pytest.mark.parametrize("bad", [0, -0.1, 1.5, math.nan, "most"])
def test_bad_retention_is_refused_and_writes_nothing(tmp_path, bad):
    run = fake_run(tmp_path, lora=True, checkpoint=True)
    with pytest.raises(BadRetention):
        squeeze_run(run, retention=bad)
    assert not (run / "squeeze.json").exists()


@pytest.mark.parametrize("args,code,needle", [
    (["--retention", "1.5"], 2, "outside (0, 1]"),
    (["--checkpoint", "v0009"], 1, "no complete checkpoint 'v0009'"),
])
def test_the_cli_reports_one_line(tmp_path, monkeypatch, args, code, needle):
    from rollmarket.cli.main import main

    monkeypatch.delenv("ROLLMARKET_DEBUG", raising=False)
    run = fake_run(tmp_path, lora=True, checkpoint=True)
    result = CliRunner().invoke(main, ["squeeze", str(run), *args], prog_name="rollmarket")
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == code and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and needle in lines[0] and " — " in lines[0]
    assert not (run / "squeeze.json").exists()
