"""research/drift.py: the arithmetic experiment (b) leans on, against hand-derived values and an
independent Monte Carlo of the positive control's weights."""

import math

import numpy as np
import pytest

from rollmarket.research.drift import (
    capped_lognormal_moments,
    cosine,
    expected_squared_change,
    fork_position,
    relative_l2,
)


def test_fork_position_is_the_first_differing_token():
    assert fork_position([1, 2, 3], [1, 2, 4]) == 2
    assert fork_position([5], [6]) == 0
    assert fork_position([1, 2], [1, 2, 3]) == 2  # one run stopped where the other went on
    assert fork_position([1, 2, 3], [1, 2, 3]) is None
    assert fork_position([], []) is None


def test_capped_lognormal_moments_by_hand():
    # No shift: every weight is exactly 1.
    assert capped_lognormal_moments(0.0, 2.0) == (1.0, 1.0)
    # A cap that never binds: the lognormal's own moments, E e^Z = e^{σ²/2}, E e^{2Z} = e^{2σ²}.
    m1, m2 = capped_lognormal_moments(0.5, 1e9)
    assert m1 == pytest.approx(math.exp(0.125), rel=1e-12)   # 1.1331484…
    assert m2 == pytest.approx(math.exp(0.5), rel=1e-12)     # 1.6487212…
    # Cap 1 (c = 0), σ = 1: E W = e^{1/2} Φ(−1) + 1 · P(Z > 0) = 1.6487213 × 0.1586553 + 0.5;
    # E W² = e² Φ(−2) + 0.5 = 7.3890561 × 0.0227501 + 0.5.
    m1, m2 = capped_lognormal_moments(1.0, 1.0)
    assert m1 == pytest.approx(1.6487213 * 0.1586553 + 0.5, abs=1e-6)
    assert m2 == pytest.approx(7.3890561 * 0.0227501 + 0.5, abs=1e-6)
    with pytest.raises(ValueError):
        capped_lognormal_moments(-0.1, 2.0)
    with pytest.raises(ValueError):
        capped_lognormal_moments(0.1, 0.0)


def test_capped_moments_match_a_monte_carlo_of_the_tis_weights():
    # The weights the control injects: W = min(exp(−ε), C), ε ~ N(0, σ²), as token TIS computes them.
    rng = np.random.default_rng(7)
    sigma, cap = 0.6, 2.0
    w = np.minimum(np.exp(-rng.normal(0, sigma, 1_000_000)), cap)
    m1, m2 = capped_lognormal_moments(sigma, cap)
    assert m1 == pytest.approx(w.mean(), abs=4 * w.std() / 1000)
    assert m2 == pytest.approx((w**2).mean(), abs=4 * (w**2).std() / 1000)


def test_expected_squared_change_by_hand_and_by_simulation():
    # σ² = ln 2 and no cap: E W = √2, E W² = 4, Var W = 2. g_1 = (1, 0), g_2 = (0, 1): Σ‖g_i‖² = 2,
    # ‖g‖² = 2, so E‖Δg‖²/‖g‖² = (2·2 + (√2 − 1)²·2) / 2 = 5 − 2√2.
    sigma = math.sqrt(math.log(2))
    assert expected_squared_change(sigma, 1e9, [1.0, 1.0], 2.0) == pytest.approx(5 - 2 * math.sqrt(2), rel=1e-9)
    # Against a simulation of Σ_i (W_i − 1) g_i with cancelling parts and a cap that binds.
    g_BN = np.array([[1.0, 2.0, 0.0], [-0.5, 1.0, 1.0], [0.2, -2.5, 0.3]])
    g_N = g_BN.sum(axis=0)
    rng = np.random.default_rng(3)
    w_DB = np.minimum(np.exp(rng.normal(0, 0.4, (400_000, 3))), 2.0)
    change_D = (((w_DB - 1) @ g_BN) ** 2).sum(axis=1) / (g_N @ g_N)
    expected = expected_squared_change(0.4, 2.0, (g_BN**2).sum(axis=1), float(g_N @ g_N))
    assert expected == pytest.approx(change_D.mean(), abs=4 * change_D.std() / math.sqrt(change_D.size))
    with pytest.raises(ValueError):
        expected_squared_change(0.1, 2.0, [1.0], 0.0)


def test_cosine_and_relative_l2():
    a, b = np.array([1.0, 0.0]), np.array([0.0, 1.0])
    assert cosine(a, b) == 0.0
    assert relative_l2(a, b) == pytest.approx(math.sqrt(2))
    c = np.array([3.0, 4.0])
    assert cosine(c, 2 * c) == pytest.approx(1.0)
    assert relative_l2(c, 2 * c) == pytest.approx(0.5)  # ‖(3,4) − (6,8)‖ / ‖(6,8)‖ = 5/10
    assert math.isnan(relative_l2(c, np.zeros(2)))
