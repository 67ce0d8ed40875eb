"""Optimised designs: :func:`optimized` (re-exported by :mod:`cerar.coding.codes`;
:func:`cerar.coding.choose.choose` picks among them).

:func:`optimized` searches the node set of ``F(n) = u^T Q^n`` (per-node angles and radii, i.e.
eigenvalues of ``Q`` anywhere near the N-th roots of unity, not only on the unit circle) for the
code with the smallest *modelled* worst-rank error at a packet precision, subject to
``max_j cond(W_j) <= kappa``. The model is :meth:`cerar.Code.predicted_error`: the exact-arithmetic
error on i.i.d. inputs plus the packet rounding carried through the decoder. Three stages:

1. two one-parameter families, each with and without the spread seam (:mod:`cerar.coding.seam`), their
   scale tuned under the cond wall by the constructions' own log-grid and golden-section search
   (:mod:`cerar.coding.search`): the perturbed construction (nodes on a line through each root
   of unity) and the same clusters as regular polygons in the log-plane (radii off the unit
   circle);
2. the best of the four starts kept (ties go to the first listed, spread before plain);
3. from it, every node's radius and angle refined by Powell's method with a fixed evaluation
   budget (deterministic: no clocks, no random numbers).

The decoder is the mixed reference. Results are cached on disk (:mod:`cerar.coding.design_cache`).
What this buys, measured (float32, worst rank, simulated, against plain ``perturbed``): about
1.5x at ``c = 2N`` (the spread seam alone; a pair per root leaves no shape to choose), 1.7-1.9x
at ``c = 3N`` and 1.8-2.2x at ``c = 4N`` (seam plus polygon clusters); the per-node refinement
adds 1-2%. Constant factors only: the floor comes from sharing each packet's mantissa between
``r+1`` scales (docs/protocol.md, "Where the error floor comes from"), which no placement of nodes
removes. Pure numpy/scipy.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from cerar._checks import check_float
from cerar._version import __version__
from cerar.coding.constructions import (
    check_components_limit,
    check_design,
    max_delta,
    perturbed,
    perturbed_nodes,
    polygon_nodes,
    search_ranks,
)
from cerar.coding.decoders import SingularCodeError
from cerar.coding.design_cache import cached_code
from cerar.coding.linear_code import MAX_ERROR, Code, check_max_error
from cerar.coding.precision import UNIT_ROUNDOFF, precision_name
from cerar.coding.search import minimise_log_parameter

__all__ = ["ALGORITHM", "OPTIMIZED_MAX_COMPONENTS", "cache_key", "default_kappa", "optimized"]

#: Bumped whenever the search changes, so that cached designs of older searches are recomputed.
ALGORITHM = "nodes-4-golden"  # 4: the family scales tuned by golden section, not Powell
_CONSTRAINT_WEIGHT = 20.0  # log-error units per e-fold of cond above kappa: a near-hard wall
#: Where the wall starts, as a fraction of kappa. When the cap binds, the optimum sits on the wall
#: and a search converging onto it lands on either side by its tolerance (about 1e-3 in log scale,
#: times r in log cond); starting the wall 1% inside keeps the result within kappa.
_WALL = 0.99
#: The largest ``c`` :func:`optimized` searches when ``c > N``, checked before any work. The search
#: scores a few hundred codes, each with an SVD per rank, then refines ~1.5 c parameters with up to
#: 1000 more: measured on one core, ``N = 4``: c = 64 takes 3.4 s (0.3 s unrefined), c = 128 68 s
#: (1.2 s unrefined), c = 256 27 s unrefined; ``N = 16, c = 64``: 6.8 s. Every such design at
#: ``N <= 4`` is above :data:`cerar.coding.linear_code.MAX_ERROR` at fp32 anyway (N = 4, c = 128: 0.28).
OPTIMIZED_MAX_COMPONENTS = 64


def default_kappa(precision: Any = "fp32") -> float:
    """The condition-number cap used when ``kappa`` is None: ``min(1/(4u), 1e12)``.

    A safety rail rather than an active constraint: at this cap the rounding alone would cost
    about 25% relative error, far above any useful optimum (float32: 4.2e6; float64: 1e12).
    """
    return min(0.25 / UNIT_ROUNDOFF[precision_name(precision)], 1e12)


# --------------------------------------------------------------------------------------------
# The search
def _cond(code: Code, ranks: list[int]) -> float:
    """Largest ``cond(W_j)`` over ``ranks`` (the search's subset; the final check uses all)."""
    values = [np.linalg.svd(code.decoder(j), compute_uv=False) for j in ranks]
    return float(max(v[0] / v[-1] for v in values))


def _worst_cond(code: Code) -> float:
    return float(np.max(code.cond))


class _Problem:
    """The objective of one search: log predicted worst error plus the cond wall."""

    def __init__(self, world_size: int, components: int, precision: str, kappa: float) -> None:
        self.world_size, self.components = world_size, components
        self.precision, self.kappa = precision, kappa
        self.ranks = search_ranks(world_size)

    def build(self, radii: np.ndarray, angles: np.ndarray, spread: bool) -> Code:
        return Code.from_nodes(self.world_size, radii, angles, spread_seam=spread)

    def score(self, code: Code) -> float:
        try:
            error = float(np.max(code.predicted_error(self.precision, self.ranks)))
            cond = _cond(code, self.ranks)
        except (SingularCodeError, np.linalg.LinAlgError):
            return math.inf
        if not (math.isfinite(error) and math.isfinite(cond) and error > 0):
            return math.inf
        return math.log(error) + _CONSTRAINT_WEIGHT * max(0.0, math.log(cond / (_WALL * self.kappa)))

    def feasible(self, code: Code) -> bool:
        try:
            return _worst_cond(code) <= self.kappa
        except SingularCodeError:
            return False


#: The one-parameter starting families: name, node builder, and the largest scale as a fraction
#: of the line's limit (a polygon of circumradius a spans about 2a).
_FAMILIES: tuple[tuple[str, Callable[[int, int, float], tuple[np.ndarray, np.ndarray]], float], ...] = (
    ("line", perturbed_nodes, 1.0),
    ("polygon", polygon_nodes, 0.5),
)


def _tune_scale(
    problem: _Problem,
    family: Callable[[int, int, float], tuple[np.ndarray, np.ndarray]],
    high: float,
    spread: bool,
) -> tuple[float, float]:
    """Best scale of a one-parameter family under the cond wall: ``(score, scale)``."""
    n_ranks = problem.world_size

    def score(value: float) -> float:
        try:
            return problem.score(problem.build(*family(n_ranks, problem.components, value), spread))
        except (SingularCodeError, ValueError):
            return math.inf

    # The constructions' own search minimises the predicted error only; this one adds the cond
    # wall. The optimum scale is about u^(1/(r+1)) / N, so at float64 and c = 2N (~1e-9) the grid
    # must reach well below float32's 1e-7.
    low = min(1e-7, 1e-3 * math.sqrt(UNIT_ROUNDOFF[problem.precision]))
    found = minimise_log_parameter(score, low, high, points=40, refinements=16)
    return found.score, found.parameter


def _refine(
    problem: _Problem, radii: np.ndarray, angles: np.ndarray, scale: float, spread: bool, budget: int
) -> Code:
    """Powell over every node's log-radius and angle (angles of real nodes stay fixed)."""
    real = (angles == 0.0) | (angles == math.pi)
    free_angles = np.flatnonzero(~real)
    log_r0 = np.log(radii)

    def unpack(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        new_angles = angles.copy()
        # Pair nodes must stay strictly inside (0, pi): on the axis a pair would turn real and c change.
        new_angles[free_angles] = np.clip(angles[free_angles] + scale * x[len(radii) :], 1e-9, math.pi - 1e-9)
        return np.exp(log_r0 + scale * x[: len(radii)]), new_angles

    def objective(x: np.ndarray) -> float:
        try:
            return problem.score(problem.build(*unpack(x), spread))
        except ValueError:  # e.g. a node pushed onto a negative real axis that cannot spread
            return math.inf

    # Imported here: scipy.optimize takes about a second to import, and every rank imports cerar
    # while only a design search reaches this line (stored designs come from the cache).
    from scipy.optimize import minimize

    x0 = np.zeros(len(radii) + len(free_angles))
    result = minimize(objective, x0, method="Powell", options={"maxfev": budget, "xtol": 1e-3, "ftol": 1e-5})
    x = result.x if result.fun < objective(x0) else x0
    return problem.build(*unpack(x), spread)


def _plain_error(
    problem: _Problem, family: Callable[[int, int, float], tuple[np.ndarray, np.ndarray]], scale: float
) -> float | None:
    try:
        code = problem.build(*family(problem.world_size, problem.components, scale), False)
        return code.predicted_worst_error(problem.precision)
    except (SingularCodeError, ValueError):
        return None


def _search(
    world_size: int, components: int, precision: str, kappa: float, refine: bool
) -> tuple[Code, dict[str, Any]]:
    problem = _Problem(world_size, components, precision, kappa)
    limit = 0.95 * max_delta(world_size, components)
    # Every family with and without the spread seam; min() over (score, listing order) keeps the
    # choice deterministic on ties. The plain starts stay candidates: if no spread design scored
    # better, the plain one is refined and returned.
    starts = []
    for order, (spread, (name, family, fraction)) in enumerate(
        (spread, fam) for spread in (True, False) for fam in _FAMILIES
    ):
        score, scale = _tune_scale(problem, family, fraction * limit, spread)
        starts.append((score, order, name, spread, scale, family))
    score, _, name, spread, scale, family = min(starts, key=lambda s: (s[0], s[1]))
    plain_best = min((s for s in starts if not s[3]), key=lambda s: (s[0], s[1]))
    start = family(world_size, components, scale)
    code = problem.build(*start, spread)
    if refine:
        dim = len(start[0]) + int(np.sum((start[1] != 0.0) & (start[1] != math.pi)))
        # Powell needs a few line searches per dimension; measured, refinement buys 1-2% over the
        # best start, so the budget is kept small (N = 16, c = 64: about ten seconds).
        code = _refine(problem, *start, scale, spread, budget=min(20 * dim, 1000))
    if not problem.feasible(code):
        raise ValueError(
            f"Argument 'kappa' = {kappa:.4g} cannot be met for N = {world_size}, c = {components}: "
            f"the best design found has cond {_worst_cond(code):.4g}."
        )
    extra = {
        "start": name,
        "start_scale": scale,
        "spread_seam": spread,
        "predicted_worst_error": code.predicted_worst_error(precision),
        # The best plain (unspread) start's modelled error, to show what the seam buys.
        "plain_predicted_worst_error": _plain_error(problem, plain_best[5], plain_best[4]),
        "cond": _worst_cond(code),
    }
    return code, extra


def optimized(
    world_size: int,
    components: int,
    precision: Any = "fp32",
    kappa: float | None = None,
    *,
    refine: bool = True,
    cache: bool = True,
    max_error: float | None = MAX_ERROR,
) -> Code:
    """The node set with the smallest modelled worst-rank error subject to ``cond <= kappa``.

    Searches spread-seam designs (:mod:`cerar.coding.seam`) and, as a fallback candidate, plain ones;
    returns whichever the model predicts to be better (for ``c > N`` that has always been a
    spread one). Uncached it takes a few seconds (``N = 4``) to about half a minute
    (``N = 16, c = 64`` on a busy core); cached, milliseconds.

    Args:
        world_size: ``N`` (at least 2).
        components: ``c`` (at least 1, at most :data:`OPTIMIZED_MAX_COMPONENTS` unless ``c <= N``).
            ``c <= N`` returns the exact code (nothing to optimise).
        precision: packet precision the design is for (``"fp32"`` default, ``"fp64"``, ...).
        kappa: cap on every rank's ``cond(W_j)``; None uses :func:`default_kappa`. ValueError if no
            design found meets it.
        refine: also run the per-node refinement (stage 3); False stops after the one-parameter
            families (a few seconds at ``N = 16``) and loses 1-2% of modelled error.
        cache: read and write the on-disk cache (keyed by every argument, the library version and
            :data:`ALGORITHM`).
        max_error: refuse (ValueError) a design whose predicted worst-rank error at
            ``precision`` exceeds this (:meth:`Code.check_error`, after the search or the cache;
            the cache keeps the design either way); None returns it anyway.

    Returns:
        A :class:`cerar.Code` with ``construction="optimized"``, the mixed decoder and, for the
        designs the search prefers, ``spread_seam=True``. Its ``params`` record the inputs and
        the search's figures: ``start`` (``"line"``, ``"polygon"`` or ``"exact"``),
        ``start_scale``, ``spread_seam``, ``predicted_worst_error``,
        ``plain_predicted_worst_error`` (the best unspread start) and ``cond``. Deterministic
        for equal inputs (no clocks, no random numbers).
    """
    world_size, components, precision = check_design(world_size, components, precision)
    kappa = default_kappa(precision) if kappa is None else check_float("kappa", kappa, positive=True)
    if kappa < 1.0:
        raise ValueError(f"Argument 'kappa' must be at least 1 (a condition number), not {kappa}.")
    max_error = check_max_error(max_error)
    check_components_limit("optimized", world_size, components, OPTIMIZED_MAX_COMPONENTS)
    design = functools.partial(_design, world_size, components, precision, kappa, bool(refine))
    if cache:
        key = cache_key(N=world_size, c=components, precision=precision, kappa=kappa, refine=bool(refine))
        valid = functools.partial(_still_valid, world_size, components, precision, kappa)
        code, extra, _ = cached_code("optimized", key, design, validate=valid)
    else:
        code, extra = design()
    params = {"precision": precision, "kappa": kappa, "refine": bool(refine), **extra}
    nodes = code.to_dict()["nodes"]
    return Code.from_nodes(
        world_size,
        nodes["radius"],
        nodes["angle"],
        construction="optimized",
        params=params,
        spread_seam=code.spread_seam,
    ).check_error(precision, max_error)


def cache_key(**inputs: Any) -> dict[str, Any]:
    """A design cache key: every input, plus the search's and the library's versions."""
    return {**inputs, "algorithm": ALGORITHM, "version": __version__}


def _design(
    world_size: int, components: int, precision: str, kappa: float, refine: bool
) -> tuple[Code, dict[str, Any]]:
    """What :func:`optimized` computes (and caches): the design and its figures."""
    if components > world_size:
        return _search(world_size, components, precision, kappa, refine)
    code = perturbed(world_size, components, 0.0, max_error=None)  # exact: nothing to optimise
    return code, {
        "start": "exact",
        "spread_seam": False,
        "predicted_worst_error": code.predicted_worst_error(precision),
        "cond": _worst_cond(code),
    }


def _still_valid(
    world_size: int, components: int, precision: str, kappa: float, code: Code, extra: dict[str, Any]
) -> bool:
    """Whether a stored design is still what it claims: right shape, within the cap, and the
    model gives it the error recorded when it was found (a hand-edited node under a matching key
    fails this)."""
    recorded = extra.get("predicted_worst_error")
    if code.world_size != world_size or code.components != components or not isinstance(recorded, float):
        return False
    predicted = code.predicted_worst_error(precision)
    return bool(np.max(code.cond) <= kappa * (1 + 1e-9)) and abs(predicted - recorded) <= 1e-9 * recorded
