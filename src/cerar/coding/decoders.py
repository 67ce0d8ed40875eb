"""Per-rank decoders of a :class:`cerar.Code` and their exact-arithmetic error.

Rank ``j`` observes ``O_j = sum_{i != j} G_i X_i``: ``G_i = M_A T_i`` for ``i < j`` and
``M_B T_i`` for ``i > j``, with ``T_i`` rank ``i``'s input transform (the identity unless the
code spreads its seam). Two routes give the same numbers:

* the generic route works from explicit matrices: ``W_j`` inverts a weighted mean of the
  ``G_i`` and ``E_i = W_j G_i - I``;
* the node route, for codes ``F(n) = u^T Q^n`` given by their nodes, uses ``M_A = V Q^(N-j)``
  and ``M_B = M_A Q^-N`` (``V`` the Krylov rows ``F(0..c-1)``): every ``E_i`` is then block
  diagonal with one scalar per node, and ``W_j`` is a block scaling of ``V^-1``, so one inverse
  serves all ranks. It makes codes up to ``N = 64, c = 256`` cheap to build and check.

Pure numpy: never imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

SINGULAR_COND = 1e15


class SingularCodeError(ValueError):
    """A rank's observation system cannot be inverted in float64."""


@dataclass(frozen=True)
class RankAnalysis:
    """Decoder of one rank and the size of its exact-arithmetic error.

    Attributes:
        decoder: ``W_j`` (``c x c``).
        error_bound: ``sqrt(sum_i ||E_i||_2^2)``: see :attr:`cerar.Code.error_bound`.
        wrap_fro2: ``sum_i ||E_i||_F^2``: the exact-arithmetic error energy on i.i.d. inputs.
    """

    decoder: np.ndarray
    error_bound: float
    wrap_fro2: float


@dataclass(frozen=True)
class Sources:
    """How one rank sees the others, in groups that share one view ``G_g``.

    ``counts[g]`` ranks are seen through group ``g``; the decoder inverts
    ``sum_g weights[g] G_g`` (weights ``counts / (N-1)`` for the mixed reference).
    """

    counts: tuple[int, ...]
    weights: tuple[float, ...]


def analyse_rows(views: list[np.ndarray], sources: Sources, label: str) -> RankAnalysis:
    """The generic route: ``views[g]`` is ``G_g`` as an explicit matrix."""
    system = sum(w * g for w, g in zip(sources.weights, views, strict=True))
    w = _inverse(np.asarray(system), label)
    eye = np.eye(w.shape[0])
    bound_sq = fro2 = 0.0
    for g, count in zip(views, sources.counts, strict=True):
        e = w @ g - eye
        bound_sq += count * float(np.linalg.norm(e, 2)) ** 2
        fro2 += count * float(np.sum(e**2))
    return RankAnalysis(decoder=w, error_bound=math.sqrt(bound_sq), wrap_fro2=fro2)


def analyse_nodes(
    krylov_inverse: np.ndarray,
    nodes: np.ndarray,
    is_real: np.ndarray,
    world_size: int,
    rank: int,
    multipliers: list[np.ndarray],
    sources: Sources,
) -> RankAnalysis:
    """The node route. ``nodes`` holds one complex node per real node or conjugate pair, in the
    column order of the rows; ``krylov_inverse`` is ``V^-1``. Every view is ``M_A`` times a
    block-diagonal matrix, ``G_g = V Q^(N-j) diag(multipliers[g])`` (one complex scalar per
    node), so ``W_j = diag(mix)^-1 Q^(j-N) V^-1`` and ``E_g = diag(multipliers[g] / mix) - I``."""
    mix = np.asarray(sum(w * m for w, m in zip(sources.weights, multipliers, strict=True)), dtype=np.complex128)
    if np.any(np.abs(mix) < 1e-14):
        raise SingularCodeError(f"rank {rank}: the decoder's mixing vanishes at a node")
    multiplicity = np.where(is_real, 1.0, 2.0)
    bound_sq = fro2 = 0.0
    for mult, count in zip(multipliers, sources.counts, strict=True):
        e = np.abs(mult / mix - 1.0)
        bound_sq += count * float(np.max(e)) ** 2
        fro2 += count * float(np.sum(multiplicity * e**2))
    return RankAnalysis(
        decoder=_scale_rows(krylov_inverse, nodes ** (rank - world_size) / mix, is_real),
        error_bound=math.sqrt(bound_sq),
        wrap_fro2=fro2,
    )


