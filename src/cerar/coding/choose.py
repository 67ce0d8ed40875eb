"""Choosing a code for a world size: :func:`choose` (re-exported by :mod:`cerar.coding.codes`), the
largest ``c`` whose predicted worst-rank error meets a budget, among the spread-seam perturbed
designs and :func:`cerar.coding.optimize.optimized`'s. Pure numpy/scipy.
"""

from __future__ import annotations

from typing import Any

from cerar._checks import check_float, check_int
from cerar.coding.constructions import MAX_COMPONENTS, exact, perturbed
from cerar.coding.design_cache import cached_code
from cerar.coding.linear_code import Code
from cerar.coding.optimize import OPTIMIZED_MAX_COMPONENTS, cache_key, optimized
from cerar.coding.precision import precision_name

__all__ = ["MAX_COMPONENTS_PER_RANK", "choose"]

MAX_COMPONENTS_PER_RANK = 8  # choose never looks beyond c = 8N (nor beyond MAX_COMPONENTS)
_OPTIMIZE_LIMIT = OPTIMIZED_MAX_COMPONENTS  # above this c, choose keeps the spread perturbed design


def _spread(world_size: int, components: int, precision: str) -> Code:
    # A probe of the search: judged against the error budget, not refused by the default limit.
    return perturbed(world_size, components, None, precision, spread_seam=True, max_error=None)


def choose(
    world_size: int,
    precision: Any = "fp32",
    error_budget: float = 1e-3,
    *,
    use_optimized: bool = True,
) -> Code:
    """The code with the largest ``c`` (least traffic) whose predicted worst-rank error meets
    ``error_budget``; ``c`` runs from ``N`` (exact, always meets it) to ``8N``. For ``N = 2`` every
    ``c`` sends the same bytes and decodes exactly, so the exact code (``c = 2``) is returned.

    The search over ``c`` bisects on spread-seam perturbed designs (``perturbed(...,
    spread_seam=True)``, a fraction of a second each), as the error grows with ``c``. With
    ``use_optimized`` the winner's neighbour ``c+1`` and then the winner itself are tried as
    :func:`optimized` designs without the per-node refinement (``refine=False``: a few seconds
    at ``N = 16``, 1-2% short of the refined design), and the first that meets the budget is
    returned; else the spread perturbed design. Above ``c = 64`` the perturbed design is kept, and
    ``c`` stays within :data:`cerar.coding.constructions.MAX_COMPONENTS` (256; it binds for
    ``N > 32`` only, far above any ``c`` that meets a useful budget there).

    Cheap on repeat: the chosen design is cached on disk (milliseconds to load). The first call
    for an ``N`` takes a few seconds (``N = 4``) to about ten (``N = 16``). ``error_budget`` is the
    limit here: the constructions' default ``max_error`` does not apply to the candidates it tries.
    """
    world_size = check_int("world_size", world_size, minimum=2)
    precision = precision_name(precision)
    error_budget = check_float("error_budget", error_budget, positive=True)
    if world_size == 2:
        # Two ranks send one value per value whatever c is (1 + (N-2)/c = 1) and decode
        # exactly: a larger c only adds rounds. The exact code is ring all-reduce itself.
        return exact(2)

    key = cache_key(N=world_size, precision=precision, budget=error_budget, optimized=bool(use_optimized))

    def compute() -> tuple[Code, dict[str, Any]]:
        return _choose(world_size, precision, error_budget, use_optimized), {}

    def valid(code: Code, extra: dict[str, Any]) -> bool:
        return code.world_size == world_size and code.predicted_worst_error(precision) <= error_budget

    # The stored description keeps the construction's name and parameters.
    return cached_code("choose", key, compute, validate=valid)[0]


def _choose(world_size: int, precision: str, error_budget: float, use_optimized: bool) -> Code:
    def meets(code: Code) -> bool:
        return code.predicted_worst_error(precision) <= error_budget

    low, high = world_size, max(world_size, min(MAX_COMPONENTS_PER_RANK * world_size, MAX_COMPONENTS))
    if meets(_spread(world_size, high, precision)):
        low = high
    while high - low > 1:  # invariant: low meets the budget, high does not
        middle = (low + high) // 2
        if meets(_spread(world_size, middle, precision)):
            low = middle
        else:
            high = middle
    if low == world_size:
        exact = perturbed(world_size, low, 0.0, precision, max_error=None)
        return optimized(world_size, low, precision, max_error=None) if use_optimized else exact
    best = _spread(world_size, low, precision)
    if use_optimized:
        for candidate in (low + 1, low):
            if candidate > min(MAX_COMPONENTS_PER_RANK * world_size, _OPTIMIZE_LIMIT):
                continue
            code = optimized(world_size, candidate, precision, refine=False, max_error=None)
            if meets(code):
                return code
    return best
