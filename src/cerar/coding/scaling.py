"""Exact power-of-two scaling of CERAR's packets: no overflow, no subnormals.

A packet is a sum of at most ``N`` injections, each a row of the code times one rank's
components, so its magnitude is at most ``N * G * M``: ``M`` the largest input magnitude over
all ranks and ``G`` the code's *packet gain*, the largest 1-norm of a round's increment row
(:func:`packet_gain`). The transport divides its injections by a power of two ``s`` (folded into
the increment rows, so it costs nothing and is exact) and multiplies the observations back in
the decoder. :class:`PacketRange` says which ``s`` keep ``N G M / s`` inside the packet format:
far enough below its overflow, and high enough that the largest values are not near its
subnormals. For float32 packets the window is wide (``2**-50 .. 2**100``), so ``s = 1`` serves
every ordinary gradient and only inputs near ``1e38`` or below ``1e-30`` are rescaled; float16's
is five binades, so its scale follows the data.

Pure numpy (no torch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from cerar.coding.code import Code
from cerar.coding.precision import precision_name


@dataclass(frozen=True)
class PacketRange:
    """Where ``log2(N G M / s)`` may lie for one packet precision.

    Attributes:
        bottom, top: the window of ``log2(N G M / s)``; outside it a call is redone with a new ``s``.
        target: where a new scale puts it (``None``: as close to ``s = 1`` as the window allows,
            so that ordinary data is never rescaled).
        coefficient_limit: ``|log2 s|`` at most this: the increment rows times ``1/s`` must stay
            normal numbers of the dtype the injections are computed in.
    """

    bottom: int
    top: int
    target: int | None
    coefficient_limit: int

    def admits(self, bound: float, scale: float) -> bool:
        """Whether packets bounded by ``bound = N G M`` fit the format when divided by ``scale``."""
        if bound == 0.0:
            return True
        if not math.isfinite(bound):
            return False
        return self.bottom <= math.log2(bound / scale) <= self.top

    def scale_for(self, bound: float) -> float:
        """The power of two to divide by for packets bounded by ``bound`` (1 when ``bound`` is
        0 or not finite: there is nothing to scale, or the call will not decode)."""
        if bound <= 0.0 or not math.isfinite(bound):
            return 1.0
        level = math.log2(bound)
        if self.target is not None:
            exponent = math.ceil(level) - self.target
        else:  # the exponent closest to 0 that puts ``level - exponent`` inside [bottom, top]
            exponent = min(max(0, math.ceil(level - self.top)), math.floor(level - self.bottom))
        exponent = max(-self.coefficient_limit, min(self.coefficient_limit, exponent))
        return math.ldexp(1.0, exponent)


#: Per packet precision. bfloat16 has float32's exponent range; float16 overflows at 65504
#: (``2**16``) and its subnormals start at ``2**-14``: its packets are kept between ``2**10``
#: and ``2**15``, a new scale putting them at ``2**13`` (two binades of headroom for growth).
PACKET_RANGES: dict[str, PacketRange] = {
    "fp64": PacketRange(bottom=-900, top=1000, target=None, coefficient_limit=1000),
    "fp32": PacketRange(bottom=-50, top=100, target=None, coefficient_limit=100),
    "bf16": PacketRange(bottom=-50, top=100, target=None, coefficient_limit=100),
    "fp16": PacketRange(bottom=10, top=15, target=13, coefficient_limit=100),
}


def packet_range(precision: object) -> PacketRange:
    return PACKET_RANGES[precision_name(precision, "packet_dtype")]


def packet_gain(code: Code) -> float:
    """``G``: the largest 1-norm of an injection row ``F(n) T_i`` over every exponent and every
    rank's input transform, so that all ranks compute the same value."""
    rows = code.F(np.arange(2 - code.world_size, code.rounds + 1))
    return max(
        float(np.abs(rows @ code.input_transform(i)).sum(axis=1).max()) for i in range(code.world_size)
    )
