"""The closed-form constructions: ``exact``, ``perturbed`` (roots of unity), ``vandermonde``.

Every construction returns a :class:`cerar.Code` of the form ``F(n) = u^T Q^n`` given by its
node set (the eigenvalues of ``Q``). The node builders (:func:`perturbed_nodes`,
:func:`polygon_nodes`) and the rank subset the searches score (:func:`search_ranks`) are shared
with :mod:`cerar.coding.optimize`; users reach the constructions through :mod:`cerar.coding.codes`.
Pure numpy: never imports torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from cerar._checks import check_bool, check_float, check_int
from cerar.coding.linear_code import MAX_ERROR, Code, SingularCodeError, check_max_error
from cerar.coding.precision import precision_name
from cerar.coding.search import minimise_log_parameter

__all__ = [
    "MAX_COMPONENTS",
    "check_components_limit",
    "check_design",
    "cluster_sizes",
    "exact",
    "max_delta",
    "perturbed",
    "perturbed_nodes",
    "polygon_nodes",
    "search_ranks",
    "vandermonde",
]


#: The largest ``c`` that :func:`perturbed` and :func:`vandermonde` build when ``c > N``, checked
#: before any work. A build costs an O(c^3) inverse per candidate of the ~40 the tuning tries, so
#: the time grows eightfold per doubling of ``c`` (seconds from c = 512). And codes that large are noise:
#: the predicted fp32 error of ``perturbed(4, c)`` is 0.46 at c = 64 and 1.1 at c = 256; no code
#: with ``c >= 16 N`` meets :data:`cerar.coding.linear_code.MAX_ERROR` even at fp64.
MAX_COMPONENTS = 256


def check_components_limit(construction: str, world_size: int, components: int, limit: int) -> None:
    """Refuse ``components > limit`` (when also ``> world_size``) for ``construction``, up front."""
    if components > limit and components > world_size:
        raise ValueError(
            f"Argument 'components' must be at most {limit} for construction {construction!r} when "
            f"c > N = {world_size}, not {components}: beyond it a build takes tens of seconds and the "
            "code's error swamps the sum."
        )


def check_design(world_size: Any, components: Any, precision: Any) -> tuple[int, int, str]:
    """The checked ``(N, c, precision name)`` every tuned construction starts from."""
    world_size = check_int("world_size", world_size, minimum=2)
    components = check_int("components", components, minimum=1)
    return world_size, components, precision_name(precision)


def cluster_sizes(world_size: int, components: int) -> list[int]:
    """Sizes ``s_k`` of the clusters around the N-th roots of unity ``w^k``.

    As even as possible (each ``floor(c/N)`` or ``ceil(c/N)``) and symmetric, ``s_k = s_{N-k}``,
    so that the node set is closed under conjugation.
    """
    n_ranks = check_int("world_size", world_size, minimum=2)
    c = check_int("components", components, minimum=1)
    base, extra = divmod(c, n_ranks)
    sizes = [base] * n_ranks
    self_conjugate = [0] + ([n_ranks // 2] if n_ranks % 2 == 0 else [])
    if extra % 2 == 1:
        sizes[0] += 1
        extra -= 1
        self_conjugate.remove(0)
    # Spread the remaining pairs around the circle rather than bunching them near 1.
    pairs = list(range(1, (n_ranks + 1) // 2))
    if pairs and extra >= 2:
        picks = np.linspace(0, len(pairs), num=extra // 2, endpoint=False).astype(int)
        for index in picks[: len(pairs)]:
            k = pairs[index]
            sizes[k] += 1
            sizes[n_ranks - k] += 1
            extra -= 2
    for k in self_conjugate:
        if extra == 0:
            break
        sizes[k] += 1
        extra -= 1
    assert extra == 0 and sum(sizes) == c, (sizes, c)
    return sizes


def perturbed_nodes(world_size: int, components: int, delta: float) -> tuple[np.ndarray, np.ndarray]:
    """``(radii, angles)``, one node per conjugate pair, of :func:`perturbed` at spacing ``delta``
    (``delta = 0`` and ``c = N`` give the N-th roots of unity). Unchecked: callers check."""
    sizes = cluster_sizes(world_size, components)
    angles: list[float] = []
    for k, size in enumerate(sizes):
        centre = 2 * math.pi * k / world_size
        offsets = [delta * (l - (size - 1) / 2) for l in range(size)]
        if k == 0 or 2 * k == world_size:
            # Self-conjugate cluster: keep the offset-0 node (real) and one node of each pair.
            for offset in offsets:
                if offset == 0:
                    angles.append(centre)
                elif offset > 0:
                    angles.append(offset if k == 0 else math.pi - offset)
        elif 2 * k < world_size:
            angles.extend(centre + offset for offset in offsets)
    angle_array = np.array(angles)
    return np.ones_like(angle_array), angle_array


def polygon_nodes(world_size: int, components: int, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Cluster ``k`` as a regular ``s_k``-gon of circumradius ``scale`` in ``log z`` around
    ``w^k``, symmetric about the radial axis so that self-conjugate clusters stay closed.

    The second starting family of :func:`cerar.coding.optimize.optimized` (radii off the unit
    circle), beside :func:`perturbed_nodes`; not a construction of its own."""
    radii: list[float] = []
    angles: list[float] = []
    for k, size in enumerate(cluster_sizes(world_size, components)):
        centre = 2 * math.pi * k / world_size
        phase0 = 0.0 if size % 2 else math.pi / size
        turns = [phase0 + 2 * math.pi * l / size for l in range(size)]
        offsets = [0j] if size == 1 else [scale * np.exp(1j * turn) for turn in turns]
        self_conjugate = k == 0 or 2 * k == world_size
        if self_conjugate:
            for d in offsets:
                if abs(d.imag) <= 1e-12 * max(scale, 1e-300):
                    radii.append(math.exp(d.real))
                    angles.append(centre)
                elif d.imag > 0:
                    radii.append(math.exp(d.real))
                    angles.append(d.imag if k == 0 else math.pi - d.imag)
        elif 2 * k < world_size:
            for d in offsets:
                radii.append(math.exp(d.real))
                angles.append(centre + d.imag)
    return np.array(radii), np.array(angles)


