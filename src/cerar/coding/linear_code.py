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

from cerar._checks import check_bool, check_choice, check_int
from cerar.coding import seam
from cerar.coding.code_analysis import MAX_ERROR, CodeAnalysis, check_max_error
from cerar.coding.code_json import CodeJson
from cerar.coding.decoders import RankAnalysis, SingularCodeError

REFERENCES: tuple[str, ...] = ("mixed", "A")

__all__ = ["MAX_ERROR", "REFERENCES", "Code", "SingularCodeError", "check_max_error"]


class Code(CodeAnalysis, CodeJson):
    """A CERAR code for ``world_size`` ranks and ``components`` components.

    Build one with a construction from :mod:`cerar.coding.codes` (``exact``, ``perturbed``,
    ``vandermonde``, ``optimized``), from a node set with :meth:`Code.from_nodes`, or from any
    table of rows with the constructor. The decoders and the error model (``decoder``,
    ``error_bound``, ``predicted_error``, ``check_error``...) come from
    :class:`cerar.coding.code_analysis.CodeAnalysis`; JSON (``to_json``, ``from_json``,
    ``to_dict``, ``from_dict``), ``fingerprint`` and equality from
    :class:`cerar.coding.code_json.CodeJson`.

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
