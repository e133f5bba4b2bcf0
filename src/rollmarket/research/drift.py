"""Engine drift and the training step: the arithmetic of experiment (b) (docs/experiments.md).

Two engines that sample the same prompt with the same seed draw the same random numbers, so their
token sequences agree until the engines' numerics make one draw land on another token: the
trajectory *forks* there (``fork_position``). On one fixed batch, an engine's behaviour logprobs
reach the policy gradient only through the IS weights w_t = min(exp(logπ_old − logπ_behaviour), C)
(token TIS); without a correction they do not enter it at all.

The positive control shifts every behaviour logprob of sequence i by the same ε_i ~ N(0, σ²), so
every token of it gets the weight W_i = min(exp(−ε_i), C), and the step's gradient becomes
Σ_i W_i g_i, where g_i is sequence i's share of the unperturbed gradient g = Σ_i g_i. With the W_i
independent and distributed as min(e^Z, C), Z ~ N(0, σ²) (−ε is distributed as ε),

    E‖Σ_i (W_i − 1) g_i‖² = Var(W) · Σ_i ‖g_i‖² + (E W − 1)² · ‖g‖²,

which ``expected_squared_change`` returns relative to ‖g‖². ``capped_lognormal_moments`` gives
E W and E W² in closed form, with c = ln C and Φ the normal CDF:

    E[e^{kZ}; Z < c] = e^{k²σ²/2} · Φ((c − kσ²)/σ),   so
    E W  = e^{σ²/2} Φ((c − σ²)/σ) + C · (1 − Φ(c/σ)),
    E W² = e^{2σ²} Φ((c − 2σ²)/σ) + C² · (1 − Φ(c/σ)).

numpy and scipy only (no torch): experiments/exp_b_gradients.py computes the gradients.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def fork_position(a_T: Sequence[int], b_T: Sequence[int]) -> int | None:
    """The first index where two token sequences differ (one ending before the other counts as a
    difference at its length); None when they are identical."""
    a, b = np.asarray(a_T), np.asarray(b_T)
    n = min(a.size, b.size)
    differs = np.flatnonzero(a[:n] != b[:n])
    if differs.size:
        return int(differs[0])
    return None if a.size == b.size else n


def capped_lognormal_moments(sigma: float, cap: float) -> tuple[float, float]:
    """(E W, E W²) for W = min(e^Z, cap), Z ~ N(0, sigma²) (module docstring)."""
    from scipy.stats import norm

    if sigma < 0 or not cap > 0:
        raise ValueError(f"need sigma >= 0 and cap > 0, got sigma={sigma}, cap={cap}")
    if sigma == 0:
        w = min(1.0, cap)
        return w, w * w
    c = math.log(cap)
    above = float(norm.sf(c / sigma))  # P(e^Z > cap)
    m1 = math.exp(sigma**2 / 2) * float(norm.cdf((c - sigma**2) / sigma)) + cap * above
    m2 = math.exp(2 * sigma**2) * float(norm.cdf((c - 2 * sigma**2) / sigma)) + cap**2 * above
    return m1, m2


def expected_squared_change(sigma: float, cap: float, part_sq_norms: Sequence[float],
                            total_sq_norm: float) -> float:
    """E‖Δg‖² / ‖g‖² when each part's behaviour logprobs shift by its own ε_i ~ N(0, sigma²)
    (module docstring): `part_sq_norms` are the ‖g_i‖² (or only their sum), `total_sq_norm` is
    ‖g‖². A part is a sequence when the shift is per sequence, a token when it is per token."""
    if not total_sq_norm > 0:
        raise ValueError("the unperturbed gradient is zero: no relative change is defined")
    m1, m2 = capped_lognormal_moments(sigma, cap)
    variance = m2 - m1 * m1
    return (variance * float(np.sum(part_sq_norms)) + (m1 - 1.0) ** 2 * total_sq_norm) / total_sq_norm


def cosine(a_N: np.ndarray, b_N: np.ndarray) -> float:
    """a·b / (‖a‖‖b‖); nan when either is zero."""
    na, nb = float(np.linalg.norm(a_N)), float(np.linalg.norm(b_N))
    return float(a_N @ b_N / (na * nb)) if na and nb else float("nan")


def relative_l2(a_N: np.ndarray, b_N: np.ndarray) -> float:
    """‖a − b‖ / ‖b‖: how far vector a (a gradient) is from reference b, relative to b's size; nan
    when b is zero."""
    nb = float(np.linalg.norm(b_N))
    return float(np.linalg.norm(a_N - b_N) / nb) if nb else float("nan")
