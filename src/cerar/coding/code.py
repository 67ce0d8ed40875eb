"""`Code`: one CERAR design for an N-rank ring, shaped like the maths.

A code is the row function ``F(n)`` in ``R^c`` (row ``n`` mixes the ``c`` components of a rank's
gradient into one packet) together with the per-rank decoders it implies. Pure numpy: this module
never imports torch.

Rank ``j`` ends the ring with ``c`` observations ``O_j = M_A S_A + M_B S_B`` where ``S_A`` is the sum
of the ranks before it on the ring (``i < j``), ``S_B`` the sum of those after it (their packets
crossed the ``N-1 -> 0`` link), ``M_A`` has rows ``F(t+1-j)`` and ``M_B`` rows ``F(t+1-j-N)`` for
``t = N-1 .. c+N-2``. It decodes ``S_hat_j = X_j + W_j O_j``. With ``E_A = W_j M_A - I`` and
``E_B = W_j M_B - I`` the error is ``E_A S_A + E_B S_B``, which is zero for every input only when
the code is exact.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cerar._checks import check_bool, check_choice, check_float, check_int
from cerar.coding import seam
from cerar.coding.code_json import CodeJson
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

REFERENCES: tuple[str, ...] = ("mixed", "A")

#: The default limit on a code's predicted worst-rank relative error at its packet precision
#: (:meth:`Code.check_error`): the tuned constructions refuse to build a code above it. At 0.1 the
#: "sum" already carries a tenth of its own size in noise; the defaults (``choose``, ``perturbed(N,
#: 2N)`` at fp32, fp16 or bf16 for N = 2..8) sit at 1e-4 to 0.09.
MAX_ERROR = 0.1

__all__ = ["MAX_ERROR", "REFERENCES", "Code", "SingularCodeError", "check_max_error"]


def check_max_error(max_error: Any) -> float | None:
    """``max_error`` checked: a positive finite number, or None (no limit)."""
    return check_float("max_error", max_error, positive=True, optional=True)


class Code(CodeJson):
    """A CERAR code for ``world_size`` ranks and ``components`` components.

    Build one with a construction from :mod:`cerar.coding.codes` (``exact``, ``perturbed``,
    ``vandermonde``, ``optimized``), from a node set with :meth:`Code.from_nodes`, or from any
    table of rows with the constructor. JSON (``to_json``, ``from_json``, ``to_dict``,
    ``from_dict``), ``fingerprint`` and equality come from :class:`cerar.coding.code_json.CodeJson`.

    Args:
        world_size: ``N``, the number of ranks on the ring (at least 2).
        rows: array of shape ``(c + 2N - 3, c)``; row ``k`` is ``F(n)`` for ``n = k + 2 - N``, i.e.
            the exponents ``2-N .. c+N-2`` that the protocol uses.
        construction: a name for ``repr`` and JSON.
        params: the construction's parameters (JSON-serialisable), for ``repr`` and JSON.
        reference: the decoder: ``"mixed"`` (default; exact on the part all ranks share) or
            ``"A"`` (``W_j = M_A^-1``; rank 0 uses ``M_B^-1`` as it has no unwrapped peers).
        spread_seam: encode rank ``i``'s input as ``Z^i X_i`` (see :mod:`cerar.coding.seam`); needs a
            code built from nodes and the mixed decoder. Costs nothing at run time.
    """

    def __init__(
        self,
        world_size: int,
        rows: np.ndarray,
        *,
        construction: str = "custom",
        params: Mapping[str, Any] | None = None,
        reference: str = "mixed",
        spread_seam: bool = False,
        _nodes: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        self.world_size = check_int("world_size", world_size, minimum=2)
        rows = np.array(rows, dtype=np.float64)
        if rows.ndim != 2 or rows.shape[1] < 1:
            raise ValueError(
                f"Argument 'rows' must be a 2-d array with c >= 1 columns, not shape {rows.shape}."
            )
        self.components = rows.shape[1]
        expected = self.components + 2 * self.world_size - 3
        if rows.shape[0] != expected:
            raise ValueError(
                f"Argument 'rows' must have c + 2N - 3 = {expected} rows for N = {self.world_size}, "
                f"c = {self.components}, not {rows.shape[0]}."
            )
        if not np.all(np.isfinite(rows)):
            raise ValueError("Argument 'rows' must be finite, not an array holding NaN or Inf.")
        rows.setflags(write=False)
        self._rows = rows
        self.construction = str(construction)
        self.params: dict[str, Any] = dict(params or {})
        self.reference = check_choice("reference", reference, REFERENCES)
        self._nodes = _nodes
        check_bool("spread_seam", spread_seam)
        self.spread_seam = spread_seam
        self._offsets: np.ndarray | None = None
        if spread_seam:
            if _nodes is None:
                raise ValueError("Argument 'spread_seam' needs a code built from nodes (Code.from_nodes), not rows.")
            if self.reference != "mixed":
                raise ValueError(f"Argument 'reference' must be 'mixed' when spread_seam=True, not {reference!r}.")
            self._offsets = seam.seam_offsets(*self._complex_nodes(), self.world_size)
        self._cache: dict[int, RankAnalysis] = {}
        self._vinv: np.ndarray | None = None
        self._cond: np.ndarray | None = None
        self._mean_row_energy = float(np.mean(np.sum(rows**2, axis=1)))  # mean ||F(n)||^2
        self._fingerprint: str | None = None

    # ----------------------------------------------------------------------------------------
    # Construction from nodes
    @classmethod
    def from_nodes(
        cls,
        world_size: int,
        radii: Sequence[float] | np.ndarray,
        angles: Sequence[float] | np.ndarray,
        *,
        construction: str = "nodes",
        params: Mapping[str, Any] | None = None,
        reference: str = "mixed",
        spread_seam: bool = False,
    ) -> Code:
        """Build ``F(n) = u^T Q^n`` from the eigenvalues of ``Q``, given one per conjugate pair.

        Each node ``radius * exp(i * angle)`` with ``0 < angle < pi`` stands for a conjugate
        pair and contributes the two entries ``r^n cos(n angle)``, ``r^n sin(n angle)``; a node
        with ``angle`` 0 or ``pi`` is real and contributes ``(+-r)^n``. ``c`` is the number of
        entries so made.
        """
        world_size = check_int("world_size", world_size, minimum=2)
        radii = np.array(radii, dtype=np.float64).ravel()
        angles = np.array(angles, dtype=np.float64).ravel()
        if radii.shape != angles.shape or radii.size == 0:
            raise ValueError(
                f"Arguments 'radii' and 'angles' must be non-empty and of equal length, "
                f"not {radii.size} and {angles.size}."
            )
        if not (np.all(np.isfinite(radii)) and np.all(radii > 0)):
            raise ValueError(f"Argument 'radii' must be positive and finite, not {radii.tolist()!r}.")
        if not (np.all(np.isfinite(angles)) and np.all(angles >= 0) and np.all(angles <= math.pi)):
            raise ValueError(f"Argument 'angles' must lie in [0, pi], not {angles.tolist()!r}.")
        order = np.lexsort((radii, angles))
        radii, angles = radii[order], angles[order]
        columns = []
        is_real = (angles == 0.0) | (angles == math.pi)
        c = int(np.sum(np.where(is_real, 1, 2)))
        n = np.arange(2 - world_size, c + world_size - 1, dtype=np.float64)
        for r, theta, real in zip(radii, angles, is_real, strict=True):
            scale = r**n
            if real:
                columns.append(scale * (1.0 if theta == 0.0 else (-1.0) ** n))
            else:
                columns.append(scale * np.cos(n * theta))
                columns.append(scale * np.sin(n * theta))
        rows = np.stack(columns, axis=1)
        return cls(
            world_size,
            rows,
            construction=construction,
            params=params,
            reference=reference,
            spread_seam=spread_seam,
            _nodes=(radii, angles),
        )

    # ----------------------------------------------------------------------------------------
    # Sizes and rates
    @property
    def rounds(self) -> int:
        """``L = c + N - 2``: ring rounds per call."""
        return self.components + self.world_size - 2

    @property
    def comm_rate(self) -> float:
        """Values sent per rank per gradient value: ``L / c = 1 + (N-2)/c``."""
        return self.rounds / self.components

    @property
    def ring_comm_rate(self) -> float:
        """Ring all-reduce's rate ``2(N-1)/N``, for comparison."""
        return 2 * (self.world_size - 1) / self.world_size

    @property
    def storage_rate(self) -> float:
        """The protocol's storage per gradient value: own data plus ``N`` injections, ``1 + N/c``."""
        return 1 + self.world_size / self.components

    @property
    def is_exact(self) -> bool:
        """True when every rank decodes the exact sum in exact arithmetic (to 1e-9)."""
        return bool(np.max(self.error_bound) < 1e-9)

    # ----------------------------------------------------------------------------------------
    # Rows
    @property
    def rows(self) -> np.ndarray:
        """Read-only table of ``F(n)`` for ``n = 2-N .. c+N-2``, shape ``(c + 2N - 3, c)``."""
        return self._rows

    @property
    def nodes(self) -> np.ndarray | None:
        """The full, conjugation-closed node set (eigenvalues of ``Q``), or None for raw rows."""
        if self._nodes is None:
            return None
        radii, angles = self._nodes
        out = []
        for r, theta in zip(radii, angles, strict=True):
            z = r * np.exp(1j * theta)
            out.append(z)
            if 0.0 < theta < math.pi:
                out.append(np.conj(z))
        return np.array(out)

    def F(self, n: int | np.ndarray) -> np.ndarray:
        """Row(s) ``F(n)`` for exponent(s) ``n`` in ``[2-N, c+N-2]``."""
        index = np.asarray(n) - (2 - self.world_size)
        if np.any(index < 0) or np.any(index >= self._rows.shape[0]):
            raise ValueError(
                f"Argument 'n' must lie in [{2 - self.world_size}, {self.rounds}], not {n!r}."
            )
        return self._rows[index]

    def observation_matrices(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """``(M_A, M_B)`` of ``rank``: ``O_j = M_A S_A + M_B S_B`` (``c x c`` each)."""
        j = self._check_rank(rank)
        t = np.arange(self.world_size - 1, self.rounds + 1)
        upper = t + 1 - j
        # For rank 0 nothing is unwrapped; its M_A would need F(c+N-1), outside the table and
        # multiplied by an empty sum, so report zeros.
        m_a = self.F(upper) if j > 0 else np.zeros((self.components, self.components))
        m_b = self.F(upper - self.world_size) if j < self.world_size - 1 else np.zeros_like(m_a)
        return m_a, m_b

    # ----------------------------------------------------------------------------------------
    # Decoders and their analysis
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

    def check_error(self, precision: Any = None, max_error: float | None = MAX_ERROR) -> Code:
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

    # ----------------------------------------------------------------------------------------
    # Variants (identity and serialisation: see CodeJson)
    def with_reference(self, reference: str) -> Code:
        """The same rows with another decoder (``"mixed"`` or ``"A"``)."""
        return Code(
            self.world_size,
            self._rows,
            construction=self.construction,
            params=self.params,
            reference=reference,
            spread_seam=self.spread_seam and reference == "mixed",
            _nodes=self._nodes,
        )

    def __repr__(self) -> str:
        params = ", ".join(
            f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v!r}" for k, v in self.params.items()
        )
        params = f", {params}" if params else ""
        return (
            f"<Code {self.construction}(N={self.world_size}, c={self.components}{params}): "
            f"L={self.rounds}, comm_rate={self.comm_rate:.3f} vs ring {self.ring_comm_rate:.3f}, "
            f"decoder={self.reference}{', seam spread' if self.spread_seam else ''}>"
        )
