"""Intervals for comparing training runs: over seeds (Student t) and over paired tasks (bootstrap).

With 3–5 seeds a bootstrap over seeds is too coarse to mean much; the t interval is the usual
choice (and wider). Paired per-task differences (the same held-out task before and after) pool
seeds × tasks and use the observatory's percentile bootstrap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..contracts import Interval
from ..observatory.stats import bootstrap_interval

_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         12: 2.179, 15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}


def t_quantile_975(df: int) -> float:
    """The 97.5% quantile of Student's t with `df` degrees of freedom (two-sided 95%); the table's
    next lower df where df falls between entries (slightly wider: conservative)."""
    if df < 1:
        raise ValueError("df must be at least 1")
    if df > 120:
        return 1.960
    return _T975[max(k for k in _T975 if k <= df)]


def t_interval(values: Sequence[float]) -> Interval:
    """Mean and 95% t interval of independent values (e.g. one number per seed)."""
    x = np.asarray([v for v in values if v is not None], dtype=np.float64)
    n = int(x.size)
    if n == 0:
        return Interval(mean=None, lo=None, hi=None, n=0)
    mean = float(x.mean())
    if n == 1:
        return Interval(mean=mean, lo=mean, hi=mean, n=1)
    half = t_quantile_975(n - 1) * float(x.std(ddof=1)) / math.sqrt(n)
    return Interval(mean=mean, lo=mean - half, hi=mean + half, n=n)


def paired_difference(before: Sequence[float], after: Sequence[float], *, seed: int = 0) -> Interval:
    """Mean of after − before over pairs, with its percentile-bootstrap 95% interval."""
    if len(before) != len(after):
        raise ValueError(f"{len(before)} values before and {len(after)} after: pairs must line up")
    return bootstrap_interval(np.asarray(after, dtype=np.float64) - np.asarray(before, dtype=np.float64), seed=seed)


def cosine(a_N: np.ndarray, b_N: np.ndarray) -> float:
    na, nb = float(np.linalg.norm(a_N)), float(np.linalg.norm(b_N))
    return float(a_N @ b_N / (na * nb)) if na and nb else float("nan")


def relative_norm_difference(a_N: np.ndarray, b_N: np.ndarray) -> float:
    """‖a − b‖ / ‖b‖: how far update a is from reference update b, relative to b's size."""
    nb = float(np.linalg.norm(b_N))
    return float(np.linalg.norm(a_N - b_N) / nb) if nb else float("nan")
