"""Length scaling: per-trajectory token ESS against per-position figures, and probes cut at EOS.

Every token drifts alike: Δ_t = ±a with probability ½ each, independently. Then per-token |Δ| is a
everywhere and k3 = ((e^a − a − 1) + (e^−a + a − 1)) / 2 = cosh a − 1 wherever the signs balance,
while the expected token ESS of a trajectory of L tokens is
    E_L = Σ_k C(L, k) 2^−L · (k e^a + (L−k) e^−a)² / (L · (k e^2a + (L−k) e^−2a)),
exactly 1 at L = 1 and falling towards cosh²a / cosh 2a: a small-sample effect, not accumulating drift.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from rollmarket.observatory import dense_summary
from rollmarket.observatory.positions import after_eos_mask, bucket_bounds, bucket_index_T, position_profile
from rollmarket.observatory.runner import _length_points, _reports, position_profile_of, probe_run

A = 1.0
ROOT = Path(__file__).resolve().parents[1]


def expected_ess(L: int) -> float:
    def ess(k):
        return (k * math.exp(A) + (L - k) * math.exp(-A)) ** 2 / (L * (k * math.exp(2 * A) + (L - k) * math.exp(-2 * A)))
    return sum(math.comb(L, k) / 2 ** L * ess(k) for k in range(L + 1))


def trajectory(signs) -> tuple[np.ndarray, np.ndarray]:
    """rollout logprobs −2 everywhere, trainer −2 ± a: Δ = ±a."""
    signs_T = np.asarray(signs, dtype=np.float64)
    rollout_T = np.full(signs_T.shape, -2.0)
    return rollout_T, rollout_T + A * signs_T


def test_buckets_start_at_16_and_double():
    positions = [0, 15, 16, 31, 32, 63, 64, 127, 128, 1023, 1024, 2047, 2048]
    assert bucket_index_T(np.array(positions)).tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 6, 7, 7, 8]
    assert [bucket_bounds(i) for i in range(4)] == [(0, 16), (16, 32), (32, 64), (64, 128)]
    with pytest.raises(ValueError):
        bucket_index_T(np.array([-1]))


def test_uniform_drift_ess_falls_with_length_but_per_position_figures_are_flat():
    trajectories = []
    mean_ess = {}
    # Every sign pattern of lengths 1, 2, 4, 8: the exact expectation.
    for L in (1, 2, 4, 8):
        pats = [trajectory(p) for p in itertools.product((1, -1), repeat=L)]
        trajectories += pats
        mean_ess[L] = float(np.mean([dense_summary(r, t).token_ess for r, t in pats]))
    # Longer ones: random patterns and their mirrors (so every position holds as many +a as −a).
    rng = np.random.default_rng(3)
    long = []
    for _ in range(60):
        signs = rng.choice([1, -1], size=64)
        long += [trajectory(signs), trajectory(-signs)]
    trajectories += long
    mean_ess[64] = float(np.mean([dense_summary(r, t).token_ess for r, t in long]))

    for L in (1, 2, 4, 8):
        assert math.isclose(mean_ess[L], expected_ess(L), rel_tol=1e-6), (L, mean_ess[L], expected_ess(L))
    assert mean_ess[1] == 1.0
    # L = 2: half the patterns have equal signs (ESS 1), half (e^a + e^−a)² / (2(e^2a + e^−2a)).
    assert math.isclose(mean_ess[2], (1 + math.cosh(A) ** 2 / math.cosh(2 * A)) / 2, rel_tol=1e-6)
    assert mean_ess[1] > mean_ess[2] > mean_ess[4] > mean_ess[8] > mean_ess[64]
    assert abs(mean_ess[64] - math.cosh(A) ** 2 / math.cosh(2 * A)) < 0.01

    profile = position_profile([(r, t, None) for r, t in trajectories])
    assert [(b.start, b.stop) for b in profile] == [(0, 16), (16, 32), (32, 64)]
    # Bucket 0: positions 0..15 of every trajectory; lengths 1, 2, 4, 8 hold 2·1 + 4·2 + 16·4 + 256·8.
    assert profile[0].n_tokens == 2 * 1 + 4 * 2 + 16 * 4 + 256 * 8 + 120 * 16
    assert profile[0].n_trajectories == len(trajectories)
    assert (profile[1].n_tokens, profile[2].n_tokens) == (120 * 16, 120 * 32)
    assert profile[1].n_trajectories == profile[2].n_trajectories == 120
    for b in profile:
        assert math.isclose(b.mean_abs_delta, A, rel_tol=1e-12)
        assert math.isclose(b.kl_k3, math.cosh(A) - 1, rel_tol=1e-12)


def test_tokens_after_eos_are_marked():
    assert after_eos_mask([5, 7, 2, 9, 2, 4], [2]).tolist() == [False, False, False, True, True, True]
    assert after_eos_mask([5, 7, 9], [2, 3]).tolist() == [False, False, False]
    assert after_eos_mask([3, 2, 2], [2, 3]).tolist() == [False, True, True]  # any EOS id counts
    assert after_eos_mask([], [2]).tolist() == []


def test_probe_figures_exclude_the_tokens_after_eos():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ROOT / "models" / "tiny-moe"))
    eos = 7
    # Probe of length 6: EOS at index 2; the three tokens after it were forced by ignore_eos and the
    # trainer finds them absurd (Δ = −40): were they counted, |Δ| and k3 would explode.
    ids = np.array([11, 12, eos, 13, 14, 15])
    rollout_T = np.full(6, -1.0)
    trainer_T = np.array([-1.5, -0.5, -1.0, -41.0, -41.0, -41.0])
    gen = SimpleNamespace(prompt_token_ids_P=np.array([1, 2]), token_ids_T=ids, logprobs_T=rollout_T,
                          routed_experts_TLK=None)
    run = probe_run("task-1", 6, gen, [eos])
    assert run.valid_T.tolist() == [True, True, True, False, False, False]
    scored = SimpleNamespace(logprobs_T=trainer_T, routed_experts_TLK=None)
    dense, _ = _reports(run, "fp8", "fp32", scored, tokenizer)
    # Valid Δ = [−0.5, +0.5, 0]: mean |Δ| = 1/3; the worst token is one of the first two.
    assert dense.n_tokens == 3 and math.isclose(dense.mean_abs_delta, 1 / 3, rel_tol=1e-12)
    assert dense.worst_token.position in (0, 1)
    profile = position_profile_of("fp8", "fp32", [run], [trainer_T])
    assert profile.tokens_after_eos == 3 and len(profile.buckets) == 1
    b = profile.buckets[0]
    assert (b.n_tokens, b.n_trajectories) == (3, 1)
    assert math.isclose(b.mean_abs_delta, 1 / 3, rel_tol=1e-12)
    # k3 per token e^Δ − Δ − 1: (e^−0.5 + 0.5 − 1) + (e^0.5 − 0.5 − 1) + 0 = 2 cosh 0.5 − 2, over 3.
    assert math.isclose(b.kl_k3, (2 * math.cosh(0.5) - 2) / 3, rel_tol=1e-12)
    (point,) = _length_points("fp8", "fp32", [run], [dense])
    assert (point.mean_response_tokens, point.mean_valid_tokens, point.tokens_after_eos) == (6.0, 3.0, 3)
