"""The colour bands of the mismatch figures (DESIGN.md): what a person should do about a number.

One table for every place that colours them: the dashboard's tiles, `rollmarket observe`'s console
matrix and the demos' summaries.
"""

from __future__ import annotations

from enum import Enum

ESS_GREEN, ESS_AMBER = 0.99, 0.95
FLIP_GREEN, FLIP_AMBER = 0.05, 0.15


class Band(str, Enum):
    """A figure's colour band."""

    green = "green"
    amber = "amber"
    red = "red"
    none = "none"
    """No value to judge (an empty cell)."""


def ess_band(ess: float | None) -> Band:
    """ESS green > 0.99, amber 0.95–0.99, red < 0.95."""
    if ess is None:
        return Band.none
    return Band.green if ess > ESS_GREEN else Band.amber if ess >= ESS_AMBER else Band.red


def flip_band(rate: float | None) -> Band:
    """Router top-1 flip rate green ≤ 5%, amber 5–15%, red > 15%."""
    if rate is None:
        return Band.none
    return Band.green if rate <= FLIP_GREEN else Band.amber if rate <= FLIP_AMBER else Band.red
