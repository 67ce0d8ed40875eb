"""What CERAR's run (:class:`cerar.comm.algorithms.cerar.run.CerarRun`) shares with its encode and
decode objects (:mod:`cerar.comm.algorithms.cerar.encode`, :mod:`cerar.comm.algorithms.cerar.decode`), kept apart
by lifetime:

* :class:`CerarLayout`: what one layout fixes (sizes, pieces, dtypes, the packet buffers), built
  once and kept with the layout's run;
* :class:`CerarCall`: one call's input, decision and :class:`CodingTimes`, made for the call and
  dropped when it returns (a kept layout holds no caller's tensor).

The run, bound once per layout, hands each call to its encode and decode objects (:meth:`Armed.arm`)
rather than them reaching back into the run: this module imports neither, so both can name the
types they read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from cerar.comm.algorithms.cerar.scale import PacketScale
from cerar.comm.runtime.maxima import MaximaChain
from cerar.comm.runtime.stats import CommStats

__all__ = ["Armed", "CerarCall", "CerarLayout", "CodingTimes"]


@dataclass(frozen=True, eq=False)
class CerarLayout:
    """One rank's layout for one code, size and dtypes, fixed while the run is kept.

    Component ``k`` takes every ``c``-th value, so the ``(c, m)`` component matrix is the ``(m,
    c)`` view of the flat input, transposed; a column piece ``[a, b)`` is the flat slice ``[ac,
    bc)``. Every packet row starts with the maxima chain's :attr:`front`, the values follow it.
    """

    # Sizes: c components, d values, m = ceil(d / c) columns, of which full_rows need no padding.
    c: int
    d: int
    m: int
    full_rows: int
    # Dtypes: the data's, the packets', and the decode's accumulator (wider than the packets').
    dtype: torch.dtype
    packet: torch.dtype
    acc_dtype: torch.dtype
    device: torch.device
    # Rounds: how many, the first whose arrival is an observation, and the rows' scale 2**r.
    rounds: int
    first_observed: int
    rows_scale: float
    # The column pieces [a, b) each round sends (the same in every round).
    pieces: tuple[tuple[int, int], ...]
    # Packet buffers (workspace views, f + m wide, f the chain's front): two alternating send
    # rows, two scratch receive rows for the rounds before the first observation, and one slot per
    # observation round, received into straight and kept until the decode reads it.
    front: int
    send: torch.Tensor
    recv: torch.Tensor
    observations: torch.Tensor


@dataclass
class CodingTimes:
    """What one call's coding took: wall time of the encode and of the decode, and the coding
    thread's CPU time in both (:class:`cerar.comm.runtime.stats.CommStats` has the meanings)."""

    encode_s: float = 0.0
    decode_s: float = 0.0
    coding_cpu_s: float = 0.0

    def add_to(self, stats: CommStats) -> None:
        stats.encode_s += self.encode_s
        stats.decode_s += self.decode_s
        stats.coding_cpu_s += self.coding_cpu_s


@dataclass(eq=False)
class CerarCall:
    """One call's state: its input, the decision to write, and its coding times."""

    # The input, and its (w, c) rows per piece (keyed by the piece's first column) that the coding
    # reads: views of flat or, near the ends of the dtype's range, of a copy divided by
    # 2**data_exponent; the last piece copied and zero padded where c does not divide d.
    flat: torch.Tensor
    columns: dict[int, torch.Tensor]
    data_exponent: int
    # The decision, made once, after the last round (or by the run, if there was no piece): from
    # the layout's chain, whose own hops (if the rounds carried too few) are numbered from
    # next_round.
    scale: PacketScale
    write_nonfinite: bool
    chain: MaximaChain
    next_round: int
    maxima: list[float] = field(default_factory=list)
    written: bool | None = None
    times: CodingTimes = field(default_factory=CodingTimes)

    def decide(self) -> bool:
        """Whether to write the sum, the same on every rank, asked once: every rank's data fitted
        the packet scale, or held NaN/Inf and the call writes it anyway (``nonfinite="ignore"``)."""
        if self.written is None:
            self.maxima.extend(self.chain.maxima(self.next_round))
            if all(math.isfinite(v) for v in self.maxima):
                self.written = self.scale.admits(max(self.maxima))
            else:
                self.written = self.write_nonfinite
        return self.written


class Armed:
    """An encode or decode object's current call: set by the run for the length of one call
    (:meth:`arm`), ``None`` between calls. The run's program binds the object's methods once per
    layout; arming reaches them without binding anything again."""

    __slots__ = ("call",)

    def __init__(self) -> None:
        self.call: CerarCall | None = None

    def arm(self, call: CerarCall | None) -> None:
        self.call = call
