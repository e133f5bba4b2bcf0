"""Update geometry and a seed-level interval for the training-step experiment.

Verdicts between conditions belong to `rollmarket stats` (research/stats.py); this module keeps
what experiments/training_step.py needs beside it: the cosine and relative norm difference of two
parameter updates, and the t interval over seeds (research/stats.py's, as a contracts.Interval).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..contracts import Interval


def t_interval(values: Sequence[float]) -> Interval:
    """Mean and 95% t interval of independent values (e.g. one number per seed); None values skipped."""
    from ..research.stats import t_interval as interval

    x = [float(v) for v in values if v is not None]
    if not x:
        return Interval(mean=None, lo=None, hi=None, n=0)
    mean = float(np.mean(x))
    if len(x) == 1:
        return Interval(mean=mean, lo=mean, hi=mean, n=1)
    lo, hi = interval(x)
    return Interval(mean=mean, lo=lo, hi=hi, n=len(x))


def cosine(a_N: np.ndarray, b_N: np.ndarray) -> float:
    na, nb = float(np.linalg.norm(a_N)), float(np.linalg.norm(b_N))
    return float(a_N @ b_N / (na * nb)) if na and nb else float("nan")


def relative_norm_difference(a_N: np.ndarray, b_N: np.ndarray) -> float:
    """‖a − b‖ / ‖b‖: how far update a is from reference update b, relative to b's size."""
    nb = float(np.linalg.norm(b_N))
    return float(np.linalg.norm(a_N - b_N) / nb) if nb else float("nan")