def max_delta(world_size: int, components: int) -> float:
    """The spacing at which clusters would touch their neighbours: ``s_max * delta = 2 pi / N``."""
    return 2 * math.pi / (world_size * math.ceil(components / world_size))


def exact(world_size: int) -> Code:
    """``c = N`` nodes at the N-th roots of unity: exact decoding at ring all-reduce's rate."""
    world_size = check_int("world_size", world_size, minimum=2)
    radii, angles = perturbed_nodes(world_size, world_size, 0.0)
    return Code.from_nodes(world_size, radii, angles, construction="exact")


def perturbed(
    world_size: int,
    components: int,
    delta: float | None = None,
    precision: Any = "fp32",
    *,
    reference: str = "mixed",
    spread_seam: bool = False,
    max_error: float | None = MAX_ERROR,
) -> Code:
    """Symmetric clusters of nodes around the N-th roots of unity (multiplicative perturbation).

    Cluster ``k`` holds ``s_k`` nodes ``w^k exp(i delta (l - (s_k-1)/2))``. The wrap error is
    ``O(N delta)`` and the condition number ``O(delta^-r)`` with ``r = ceil(c/N) - 1``.

    Args:
        world_size: ``N`` (at least 2).
        components: ``c`` (at least 1, at most :data:`MAX_COMPONENTS` unless ``c <= N``).
            ``c <= N`` gives an exact code.
        delta: angular spacing inside a cluster, ``0 <= delta < 2 pi / (N ceil(c/N))``. ``None``
            picks the delta that minimises :meth:`Code.predicted_worst_error` at ``precision``.
        precision: packet precision the automatic delta is tuned for (``"fp32"``, ``"fp64"``...).
        reference: decoder, ``"mixed"`` (default) or ``"A"``.
        spread_seam: encode rank ``i``'s input as ``Z^i X_i`` (see :mod:`cerar.coding.seam`; needs the
            mixed decoder). The wrap error is then shared by all ``N`` links, about ``sqrt(3)``
            smaller at equal ``delta``; the automatic delta is tuned for the spread code, and
            ``params`` records ``spread_seam: True``.
        max_error: refuse (ValueError) a code whose predicted worst-rank error at ``precision``
            exceeds this (:meth:`Code.check_error`); None builds it anyway.
    """
    world_size, components, precision = check_design(world_size, components, precision)
    check_bool("spread_seam", spread_seam)
    max_error = check_max_error(max_error)
    check_components_limit("perturbed", world_size, components, MAX_COMPONENTS)
    clustered = components > world_size
    if delta is None:
        delta = _tuned_delta(world_size, components, precision, reference, spread_seam) if clustered else 0.0
    else:
        delta = _checked_delta(world_size, components, delta)
    radii, angles = perturbed_nodes(world_size, components, delta if clustered else 0.0)
    params: dict[str, Any] = {"delta": float(delta) if clustered else 0.0, "precision": precision}
    if spread_seam:
        # Only when set, so that plain codes keep the descriptions (and fingerprints) they had.
        params["spread_seam"] = True
    code = Code.from_nodes(
        world_size,
        radii,
        angles,
        construction="perturbed",
        params=params,
        reference=reference,
        spread_seam=spread_seam,
    )
    return code.check_error(precision, max_error)


