"""Per-rank decoders of a :class:`cerar.Code` and their exact-arithmetic error.

Two routes give the same numbers:

* the generic route works from the row table alone: ``W_j`` is the inverse of the rank's
  observation system and ``E_A = W M_A - I``, ``E_B = W M_B - I``;
* the node route, for codes ``F(n) = u^T Q^n`` given by their nodes, uses ``M_A = V Q^(N-j)``
  and ``M_B = M_A Q^-N`` (``V`` the Krylov rows ``F(0..c-1)``): ``E_A`` and ``E_B`` are then
  block diagonal with one scalar per node, and ``W_j`` is a block scaling of ``V^-1``, so one
  inverse serves all ranks. It makes codes up to ``N = 64, c = 256`` cheap to build and check.

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
    """Decoder of one rank and the norms of its wrap errors.

    Attributes:
        decoder: ``W_j`` (``c x c``).
        norm_a, norm_b: 2-norms of ``E_A`` and ``E_B``.
        fro2_a, fro2_b: squared Frobenius norms of ``E_A`` and ``E_B``.
        size_a, size_b: ``|A| = j`` and ``|B| = N-1-j``.
    """

    decoder: np.ndarray
    norm_a: float
    norm_b: float
    fro2_a: float
    fro2_b: float
    size_a: int
    size_b: int

    @property
    def error_bound(self) -> float:
        """``sqrt(|A| ||E_A||^2 + |B| ||E_B||^2)``: see :attr:`cerar.Code.error_bound`."""
        return math.sqrt(self.size_a * self.norm_a**2 + self.size_b * self.norm_b**2)


def system_weights(reference: str, size_a: int, size_b: int) -> tuple[float, float]:
    """``(alpha, beta)`` with ``W_j^-1 = alpha M_A + beta M_B``."""
    if reference == "mixed":
        total = size_a + size_b
        return size_a / total, size_b / total
    return (1.0, 0.0) if size_a > 0 else (0.0, 1.0)


def analyse_rows(
    m_a: np.ndarray, m_b: np.ndarray, reference: str, size_a: int, size_b: int, label: str
) -> RankAnalysis:
    """The generic route, from the observation matrices."""
    alpha, beta = system_weights(reference, size_a, size_b)
    system = alpha * m_a + beta * m_b
    w = _inverse(system, label)
    eye = np.eye(system.shape[0])
    e_a = w @ m_a - eye if size_a else np.zeros_like(eye)
    e_b = w @ m_b - eye if size_b else np.zeros_like(eye)
    return RankAnalysis(
        decoder=w,
        norm_a=float(np.linalg.norm(e_a, 2)) if size_a else 0.0,
        norm_b=float(np.linalg.norm(e_b, 2)) if size_b else 0.0,
        fro2_a=float(np.sum(e_a**2)),
        fro2_b=float(np.sum(e_b**2)),
        size_a=size_a,
        size_b=size_b,
    )


def analyse_nodes(
    krylov_inverse: np.ndarray,
    nodes: np.ndarray,
    is_real: np.ndarray,
    world_size: int,
    rank: int,
    reference: str,
) -> RankAnalysis:
    """The node route. ``nodes`` holds one complex node per real node or conjugate pair, in the
    column order of the rows; ``krylov_inverse`` is ``V^-1``."""
    size_a, size_b = rank, world_size - 1 - rank
    alpha, beta = system_weights(reference, size_a, size_b)
    wrap = nodes ** (-world_size)  # Q^-N
    mix = alpha + beta * wrap
    if np.any(np.abs(mix) < 1e-14):
        raise SingularCodeError(f"rank {rank}: alpha + beta z^-N vanishes at a node")
    # W_j = (alpha I + beta Q^-N)^-1 Q^(j-N) V^-1 for j > 0, Q^j V^-1 for reference A at j = 0.
    shift = nodes ** (rank - world_size) if size_a else nodes ** rank * wrap
    scale = shift / mix
    e_a = 1.0 / mix - 1.0
    e_b = wrap / mix - 1.0
    multiplicity = np.where(is_real, 1.0, 2.0)
    return RankAnalysis(
        decoder=_scale_rows(krylov_inverse, scale, is_real),
        norm_a=float(np.max(np.abs(e_a))) if size_a else 0.0,
        norm_b=float(np.max(np.abs(e_b))) if size_b else 0.0,
        fro2_a=float(np.sum(multiplicity * np.abs(e_a) ** 2)) if size_a else 0.0,
        fro2_b=float(np.sum(multiplicity * np.abs(e_b) ** 2)) if size_b else 0.0,
        size_a=size_a,
        size_b=size_b,
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