def _scale_rows(matrix: np.ndarray, scale: np.ndarray, is_real: np.ndarray) -> np.ndarray:
    """Left-multiply by the block-diagonal matrix of complex scalars ``scale``.

    A pair's columns hold ``(Re z^n, Im z^n)``; right-multiplying a row by ``zeta`` maps them by
    ``[[Re, Im], [-Im, Re]]``, so the same block multiplies the pair's two rows from the left.
    """
    width = np.where(is_real, 1, 2)
    first = np.cumsum(width) - width  # first row of each node's block
    out = np.empty_like(matrix)
    real_rows = first[is_real]
    out[real_rows] = scale[is_real].real[:, None] * matrix[real_rows]
    top, bottom = first[~is_real], first[~is_real] + 1
    x, y = scale[~is_real].real[:, None], scale[~is_real].imag[:, None]
    out[top] = x * matrix[top] + y * matrix[bottom]
    out[bottom] = -y * matrix[top] + x * matrix[bottom]
    out.setflags(write=False)
    return out


def _inverse(system: np.ndarray, label: str) -> np.ndarray:
    try:
        # W is applied from the left (W O = W M S), so it is the left residual W M - I that
        # must be small. LU inversion only makes the right residual small; inverting the
        # transpose swaps the two. For the clustered codes this is 1e-9 against up to 0.2.
        w = np.linalg.inv(system.T).T
    except np.linalg.LinAlgError:
        raise SingularCodeError(f"{label}: the observation system is singular") from None
    cond_1 = np.linalg.norm(system, 1) * np.linalg.norm(w, 1)
    if not math.isfinite(cond_1) or cond_1 > SINGULAR_COND:
        raise SingularCodeError(f"{label}: the observation system is singular to float64 (cond_1 = {cond_1:.3g})")
    w = np.ascontiguousarray(w)
    w.setflags(write=False)
    return w


def krylov_inverse(krylov: np.ndarray, label: str) -> np.ndarray:
    """``V^-1`` with the same singularity check as the decoders."""
    return _inverse(krylov, label)


def predicted_relative_error(analysis: RankAnalysis, world_size: int, mean_row_energy: float, u: float) -> float:
    """The model behind :meth:`cerar.Code.predicted_error` for one rank: the exact-arithmetic
    error of i.i.d. inputs and the packet rounding, added in quadrature, relative to ``||S||``.

    Each round's rounding is independent noise of variance ``u^2/3`` times the packet's energy
    (``min(t, N) + 1`` times ``mean_row_energy`` at round ``t``); it accumulates into every later
    observation and ``W_j`` carries it to the decoded sum. Kept beside the analysis it reads.
    """
    n_ranks, c = world_size, analysis.decoder.shape[0]
    exact_sq = analysis.wrap_fro2 / (n_ranks * c)
    rounds = np.arange(1, c + n_ranks - 1)  # L = c + N - 2 rounds
    per_round = mean_row_energy * (np.minimum(rounds, n_ranks) + 1) * u * u / 3.0
    accumulated = np.cumsum(per_round)[n_ranks - 2 :]  # observation rounds N-1 .. L
    w = analysis.decoder
    rounding_sq = float(np.sum(np.sum(w**2, axis=0) * accumulated)) / (n_ranks * c)
    return math.sqrt(exact_sq + rounding_sq)
