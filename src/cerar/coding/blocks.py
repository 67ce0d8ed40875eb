"""Block-quantized 8-bit packets: the numpy reference of the format.

A float32 vector of ``m`` values travels as ``m`` one-byte codes and one scale per block of
``block`` values (the last block shorter; it is computed as if zero padded, and the pad is not
sent), so a value costs ``1 + scale_itemsize / block`` bytes. Per block:

1. ``absmax = max |x|`` in float32;
2. ``s = float32(absmax) / float32(QMAX)`` (a float32 division), rounded to the scale dtype with
   round-to-nearest-even (fp16 through numpy's float16, bf16 through
   :func:`cerar.coding.precision.rounder`) and kept as a float32 value;
3. ``q = x / s`` in float32, clamped to ``[-QMAX, QMAX]``, then rounded: ``int8`` to the nearest
   integer, ties to even (``np.rint``); ``fp8`` to the nearest float8_e4m3fn value, ties to even
   (:func:`fp8_encode`); a block whose ``s`` is 0 or not finite gets ``q = 0``;
4. dequantized as ``float32(q) * s`` (a float32 multiply).

A non-finite input makes its block's ``absmax`` and so its scale non-finite, and the block
dequantizes to NaN (``0 * inf`` and ``0 * nan``): non-finite input spreads to its block, no further.
A block of zeros has ``s = 0`` and dequantizes to zeros. With a float16 scale the format's range
is float16's: a block whose ``absmax / QMAX`` exceeds 65504 overflows to NaN, one below about
``6e-8 QMAX`` flushes to zero; float32 and bfloat16 scales have float32's range.

The torch and compiled kernels are tested bitwise against this module. Pure numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from cerar._checks import check_choice, check_int
from cerar.coding.precision import rounder

__all__ = [
    "QMAX",
    "SCALE_DTYPES",
    "WIRES",
    "BlockFormat",
    "dequantize",
    "fp8_decode",
    "fp8_encode",
    "quantize",
    "ring_error_bound",
    "round_trip",
]

#: The 8-bit wire formats.
WIRES: tuple[str, ...] = ("int8", "fp8")
#: The largest magnitude of each wire's codes: a block's absmax maps onto it.
QMAX: dict[str, float] = {"int8": 127.0, "fp8": 448.0}
#: The dtypes a block's scale can travel in, and their bytes.
SCALE_DTYPES: tuple[str, ...] = ("fp32", "fp16", "bf16")
SCALE_ITEMSIZE: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2}
#: Unit roundoff of the scale dtypes (the scale's own rounding, a factor within ``1 +- u``).
SCALE_ROUNDOFF: dict[str, float] = {"fp32": 2.0**-24, "fp16": 2.0**-11, "bf16": 2.0**-8}


def _fp8_table() -> np.ndarray:
    """The float32 value of each of the 256 float8_e4m3fn codes (bias 7, 3 mantissa bits, no
    infinities; ``0x7F`` and ``0xFF`` are NaN)."""
    codes = np.arange(256)
    sign = np.where(codes >> 7, -1.0, 1.0)
    exponent, mantissa = (codes >> 3) & 0xF, codes & 0x7
    value = np.where(exponent == 0, mantissa * 2.0**-9, (1 + mantissa / 8) * 2.0 ** (exponent - 7.0))
    value = sign * value
    value[(codes & 0x7F) == 0x7F] = np.nan
    return value.astype(np.float32)


FP8_VALUES: np.ndarray = _fp8_table()
_FP8_POSITIVE = FP8_VALUES[:127].astype(np.float64)  # codes 0..126, ascending, 0 .. 448


def fp8_encode(q: np.ndarray) -> np.ndarray:
    """The float8_e4m3fn bit patterns (uint8) nearest to float32 ``q``, ties to even.

    Magnitudes beyond 448 saturate to 448 (the quantizer clamps before it rounds); NaN becomes
    ``0x7F`` (``0xFF`` if its sign bit is set); ``-0.0`` keeps its sign (``0x80``).
    """
    q = np.asarray(q, dtype=np.float32)
    a = np.minimum(np.abs(q).astype(np.float64), 448.0)
    hi = np.clip(np.searchsorted(_FP8_POSITIVE, a, side="left"), 1, 126)
    lo = hi - 1
    below, above = a - _FP8_POSITIVE[lo], _FP8_POSITIVE[hi] - a
    # Ties go to the even code (an even mantissa: codes ascend with the value).
    pick_hi = (above < below) | ((above == below) & (hi % 2 == 0))
    code = np.where(pick_hi, hi, lo).astype(np.uint8)
    code = np.where(np.isnan(q), np.uint8(0x7F), code)
    return (code | np.where(np.signbit(q), np.uint8(0x80), np.uint8(0))).astype(np.uint8)


def fp8_decode(codes: np.ndarray) -> np.ndarray:
    """The float32 values of float8_e4m3fn bit patterns (uint8)."""
    return FP8_VALUES[np.asarray(codes, dtype=np.uint8)]


@dataclass(frozen=True)
class BlockFormat:
    """An 8-bit block-quantized wire: ``wire`` (``"int8"`` or ``"fp8"``, float8 e4m3fn), values
    per ``block`` (the last block of a vector may be shorter) and the ``scale`` dtype of the one
    scale each block carries (``"fp32"``, ``"fp16"``, ``"bf16"``).

    The defaults, int8 in blocks of 64 values with a bfloat16 scale (1.03125 bytes per value),
    were chosen by measurement: docs/protocol.md, "8-bit wires", tabulates bytes and error of
    every block size and scale dtype on three inputs. bfloat16 scales cost 1% more error than
    float32 ones for half their bytes and keep float32's range (a float16 scale flushes blocks
    whose absmax is below about ``7.6e-6`` to zero); 64 is the largest block whose ring stays
    within 1.25x of the error of blocks of 32 with float32 scales on all three inputs.
    """

    wire: str = "int8"
    block: int = 64
    scale: str = "bf16"

    def __post_init__(self) -> None:
        check_choice("wire", self.wire, WIRES)
        check_int("block", self.block, minimum=1)
        check_choice("scale", self.scale, SCALE_DTYPES)

    @property
    def qmax(self) -> float:
        return QMAX[self.wire]

    @property
    def bytes_per_value(self) -> float:
        """Bytes on the wire per value: one code plus the block's scale shared by ``block`` values."""
        return 1.0 + SCALE_ITEMSIZE[self.scale] / self.block

    def blocks(self, m: int) -> int:
        """Blocks (and so scales) of a vector of ``m`` values."""
        return -(-int(m) // self.block)

    def describe(self) -> str:
        return f"{self.wire} in blocks of {self.block} with {self.scale} scales ({self.bytes_per_value:.4f} B/value)"


def _as_format(fmt: BlockFormat | None) -> BlockFormat:
    if fmt is None:
        return BlockFormat()
    if not isinstance(fmt, BlockFormat):
        raise TypeError(f"Argument 'fmt' must be a cerar BlockFormat, not {type(fmt).__name__}.")
    return fmt


def _padded_blocks(x: np.ndarray, fmt: BlockFormat) -> np.ndarray:
    """``(..., blocks, block)`` float32 view of ``x`` along its last axis, zero padded."""
    m = x.shape[-1]
    nb = fmt.blocks(m)
    if nb * fmt.block == m:
        return x.reshape(*x.shape[:-1], nb, fmt.block)
    padded = np.zeros((*x.shape[:-1], nb * fmt.block), dtype=np.float32)
    padded[..., :m] = x
    return padded.reshape(*x.shape[:-1], nb, fmt.block)


def quantize(x: np.ndarray, fmt: BlockFormat | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Quantize float32 ``x`` along its last axis (length ``m``) to ``fmt``.

    Returns ``(codes, scales)``: ``codes`` of ``x``'s shape (int8, or the uint8 bit patterns of
    float8_e4m3fn) and ``scales`` of shape ``(..., ceil(m / block))``, float32 values that the
    scale dtype represents exactly.
    """
    fmt = _as_format(fmt)
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0:
        raise ValueError("Argument 'x' must be a vector (at least 1-D), not a scalar.")
    m = x.shape[-1]
    blocks = _padded_blocks(x, fmt)
    qmax = np.float32(fmt.qmax)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        absmax = np.max(np.abs(blocks), axis=-1)  # NaN propagates
        scales = absmax / qmax
        if fmt.scale == "fp16":
            scales = scales.astype(np.float16).astype(np.float32)
        elif fmt.scale == "bf16":
            scales = rounder("bf16")(scales)
        usable = np.isfinite(scales) & (scales != 0)
        q = blocks / np.where(usable, scales, np.float32(1))[..., None]
        q = np.clip(q, -qmax, qmax)
        q = np.where(usable[..., None], q, np.float32(0)).astype(np.float32)
    q = q.reshape(*x.shape[:-1], -1)[..., :m]
    if fmt.wire == "int8":
        codes = np.rint(q).astype(np.int8)
    else:
        codes = fp8_encode(q)
    return codes, scales.astype(np.float32)


def dequantize(codes: np.ndarray, scales: np.ndarray, fmt: BlockFormat | None, m: int) -> np.ndarray:
    """The float32 values of ``codes`` (length ``m`` along the last axis) and their block ``scales``:
    ``float32(q) * s``. A block with a non-finite scale comes back NaN."""
    fmt = _as_format(fmt)
    m = check_int("m", m, minimum=1)
    codes = np.asarray(codes)
    if codes.shape[-1] != m:
        raise ValueError(f"Argument 'codes' must hold m={m} values along its last axis, not {codes.shape[-1]}.")
    nb = fmt.blocks(m)
    scales = np.asarray(scales, dtype=np.float32)
    if scales.shape[-1] != nb:
        raise ValueError(f"Argument 'scales' must hold {nb} blocks along its last axis, not {scales.shape[-1]}.")
    q = codes.astype(np.float32) if fmt.wire == "int8" else fp8_decode(codes)
    per_value = np.repeat(scales, fmt.block, axis=-1)[..., :m]
    with np.errstate(invalid="ignore"):
        return (q * per_value).astype(np.float32)


def round_trip(x: np.ndarray, fmt: BlockFormat | None = None) -> np.ndarray:
    """``dequantize(*quantize(x, fmt), fmt, m)``: what the receiver of ``x`` sees."""
    x = np.asarray(x, dtype=np.float32)
    codes, scales = quantize(x, fmt)
    return dequantize(codes, scales, fmt, x.shape[-1])


def ring_error_bound(world_size: int, fmt: BlockFormat | None = None) -> float:
    """The predicted worst-rank relative error of the 8-bit ring on i.i.d. inputs.

    The ring rounds ``N`` times: at reduce-scatter hop ``k = 1 .. N-1`` the partial sum of ``k``
    inputs it sends, then the owner's full sum of ``N`` (the all-gather forwards that packet
    unchanged, so every rank has the same values). For i.i.d. inputs of variance ``sigma^2`` the
    partial sum of ``k`` has variance ``k sigma^2``; the roundings are independent.

    * int8: a value is rounded to a multiple of the block's scale ``s = absmax / 127``, an error
      within ``s/2``, uniform, of variance ``s^2 / 12``. The absmax of a block of ``B`` Gaussian
      values of standard deviation ``sigma_k`` is about ``sqrt(2 ln(2B)) sigma_k`` (the ``1/(2B)``
      upper quantile of ``|x|``; the measured mean is 10-15% lower). Summing ``k = 1 .. N``:
      variance ``sigma^2 a_B^2 N (N+1) / (24 * 127^2)`` against the sum's ``N sigma^2``, so

          err = (1 + u_s) a_B / 127 * sqrt((N + 1) / 24),   a_B = sqrt(2 ln(2B)),

      ``u_s`` the scale dtype's unit roundoff (a rounded scale is at most that much coarser).
    * fp8 (e4m3, 3 mantissa bits): the block scale only sets the range; a value of magnitude
      in ``[2^e, 2^(e+1))`` is rounded to a multiple of ``2^(e-3)``, an error of relative variance
      at most ``2^-6 / 12`` (uniform within the spacing, the value at least ``2^e``). Summing as
      above, ``err = 2^-3 / sqrt(12) * sqrt((N + 1) / 2)``, the float rings' ``u sqrt((N+1)/2)``
      with ``u = 2^-3 / sqrt(12)``; values are 1.0-1.9x their spacing's lower end, so the mean is
      about ``0.74`` of this (``sqrt(E[1/m^2])`` for a mantissa ``m`` log-uniform on ``[1, 2)``).
      Block sizes barely matter (the scaled block's smallest values reach the subnormals only
      below ``2^-6``, ``1/(448 * 64)`` of the absmax).

    Checked against :func:`cerar.protocol.simulate_ring.simulate_ring` on Gaussian inputs at
    ``N = 4, 8, 16`` and ``B = 32 .. 1024``: the simulated error is 0.8-0.9x the bound for int8,
    0.65-0.75x for fp8. Heavy-tailed inputs exceed the int8 bound (Student-t(3): 1.2x at ``B = 32``,
    2.6x at 1024), their blocks' absmax being further out (docs/protocol.md, "8-bit wires").
    """
    n = check_int("world_size", world_size, minimum=2)
    fmt = _as_format(fmt)
    if fmt.wire == "fp8":
        return 2.0**-3 / math.sqrt(12.0) * math.sqrt((n + 1) / 2)
    a_b = math.sqrt(2.0 * math.log(2.0 * fmt.block))
    return (1.0 + SCALE_ROUNDOFF[fmt.scale]) * a_b / fmt.qmax * math.sqrt((n + 1) / 24.0)