def _tuned_delta(world_size: int, components: int, precision: str, reference: str, spread_seam: bool) -> float:
    """The delta of :func:`perturbed` with the smallest predicted worst-rank error at ``precision``."""
    return _best_parameter(
        lambda value: Code.from_nodes(
            world_size,
            *perturbed_nodes(world_size, components, value),
            reference=reference,
            spread_seam=spread_seam,
        ),
        1e-9,
        0.95 * max_delta(world_size, components),
        world_size,
        precision,
    )


def _checked_delta(world_size: int, components: int, delta: Any) -> float:
    """A given delta of :func:`perturbed`, checked: clusters must neither overlap nor collapse."""
    delta = check_float("delta", delta, nonnegative=True)
    limit = max_delta(world_size, components)
    if delta >= limit:
        raise ValueError(
            f"Argument 'delta' must be less than 2*pi/(N*ceil(c/N)) = {limit:.4g} so that "
            f"clusters do not overlap, not {delta}."
        )
    if components > world_size and delta == 0.0:
        raise ValueError(
            f"Argument 'delta' must be positive when components ({components}) > world_size "
            f"({world_size}): clustered nodes would coincide; got {delta}."
        )
    return delta


def vandermonde(
    world_size: int,
    components: int,
    eps: float | None = None,
    precision: Any = "fp32",
    *,
    reference: str = "mixed",
    max_error: float | None = MAX_ERROR,
) -> Code:
    """``c`` real nodes ``(1 + eps)^l``, ``l = 0..c-1``: error ``O(eps)``, cond ``O(eps^-(c-1))``.

    Args:
        world_size: ``N`` (at least 2).
        components: ``c`` (at least 1, at most :data:`MAX_COMPONENTS` unless ``c <= N``).
        eps: node spacing, ``0 < eps <= 1``. ``None`` picks the eps that minimises the predicted
            worst-rank error at ``precision`` (usually a poor code: this is the ill-conditioned
            limit the paper warns about).
        precision: packet precision the automatic eps is tuned for.
        reference: decoder, ``"mixed"`` (default) or ``"A"``.
        max_error: refuse (ValueError) a code whose predicted worst-rank error at ``precision``
            exceeds this (:meth:`Code.check_error`); None builds it anyway. Vandermonde codes
            beyond ``c = N + 1`` rarely pass at fp32.
    """
    world_size, components, precision = check_design(world_size, components, precision)
    max_error = check_max_error(max_error)
    check_components_limit("vandermonde", world_size, components, MAX_COMPONENTS)

    def build(value: float) -> Code:
        radii = (1.0 + value) ** np.arange(components)
        return Code.from_nodes(
            world_size,
            radii,
            np.zeros(components),
            construction="vandermonde",
            params={"eps": value, "precision": precision},
            reference=reference,
        )

    if eps is None:
        eps = _best_parameter(build, 1e-6, 1.0, world_size, precision)
    return build(check_float("eps", eps, positive=True, maximum=1.0)).check_error(precision, max_error)


def search_ranks(world_size: int) -> list[int]:
    """The ranks a parameter search scores. Ranks 0 and N-1 decode exactly and the worst rank
    sits inside: a handful of interior ranks finds the optimum at a fraction of the cost of all N."""
    if world_size <= 8:
        return list(range(world_size))
    return sorted({1, world_size // 4, world_size // 2, (3 * world_size) // 4, world_size - 2})


def _best_parameter(
    build: Callable[[float], Code], low: float, high: float, world_size: int, precision: str
) -> float:
    """The parameter in ``[low, high]`` that minimises the predicted worst-rank error over
    :func:`search_ranks` (:func:`cerar.coding.search.minimise_log_parameter`). Singular codes
    count as infinitely bad."""
    ranks = search_ranks(world_size)

    def worst(value: float) -> float:
        try:
            return float(np.max(build(value).predicted_error(precision, ranks)))
        except SingularCodeError:
            return math.inf

    return minimise_log_parameter(worst, low, high).parameter
