"""The one-dimensional parameter search behind every tuned design.

Two callers: :func:`cerar.coding.constructions.perturbed` and ``vandermonde`` tune their node
spacing for the smallest predicted worst-rank error, and :func:`cerar.coding.optimize.optimized`
tunes the scale of each starting family under its condition-number wall. Both objectives span
many decades of the parameter (the best spacing is about ``u^(1/(r+1)) / N``: 1e-9 at float64,
1e-2 at float16) and are rough on a linear scale, so the search works on ``log(parameter)``: a
coarse log-spaced grid finds the basin, then golden-section refinement narrows it down inside
the two grid cells around the best point. Deterministic (no clocks, no random numbers), so equal
inputs give equal designs. Pure standard library plus numpy.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from cerar._checks import check_float, check_int

__all__ = ["LogSearch", "minimise_log_parameter"]

_GOLDEN = (math.sqrt(5) - 1) / 2


class LogSearch(NamedTuple):
    """The result of :func:`minimise_log_parameter`: the best parameter and its score."""

    parameter: float
    score: float


def minimise_log_parameter(
    score: Callable[[float], float],
    low: float,
    high: float,
    *,
    points: int = 28,
    refinements: int = 12,
) -> LogSearch:
    """The parameter in ``[low, high]`` with the smallest ``score(parameter)``.

    ``points`` log-spaced grid values, then ``refinements`` golden-section steps between the
    best grid point's neighbours (each step shrinks that bracket by 0.618). The best of the grid
    point and the two final golden-section points is returned; ties go to the smaller parameter.
    ``score`` should return ``math.inf`` for a parameter it cannot evaluate (a singular code);
    NaN counts as infinitely bad too, so that it never wins a comparison by accident.
    """
    low = check_float("low", low, positive=True)
    high = check_float("high", high, positive=True)
    if high <= low:
        raise ValueError(f"Argument 'high' must be greater than low = {low}, not {high}.")
    points = check_int("points", points, minimum=2)
    refinements = check_int("refinements", refinements, minimum=0)

    def at(log_value: float) -> float:
        value = float(score(math.exp(log_value)))
        return math.inf if math.isnan(value) else value

    grid = np.linspace(math.log(low), math.log(high), points)
    values = [at(x) for x in grid]
    best = int(np.argmin(values))
    lo, hi = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
    a, b = lo + (1 - _GOLDEN) * (hi - lo), lo + _GOLDEN * (hi - lo)
    fa, fb = at(a), at(b)
    for _ in range(refinements):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = lo + (1 - _GOLDEN) * (hi - lo)
            fa = at(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + _GOLDEN * (hi - lo)
            fb = at(b)
    best_score, best_log = min([(values[best], grid[best]), (fa, a), (fb, b)])
    return LogSearch(parameter=float(math.exp(best_log)), score=float(best_score))
