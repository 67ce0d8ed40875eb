"""The decoders of a :class:`cerar.Code` and its error model (mixed into it as :class:`CodeAnalysis`).

Rank ``j`` decodes ``S_hat_j = X_j + W_j O_j`` (:meth:`CodeAnalysis.decoder`); the error of that
sum in exact arithmetic (:attr:`CodeAnalysis.error_bound`, :meth:`CodeAnalysis.source_errors`)
and with packets rounded to a precision (:meth:`CodeAnalysis.predicted_error`) follow from the
code's rows (:mod:`cerar.coding.decoders` does the linear algebra). Kept apart from
:mod:`cerar.coding.linear_code`, which holds what a code is (its rows, sizes and constructions). Pure
numpy: this module never imports torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from cerar._checks import check_float, check_int
from cerar.coding import seam
from cerar.coding.decoders import (
    RankAnalysis,
    SingularCodeError,
    Sources,
    analyse_nodes,
    analyse_rows,
    krylov_inverse,
    predicted_relative_error,
)
from cerar.coding.precision import UNIT_ROUNDOFF, precision_name

__all__ = ["MAX_ERROR", "CodeAnalysis", "check_max_error"]

_C = TypeVar("_C", bound="CodeAnalysis")

#: The default limit on a code's predicted worst-rank relative error at its packet precision
#: (:meth:`Code.check_error`): the tuned constructions refuse to build a code above it. At 0.1 the
#: "sum" already carries a tenth of its own size in noise; the defaults (``choose``, ``perturbed(N,
#: 2N)`` at fp32, fp16 or bf16 for N = 2..8) sit at 1e-4 to 0.09.
MAX_ERROR = 0.1


def check_max_error(max_error: Any) -> float | None:
    """``max_error`` checked: a positive finite number, or None (no limit)."""
    return check_float("max_error", max_error, positive=True, optional=True)


class CodeAnalysis:
    """The decoders and the error model of :class:`cerar.coding.linear_code.Code`, its only subclass.

    Reads the attributes below, which ``Code.__init__`` sets, and the code's rows through
    ``Code.F`` and ``Code.observation_matrices``.
    """

    world_size: int
    components: int
    reference: str
    spread_seam: bool
    construction: str
    params: dict[str, Any]
    _nodes: tuple[np.ndarray, np.ndarray] | None
    _offsets: np.ndarray | None
    _cache: dict[int, RankAnalysis]
    _vinv: np.ndarray | None
    _cond: np.ndarray | None
    _mean_row_energy: float

    if TYPE_CHECKING:  # Code's

        def F(self, n: int | np.ndarray) -> np.ndarray: ...

        def observation_matrices(self, rank: int) -> tuple[np.ndarray, np.ndarray]: ...

    def decoder(self, rank: int) -> np.ndarray:
        """``W_j`` (``c x c``, float64): ``S_hat_j = X_j + W_j O_j``. Read-only, cached."""
        return self._analysis(self._check_rank(rank)).decoder

    @property
    def cond(self) -> np.ndarray:
        """Per rank: the 2-norm condition number of ``W_j^-1``, which amplifies packet rounding."""
        if self._cond is None:
            # cond(W^-1) = cond(W); the singular values come from the decoder we already hold.
            values = [np.linalg.svd(self.decoder(j), compute_uv=False) for j in range(self.world_size)]
            self._cond = np.array([v[0] / v[-1] for v in values])
        return self._cond.copy()

    @property
    def error_bound(self) -> np.ndarray:
        """Per rank ``beta_j``: in exact arithmetic, ``||S_hat_j - S||_F <= beta_j * D_j`` where

        ``D_j = (sum_{i != j} ||X_i - g||_F^2)^(1/2)`` with ``g`` the mean of the other ranks'
        inputs for the mixed decoder (it is exact on the shared part), and ``g = 0`` for
        reference A. For i.i.d. inputs ``D_j`` is about ``||S||``, so ``beta_j`` bounds the
        relative error. See :meth:`error_scale`.
        """
        return np.array([self._analysis(j).error_bound for j in range(self.world_size)])

    def error_scale(self, inputs: np.ndarray, rank: int) -> float:
        """``D_j`` of :attr:`error_bound` for these inputs (``(N, ...)`` array)."""
        j = self._check_rank(rank)
        x = np.asarray(inputs, dtype=np.float64)
        if x.ndim < 1 or x.shape[0] != self.world_size:
            # A bare reshape would silently accept any array whose size N divides.
            raise ValueError(
                f"Argument 'inputs' must be an (N, ...) array with N = world_size = {self.world_size}, "
                f"not shape {x.shape}."
            )
        x = x.reshape(self.world_size, -1)
        others = np.delete(x, j, axis=0)
        if self.reference == "mixed":
            others = others - others.mean(axis=0, keepdims=True)
        return float(np.linalg.norm(others))

    def wrap_errors(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """``(E_A, E_B) = (W M_A - I, W M_B - I)``: the error is ``E_A S_A + E_B S_B``.
        For a code that spreads its seam the error differs per source: see :meth:`source_errors`."""
        if self.spread_seam:
            raise ValueError(f"{self!r} spreads its seam: use source_errors(rank), not wrap_errors.")
        j = self._check_rank(rank)
        w = self.decoder(j)
        m_a, m_b = self.observation_matrices(j)
        eye = np.eye(self.components)
        e_a = w @ m_a - eye if j > 0 else np.zeros_like(eye)
        e_b = w @ m_b - eye if j < self.world_size - 1 else np.zeros_like(eye)
        return e_a, e_b

    def input_transform(self, rank: int) -> np.ndarray:
        """``T_i``: rank ``i`` encodes ``T_i X_i`` (the identity unless the seam is spread)."""
        i = self._check_rank(rank)
        if self._offsets is None:
            return np.eye(self.components)
        return seam.transform(self._offsets, self._complex_nodes()[1], i)

    def source_errors(self, rank: int) -> dict[int, np.ndarray]:
        """``E_i = W_j G_i - I`` for every other rank ``i``, from explicit matrices: rank
        ``rank``'s decoded sum is ``S + sum_i E_i X_i`` in exact arithmetic."""
        j = self._check_rank(rank)
        w = self.decoder(j)
        m_a, m_b = self.observation_matrices(j)
        eye = np.eye(self.components)
        return {
            i: w @ (m_a if i < j else m_b) @ self.input_transform(i) - eye for i in range(self.world_size) if i != j
        }

    def predicted_error(self, precision: Any = "fp32", ranks: Sequence[int] | None = None) -> np.ndarray:
        """Per rank: the model's relative error on i.i.d. inputs with packets in ``precision``.

        ``ranks`` limits the work to some ranks (default: all). The model adds, in quadrature, the
        exact-arithmetic error of i.i.d. inputs (``sqrt(sum_i ||E_i||_F^2 / (N c))``, see
        :meth:`source_errors`) and the packet rounding, each
        round's rounding taken as independent noise of variance ``u^2/3`` times the packet's
        energy, carried to the end and multiplied by ``W_j``.
        """
        u = UNIT_ROUNDOFF[precision_name(precision)]
        chosen = range(self.world_size) if ranks is None else [self._check_rank(j) for j in ranks]
        n, energy = self.world_size, self._mean_row_energy
        return np.array([predicted_relative_error(self._analysis(j), n, energy, u) for j in chosen])

    def predicted_worst_error(self, precision: Any = "fp32") -> float:
        """The largest of :meth:`predicted_error` over ranks."""
        return float(np.max(self.predicted_error(precision)))

    def check_error(self: _C, precision: Any = None, max_error: float | None = MAX_ERROR) -> _C:
        """Return ``self`` if its predicted worst-rank error at ``precision`` is at most ``max_error``.

        Raises ValueError naming the construction, ``N``, ``c``, the precision and the predicted
        error otherwise, and also when the code cannot be decoded at all (singular in float64).
        ``precision`` defaults to the one the code was built for (``params["precision"]``, else
        ``"fp32"``); ``max_error=None`` skips the check (nothing is computed).
        """
        max_error = check_max_error(max_error)
        if precision is None:
            precision = self.params.get("precision", "fp32")
        name = precision_name(precision)
        if max_error is None:
            return self
        what = f"cerar: {self.construction}(N={self.world_size}, c={self.components}) at {name} packets"
        advice = (
            f"use fewer components (c nearer N = {self.world_size}), wider packets or another construction, "
            "or pass max_error=None to build it anyway"
        )
        try:
            error = self.predicted_worst_error(name)
        except SingularCodeError as exc:
            raise ValueError(f"{what} cannot be decoded ({exc}); {advice}.") from None
        if not error <= max_error:  # also catches NaN
            raise ValueError(
                f"{what} has a predicted worst-rank error of {error:.3g} (limit {max_error:g}): it would "
                f"return noise rather than the sum; {advice}."
            )
        return self

    def _check_rank(self, rank: int) -> int:
        rank = check_int("rank", rank, minimum=0)
        if rank >= self.world_size:
            raise ValueError(f"Argument 'rank' must be less than world_size={self.world_size}, not {rank}.")
        return rank

    def _analysis(self, j: int) -> RankAnalysis:
        if j not in self._cache:
            sources = self._sources(j)
            if self._nodes is not None:
                nodes, is_real = self._complex_nodes()
                if self._offsets is not None:
                    multipliers = [self._offsets ** e for e in seam.exponents(self.world_size, j)]
                else:
                    multipliers = [np.ones_like(nodes), nodes ** (-self.world_size)]
                    multipliers = [m for m, n in zip(multipliers, (j, self.world_size - 1 - j), strict=True) if n]
                self._cache[j] = analyse_nodes(
                    self._krylov_inverse(), nodes, is_real, self.world_size, j, multipliers, sources
                )
            else:
                m_a, m_b = self.observation_matrices(j)
                views = [m for m, n in zip((m_a, m_b), (j, self.world_size - 1 - j), strict=True) if n]
                self._cache[j] = analyse_rows(views, sources, f"{self!r} on rank {j}")
        return self._cache[j]

    def _sources(self, j: int) -> Sources:
        n_ranks = self.world_size
        if self._offsets is not None:
            return Sources(counts=(1,) * (n_ranks - 1), weights=(1 / (n_ranks - 1),) * (n_ranks - 1))
        counts = tuple(n for n in (j, n_ranks - 1 - j) if n)
        if self.reference == "mixed":
            weights = tuple(n / (n_ranks - 1) for n in counts)
        else:  # reference A: the unwrapped side, or the wrapped one on rank 0
            weights = (1.0,) + (0.0,) * (len(counts) - 1)
        return Sources(counts=counts, weights=weights)

    def _complex_nodes(self) -> tuple[np.ndarray, np.ndarray]:
        assert self._nodes is not None
        radii, angles = self._nodes
        is_real = (angles == 0.0) | (angles == math.pi)
        nodes = np.where(is_real, radii * np.where(angles == 0.0, 1.0, -1.0), radii * np.exp(1j * angles))
        return nodes.astype(np.complex128), is_real

    def _krylov_inverse(self) -> np.ndarray:
        if self._vinv is None:
            krylov = self.F(np.arange(self.components))
            self._vinv = krylov_inverse(krylov, f"{self!r}")
        return self._vinv
