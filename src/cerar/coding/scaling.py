"""Exact power-of-two scaling of CERAR's packets, for every finite input of every dtype.

A packet is a sum of at most ``N`` injections, each a row of the code times one rank's
components, so its magnitude is at most ``N G M``: ``M`` the largest input magnitude over all
ranks and ``G`` the code's *packet gain*, the largest 1-norm of an injection row
(:func:`packet_gain`). Its *level* is ``P = log2(N G M) - e`` when the injections are divided by
``s = 2**e``. A call picks ``e`` so that ``P`` lies in its :class:`ScaleWindow`:

* below the packet format's overflow, and far enough above its subnormals that the largest
  values keep their precision (30% of the format's exponent range, at least 24 binades);
* low enough that the decode does not overflow either: the own part ``D X / s`` is computed in
  the data's dtype and the observations' part ``W R`` in the accumulator's (float64, float32 for
  16-bit packets), and the decoder's entries reach
  ``H`` (its *decode gain*, up to ``2**42`` for the float64 designs), so ``P`` stays ``log2 H``
  below those dtypes' tops.

Dividing by ``s`` is exact and usually free: ``s`` is folded into the increment rows and the
decoder (``s_rows = 2**r``). The rows are numbers of the data's dtype and the decoder's weights of
float64, so ``r`` has limits of its own (:meth:`ScaleWindow.split`); past them, for inputs near the
ends of the data's range (float32 data near ``1e38`` or ``1e-38`` with float16 packets, float64
data near ``1e308`` or its subnormals), the remaining factor ``s_data = 2**(e - r)`` scales a copy
of the input (exact, one pass) and multiplies the decoded sum as it is written.

For float32 and bfloat16 packets the window is wide, so ``s = 1`` serves every ordinary
gradient; float16's is a few binades, so its scale follows the data (``target``).

Pure numpy and ``math`` on integers and logarithms of positive finite floats (no torch): no call
here can overflow or fail on an extreme input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from cerar.coding.blocks import QMAX, BlockFormat
from cerar.coding.linear_code import Code
from cerar.coding.precision import precision_name

__all__ = [
    "FORMATS",
    "FloatFormat",
    "ScaleWindow",
    "block_scale_exponent",
    "packet_gain",
    "ring_needs_scale",
    "ring_scale_exponent",
    "scale_window",
]


@dataclass(frozen=True)
class FloatFormat:
    """The exponent range of a binary floating-point format: its largest finite values lie below
    ``2**top``, its smallest normal is ``2**tiny``, with ``bits`` significand bits."""

    top: int
    tiny: int
    bits: int

    @property
    def span(self) -> int:
        return self.top - self.tiny


FORMATS: dict[str, FloatFormat] = {
    "fp64": FloatFormat(top=1024, tiny=-1022, bits=53),
    "fp32": FloatFormat(top=128, tiny=-126, bits=24),
    "bf16": FloatFormat(top=128, tiny=-126, bits=8),
    "fp16": FloatFormat(top=16, tiny=-14, bits=11),
}

_HEADROOM = 4  # binades kept below a dtype's overflow for what the bounds leave out (rounding, sums)
_NARROW_SPAN = 64  # a packet format with fewer binades follows the data (a target level)
_GROWTH = 2  # binades between a narrow format's target and its top: room for the data to grow
_FOLD_ROOM = 32  # binades of scale the decoder's weights can take before the input is copied
_FOLLOW = 1  # binades a narrow format's level may drift from its target before the next call re-centres it


@dataclass(frozen=True)
class ScaleWindow:
    """Where a call's packet level may lie, and how its scale is split, for one (code, data
    dtype, packet dtype).

    Attributes:
        bottom, top: the window of the packet level ``P = log2(N G M) - e``; a call whose data
            put it outside is redone with a new ``e``.
        target: the level a new ``e`` puts ``P`` at (``None``: the ``e`` closest to 0 inside
            the window, so that ordinary data is never rescaled).
        log_gain: ``log2(N G)``.
        rows_low, rows_high: the range of ``r``, the part of ``e`` folded into the rows and the
            decoder (see :meth:`split`).
    """

    bottom: float
    top: float
    target: float | None
    log_gain: float
    rows_low: int
    rows_high: int

    def level(self, max_abs: float) -> float | None:
        """``log2(N G max_abs)``, or None for 0 (nothing to scale); ``max_abs`` finite, >= 0."""
        return None if max_abs <= 0.0 else math.log2(max_abs) + self.log_gain

    def admits(self, max_abs: float, exponent: int) -> bool:
        """Whether inputs of largest magnitude ``max_abs`` fit the window at ``s = 2**exponent``
        (False for NaN/Inf)."""
        if not math.isfinite(max_abs):
            return False
        level = self.level(max_abs)
        return level is None or self.bottom <= level - exponent <= self.top

    def exponent_for(self, max_abs: float) -> int:
        """The ``e`` for inputs of largest magnitude ``max_abs`` (0 when it is 0 or not finite:
        nothing to scale, or the call will not decode)."""
        if not math.isfinite(max_abs):
            return 0
        level = self.level(max_abs)
        if level is None:
            return 0
        if self.target is not None:
            return math.ceil(level - self.target)
        # The exponent closest to 0 that puts ``level - e`` inside [bottom, top].
        return min(max(0, math.ceil(level - self.top)), math.floor(level - self.bottom))

    def follow(self, max_abs: float, exponent: int) -> int:
        """The ``e`` for the next call of a size whose call at ``e`` had inputs of largest
        magnitude ``max_abs``: for a narrow format, re-centred on the target once the level has
        drifted more than a binade from it, so that data drifting slowly (gradients over
        training) stays inside the window and no call of it is redone (a redo sends the whole
        call again); otherwise ``exponent``. Within a binade it stays, so that the packet scale
        (and the layout's bound rows, which depend on it) does not change at every call."""
        level = self.level(max_abs) if math.isfinite(max_abs) else None
        if self.target is None or level is None or abs(level - exponent - self.target) <= _FOLLOW:
            return exponent
        return self.exponent_for(max_abs)

    def split(self, exponent: int) -> tuple[int, int]:
        """``(r, e - r)``: the part of ``e`` folded into the rows and the decoder (as close to
        ``e`` as their dtypes allow), and the rest, which scales a copy of the input (0 for every
        input but those near the ends of its dtype's range)."""
        rows = min(max(exponent, self.rows_low), self.rows_high)
        return rows, exponent - rows


def scale_window(code: Code, data: object, packet: object, decode_gain: float) -> ScaleWindow:
    """The :class:`ScaleWindow` of ``code`` for data of precision ``data`` (the working dtype:
    ``fp32`` or ``fp64``) and packets of precision ``packet``. ``decode_gain`` is ``H``, the
    largest row 1-norm of the decode matrix over every rank
    (:meth:`cerar.protocol.schedule.Schedule.decode_gain`), so that every rank builds the same
    window and decides the same.

    Raises ValueError if no scale can serve the code in these dtypes (a decoder so large that
    its products overflow the data's dtype at every packet level the format admits).
    """
    data_name, packet_name = precision_name(data, "data"), precision_name(packet, "packet_dtype")
    # The decode's sum: float64, or float32 for 16-bit packets (cerar.comm.algorithms.cerar.plans.accumulator_dtype).
    wide = FORMATS["fp32" if packet_name in ("fp16", "bf16") else "fp64"]
    values, wire = FORMATS[data_name], FORMATS[packet_name]
    log_gain = math.log2(code.world_size * packet_gain(code))
    log_decode = math.log2(max(decode_gain, 1.0))
    log_rows = math.log2(2 * packet_gain(code))  # an increment row is a difference of two injection rows
    span_kept = max(24, math.floor(0.3 * wire.span))
    bottom = float(wire.tiny + span_kept)
    top = min(
        float(wire.top - 1),  # the packets themselves (N G M bounds them)
        values.top - _HEADROOM - log_decode + log_gain,  # D X / s in the data's dtype
        wide.top - _HEADROOM - log_decode - _FOLD_ROOM,  # W R in the accumulator, with room for r
    )
    if top < bottom + 1:
        raise ValueError(
            f"cerar: {code.construction}(N={code.world_size}, c={code.components}) cannot be scaled for "
            f"{data_name} data with {packet_name} packets: its decoder's entries reach 2**{log_decode:.0f}, "
            f"which leaves no packet level between 2**{bottom:.0f} and 2**{top:.0f}."
        )
    target = top - _GROWTH if wire.span < _NARROW_SPAN else None
    # r's limits: the rows and D / 2**r are numbers of the data's dtype whose largest entries stay
    # normal; W 2**r is in the accumulator's dtype, and times packets up to 2**top it must not overflow; the input
    # copy X / 2**(e - r) must stay in the data's dtype (packets at the top: X up to 2**(top - log_gain + r)).
    rows_low = math.ceil(max(log_rows, log_decode) - (values.top - _HEADROOM))
    rows_high = math.floor(
        min(
            log_rows - (values.tiny + values.bits),
            -(values.tiny + values.bits),  # D's entries of order 1
            wide.top - _HEADROOM - log_decode - top,
            values.top - _HEADROOM - top + log_gain,
        )
    )
    # W 2**r stays normal, and so does the accumulated sum (about 2**(P - log_gain + r)): its
    # products cancel down from 2**(P + r + log_decode), and subnormals would drop those bits.
    rows_low = max(rows_low, math.ceil(wide.tiny + wide.bits - log_decode), math.ceil(wide.tiny + log_gain - bottom))
    if rows_low > rows_high:
        raise ValueError(
            f"cerar: {code.construction}(N={code.world_size}, c={code.components}) cannot be scaled for "
            f"{data_name} data with {packet_name} packets (no room for its rows: 2**{rows_low} .. 2**{rows_high})."
        )
    return ScaleWindow(bottom, top, target, log_gain, rows_low, rows_high)


def ring_scale_exponent(world_size: int, max_abs: float, data: object, wire: object) -> int:
    """``e`` such that the exact ring, dividing by ``2**e``, keeps partial sums of ``world_size``
    values of magnitude up to ``max_abs`` inside the ``wire`` format: float16 puts them near
    ``2**14`` (no overflow at 65504, no subnormals); the data's own format needs nothing; any
    other (bfloat16 for float32 data, float32 or bfloat16 for float64 data) takes the exponent
    closest to 0 that keeps them out of its overflow and at least 30% of its exponent range above
    its subnormals. 0 for 0 or non-finite ``max_abs`` (nothing to scale; NaN/Inf propagate as in
    torch). Returned as an exponent: ``2**e`` itself may not be a float64."""
    if not ring_needs_scale(data, wire) or not math.isfinite(max_abs) or max_abs <= 0:
        return 0
    level = math.log2(max_abs) + math.log2(world_size)
    if precision_name(wire, "wire_dtype") == "fp16":
        return math.ceil(level) - FLOAT16_RING_LEVEL
    wire_format = FORMATS[precision_name(wire, "wire_dtype")]
    top = wire_format.top - _HEADROOM
    bottom = wire_format.tiny + max(24, math.floor(0.3 * wire_format.span))
    return min(max(0, math.ceil(level - top)), math.floor(level - bottom))


def ring_needs_scale(data: object, wire: object) -> bool:
    """Whether the exact ring must scale ``data`` for ``wire``: whenever the wire is not the data's
    own format (a cast to bfloat16 flushes float32's subnormals to zero, and float64 data leaves
    float32's range), so such a call first finds its largest magnitude (one pass)."""
    return precision_name(wire, "wire_dtype") != precision_name(data, "data")


def block_scale_exponent(world_size: int, max_abs: float, fmt: BlockFormat) -> int:
    """``e`` such that a block-quantized ring (:class:`cerar.coding.blocks.BlockFormat`), dividing
    by ``2**e``, keeps its float32 partial sums of ``world_size`` values up to ``max_abs`` out of
    float32's overflow and the scale of a block as large as ``max_abs`` (``max_abs / QMAX``) out of
    its scale dtype's overflow and at least 30% of its exponent range above its subnormals: 0 for
    every input whose range allows it (the usual gradient, whose result is then bitwise what an
    unscaled ring gives), else the exponent closest to 0 that does. float64 data beyond float32's
    range, float32 sums that would overflow at one element (which then come back infinite at
    that element only, as torch's sum does) and tensors whose largest block's scale would be
    subnormal get one. 0 for 0 or non-finite ``max_abs``."""
    if not math.isfinite(max_abs) or max_abs <= 0:
        return 0
    scale = FORMATS[fmt.scale]
    level = math.log2(max_abs)  # of the largest value; its block's scale sits log2(QMAX) lower
    sums = math.log2(world_size) + level
    top = min(FORMATS["fp32"].top - _HEADROOM - sums + level, scale.top - _HEADROOM + math.log2(QMAX[fmt.wire]))
    bottom = scale.tiny + max(24, math.floor(0.3 * scale.span)) + math.log2(QMAX[fmt.wire])
    return min(max(0, math.ceil(level - top)), math.floor(level - bottom))


FLOAT16_RING_LEVEL = 14  # the float16 ring's partial sums stay below 2**14, far from 65504


def packet_gain(code: Code) -> float:
    """``G``: the largest 1-norm of an injection row ``F(n) T_i`` over every exponent and every
    rank's input transform, so that all ranks compute the same value."""
    rows = code.F(np.arange(2 - code.world_size, code.rounds + 1))
    return max(
        float(np.abs(rows @ code.input_transform(i)).sum(axis=1).max()) for i in range(code.world_size)
    )
