"""Bootstrap intervals for the observatory's aggregates (DESIGN.md: every aggregate shows n and a
bootstrap 95% interval)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from ..contracts import Interval

_RESAMPLE_BLOCK = 1 << 22
"""Elements of the resample index matrix drawn at a time (bounds the memory for large n)."""


def bootstrap_interval(
    values: Iterable[float | None],
    *,
    stat: Callable[..., np.ndarray] = np.mean,
    n_resamples: int = 2000,
    confidence: float = 0.95,
    seed: int = 0,
) -> Interval:
    """`stat` of `values` with its percentile-bootstrap interval.

    None entries are skipped (a trajectory without tokens has no ESS); n counts the rest. `stat`
    must take `axis=` (np.mean, np.median, ...). No values: every field None. One value: lo = hi =
    the value. The same values and seed give the same interval. Raises ValueError on NaN or inf.
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be at least 1, got {n_resamples}")
    values_N = np.array([v for v in values if v is not None], dtype=np.float64)
    n = values_N.shape[0]
    if n == 0:
        return Interval(mean=None, lo=None, hi=None, n=0)
    if not np.isfinite(values_N).all():
        raise ValueError("values must be finite")
    point = float(stat(values_N))
    if n == 1:
        return Interval(mean=point, lo=point, hi=point, n=1)
    rng = np.random.default_rng(seed)
    rows = max(1, _RESAMPLE_BLOCK // n)
    stats_R = np.empty(n_resamples, dtype=np.float64)
    for start in range(0, n_resamples, rows):
        stop = min(start + rows, n_resamples)
        index_RN = rng.integers(0, n, size=(stop - start, n))
        stats_R[start:stop] = stat(values_N[index_RN], axis=1)
    tail = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(stats_R, [tail, 1.0 - tail])
    return Interval(mean=point, lo=float(lo), hi=float(hi), n=n)
