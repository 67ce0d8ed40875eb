"""Block-quantized packets (8-bit int8 and float8 e4m3fn, 4-bit int4, 3-bit int3, 2-bit int2): the numpy
reference of the format.

A float32 vector of ``m`` values travels as ``m`` codes and one scale per block of ``block``
values (the last block shorter; it is computed as if zero padded, and the pad is not sent), so a
value costs ``code_bits / 8 + scale_itemsize / block`` bytes: ``1 + 2/64`` for int8 in blocks of
64 with bfloat16 scales, ``0.5 + 2/block`` for int4 (``0.375 + 2/block`` for int3, ``0.25 + 2/block``
for int2). Per block:

1. ``absmax = max |x|`` in float32;
2. ``s = float32(absmax) / float32(QMAX)`` (a float32 division), rounded to the scale dtype with
   round-to-nearest-even (fp16 through numpy's float16, bf16 through
   :func:`cerar.coding.precision.rounder`) and kept as a float32 value;
3. ``q = x / s`` in float32, clamped to ``[-QMAX, QMAX]``, then rounded: the integer wires to
   the nearest integer, ties to even (``np.rint``); ``fp8`` to the nearest float8_e4m3fn value,
   ties to even (:func:`fp8_encode`); a block whose ``s`` is 0 or not finite gets ``q = 0``;
4. dequantized as ``float32(q) * s`` (a float32 multiply).

Codes on the wire: one byte each for int8 (two's complement) and fp8 (the e4m3fn bit pattern).
The narrower integer codes travel packed (:func:`pack_codes`), ``b`` bits each as a
little-endian bit stream: code ``i`` is the ``b``-bit two's complement field at bits
``b i .. b i + b - 1`` of the stream, stream bit ``k`` being bit ``k mod 8`` of byte ``k // 8``, and
the last byte's unused bits are 0. So int4 codes (``QMAX = 7``, so ``-8`` never occurs) go two a
byte, value ``2i`` in the low nibble and ``2i + 1`` in the high one (:func:`pack_int4`); int3 codes
(``QMAX = 3``) eight in three bytes; int2 codes (``QMAX = 1``: ternary, the pattern ``10`` never
occurs) four a byte, value ``4i`` in the lowest two bits. A block must hold a whole number of
bytes' worth of codes, an even number of values for int4, a multiple of 8 for int3 and of 4 for
int2, so that every block's codes start on a whole byte and a packet is the per-block codes laid
end to end: the compiled kernels (int8, fp8 and int4 only) then quantize and dequantize a block at
a time. :func:`quantize` returns the narrow codes unpacked (int8 values in ``[-QMAX, QMAX]``);
:func:`code_bytes` gives the bytes that travel.

A non-finite input makes its block's ``absmax`` and so its scale non-finite, and the block
dequantizes to NaN (``0 * inf`` and ``0 * nan``): non-finite input spreads to its block, no further.
A block of zeros has ``s = 0`` and dequantizes to zeros.

**The format's own range** is the scale dtype's, shifted by ``QMAX``. A block round-trips with
the full precision of its codes only while its scale ``absmax / QMAX`` is a normal number of the
scale dtype; below that the scale is subnormal and has fewer significant bits (its relative
rounding grows towards 1 and the block errs in proportion, since the clamp then cuts the largest
values), and below half the smallest subnormal it rounds to 0 and the block comes back zero:

========  ==========================  ==================================  ================================
scale     full precision while        scale subnormal (coarse) below      block returns zeros below
========  ==========================  ==================================  ================================
fp32      ``absmax >= QMAX 1.2e-38``  ``QMAX 1.2e-38`` (23 bits to lose)  ``absmax < QMAX 7e-46``
bf16      ``absmax >= QMAX 1.2e-38``  ``QMAX 1.2e-38``                    ``absmax < QMAX 4.6e-41``
fp16      ``absmax >= QMAX 6.1e-5``   ``QMAX 6.1e-5``                     ``absmax < QMAX 3.0e-8``
========  ==========================  ==================================  ================================

(``QMAX`` is 127, 448, 7, 3 or 1.) So bfloat16 scales do *not* have float32's whole range. Measured
on Gaussian blocks of 64 with bfloat16 scales, against the same blocks at absmax 1: int8's
error is 2.5x near absmax ``1e-37``, up to 26x (15% relative) near ``1.7e-38``, and a block below
about ``5.8e-39`` comes back zero; int4's is 1.3x near ``1e-39`` and a block below about
``3.2e-40`` comes back zero. float16 scales flush int8 blocks below about ``3.8e-6`` and
overflow (NaN) above ``absmax / QMAX > 65504``. The format's own range is what it is and it
rescales nothing: the ring call pre-scales the whole tensor by a power of two, from the largest
magnitude every rank agrees on, so that the tensor's largest block maps near 1 and
gradient-sized blocks stay far inside the normal range.

**Constant blocks are biased by the scale's rounding.** A block whose values all equal its absmax
``a`` has ``s = round(a / QMAX)``; when the scale rounds down, ``a / s > QMAX`` is clamped to
``QMAX`` and the block returns ``QMAX s < a``; when it rounds up, ``a / s`` rounds back to
``QMAX`` and the block returns ``QMAX s > a``. Either way each value carries the scale's relative
rounding, the same sign throughout the block and at every rank that sends the same values: all
ones summed by the int8 ring over ``N = 3`` ranks with bfloat16 scales give 3.0076, not 3 (the
int4 ring in blocks of 32: 2.9941). The
error is within the scale dtype's unit roundoff per rounding, a property of rounding the scale,
not of the codes.

The torch and compiled kernels are tested bitwise against this module. Pure numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from cerar._checks import check_choice, check_int
from cerar.coding.precision import rounder

__all__ = [
    "CODE_BITS",
    "DEFAULT_BLOCK",
    "QMAX",
    "SCALE_DTYPES",
    "WIRES",
    "BlockFormat",
    "code_bytes",
    "dequantize",
    "direct_round_trip",
    "fp8_decode",
    "fp8_encode",
    "pack_codes",
    "pack_int4",
    "quantize",
    "ring_error_bound",
    "round_trip",
    "unpack_codes",
    "unpack_int4",
]

#: The block-quantized wire formats: 8-bit int8 and float8 e4m3fn, 4-bit int4, 3-bit int3, 2-bit int2.
WIRES: tuple[str, ...] = ("int8", "fp8", "int4", "int3", "int2")
#: The largest magnitude of each wire's codes: a block's absmax maps onto it.
QMAX: dict[str, float] = {"int8": 127.0, "fp8": 448.0, "int4": 7.0, "int3": 3.0, "int2": 1.0}
#: Bits per code on the wire.
CODE_BITS: dict[str, int] = {"int8": 8, "fp8": 8, "int4": 4, "int3": 3, "int2": 2}
#: Each wire's default block size, chosen by measurement (:class:`BlockFormat`'s docstring).
DEFAULT_BLOCK: dict[str, int] = {"int8": 64, "fp8": 64, "int4": 32, "int3": 64, "int2": 128}
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
    """A block-quantized wire: ``wire`` (``"int8"``, ``"fp8"``, float8 e4m3fn, ``"int4"``, ``"int3"``
    or ``"int2"``), values per ``block`` (the last block of a vector may be shorter; a whole
    number of bytes of codes, so that every block starts on a whole byte: even for int4, a multiple
    of 8 for int3, of 4 for int2; default: the wire's :data:`DEFAULT_BLOCK`) and the ``scale``
    dtype of the one scale each block carries (``"fp32"``, ``"fp16"``, ``"bf16"``).

    The defaults were chosen by measurement: docs/protocol.md, "8-bit wires", tabulates bytes and
    error of every block size and scale dtype on three inputs (i.i.d. Gaussian, Student-t(3),
    per-layer-scaled).

    * int8 (and fp8) in blocks of 64 with a bfloat16 scale (1.03125 bytes per value): bfloat16
      scales cost 1% more error than float32 ones for half their bytes and a far wider range than
      float16's (which flushes int8 blocks whose absmax is below about ``3.8e-6`` to zero); 64 is
      the largest block whose ring stays within 1.25x of the error of blocks of 32 with float32
      scales on all three inputs.
    * int4 in blocks of 32 with a bfloat16 scale (0.5625 bytes per value): the largest block
      each of whose doublings still pays on all three inputs at ``N = 4`` and 8, a doubling from
      ``B`` paying when the error it adds is below ``2^(8/B)``, what the ``1/B`` bytes per value
      it saves would buy as code bits (each bit halves a ring's error). 16 to 32 costs at most
      1.25x (Student-t(3)) against 1.41x; 32 to 64 costs 1.23x and 1.20x on Student-t(3) against
      1.19x. (Transposed as it stands, int8's rule, 1.25x of the smallest block, would pick
      blocks of 8 at 0.75 bytes per value, giving back half of int4's saving over int8.)
    * int3 in blocks of 64 and int2 in blocks of 128, bfloat16 scales (0.40625 and 0.265625 bytes
      per value), by int4's rule over ``B = 8 .. 128`` (``block_table(wires=("int3", "int2"))``,
      ``N = 4`` and 8; the scale dtypes' errors agree within 0.1%): int3's 32 to 64 costs at most
      1.18x (Student-t(3), ``N = 4``) against 1.19x, 64 to 128 1.16x against 1.09x; every int2
      doubling up to 128 pays (64 to 128: at most 1.04x against 1.09x), its error saturating: the
      int2 ring errs 1.29 at ``N = 4`` on Gaussian inputs (int3's 0.41, int4's 0.15), more than
      the sum's own norm, a wire for error feedback (:class:`cerar.ErrorFeedback`) only.
    """

    wire: str = "int8"
    block: int | None = None
    scale: str = "bf16"

    def __post_init__(self) -> None:
        check_choice("wire", self.wire, WIRES)
        if self.block is None:
            object.__setattr__(self, "block", DEFAULT_BLOCK[self.wire])
        check_int("block", self.block, minimum=1)
        bits = CODE_BITS[self.wire]
        unit = _byte_unit(bits)
        if self.block % unit:
            multiple = "even" if unit == 2 else f"a multiple of {unit}"
            raise ValueError(
                f"Argument 'block' must be {multiple} for the {bits}-bit wire {self.wire!r} ({unit} codes in "
                f"{unit * bits // 8} byte{'s' if unit * bits > 8 else ''}, every block starting on a whole byte), "
                f"not {self.block}."
            )
        check_choice("scale", self.scale, SCALE_DTYPES)

    @property
    def qmax(self) -> float:
        return QMAX[self.wire]

    @property
    def code_bits(self) -> int:
        """Bits per code on the wire: 8, or 4, 3, 2 for int4, int3, int2."""
        return CODE_BITS[self.wire]

    @property
    def bytes_per_value(self) -> float:
        """Bytes on the wire per value: one code (a byte, or ``code_bits / 8`` of one) plus the
        block's scale shared by ``block`` values."""
        return self.code_bits / 8 + SCALE_ITEMSIZE[self.scale] / self.block

    def blocks(self, m: int) -> int:
        """Blocks (and so scales) of a vector of ``m`` values."""
        return -(-int(m) // self.block)

    def code_bytes(self, m: int) -> int:
        """Bytes of the codes of ``m`` values: ``m``, or ``ceil(m code_bits / 8)`` packed
        (``ceil(m / 2)`` for int4)."""
        return -(-int(m) * self.code_bits // 8)

    def describe(self) -> str:
        return f"{self.wire} in blocks of {self.block} with {self.scale} scales ({self.bytes_per_value:.4f} B/value)"


def _byte_unit(bits: int) -> int:
    """The fewest codes of ``bits`` bits that fill whole bytes: 1 for 8 bits, 2 for 4, 4 for 2, 8
    for 3. A block must be a multiple of it."""
    return 8 // math.gcd(bits, 8)


def _check_bits(bits: int) -> int:
    bits = check_int("bits", bits, minimum=1)
    if bits > 8:
        raise ValueError(f"Argument 'bits' must be at most 8, not {bits}.")
    return bits


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Integer codes (along the last axis, length ``m``, each within ``bits``-bit two's complement,
    ``[-2^(bits-1), 2^(bits-1) - 1]``) as the ``ceil(m bits / 8)`` bytes that travel: a little-endian
    bit stream, code ``i`` at bits ``bits i .. bits i + bits - 1`` (stream bit ``k`` is bit
    ``k mod 8`` of byte ``k // 8``), the last byte's unused bits 0. For 4 bits: value ``2i`` in
    byte ``i``'s low nibble, ``2i + 1`` in its high nibble (:func:`pack_int4`)."""
    bits = _check_bits(bits)
    codes = np.asarray(codes)
    m = codes.shape[-1]
    fields = codes.astype(np.int8).view(np.uint8) & np.uint8((1 << bits) - 1)
    stream = np.unpackbits(fields[..., None], axis=-1, bitorder="little")[..., :bits]
    stream = stream.reshape(*codes.shape[:-1], m * bits)
    return np.packbits(stream, axis=-1, bitorder="little")  # pads the last byte with 0 bits


def unpack_codes(packed: np.ndarray, m: int, bits: int) -> np.ndarray:
    """The ``m`` codes (int8 values in ``[-2^(bits-1), 2^(bits-1) - 1]``) of :func:`pack_codes`'s
    bytes (``ceil(m bits / 8)`` of them along the last axis)."""
    m = check_int("m", m, minimum=0)
    bits = _check_bits(bits)
    packed = np.asarray(packed, dtype=np.uint8)
    need = -(-m * bits // 8)
    if packed.shape[-1] != need:
        raise ValueError(
            f"Argument 'packed' must hold ceil(m * {bits} / 8) = {need} bytes for m={m}, not {packed.shape[-1]}."
        )
    stream = np.unpackbits(packed, axis=-1, bitorder="little")[..., : m * bits]
    fields = np.packbits(stream.reshape(*packed.shape[:-1], m, bits), axis=-1, bitorder="little")[..., 0]
    half = np.int16(1 << (bits - 1))
    return ((fields.astype(np.int16) ^ half) - half).astype(np.int8)


def pack_int4(codes: np.ndarray) -> np.ndarray:
    """int4 codes (integers in ``[-8, 7]``, along the last axis, length ``m``) as the
    ``ceil(m / 2)`` bytes that travel: value ``2i`` in byte ``i``'s low nibble, ``2i + 1`` in its
    high nibble, two's complement; an odd ``m`` pads the last high nibble with 0.
    ``pack_codes(codes, 4)``."""
    return pack_codes(codes, 4)


def unpack_int4(packed: np.ndarray, m: int) -> np.ndarray:
    """The ``m`` int4 codes (int8 values in ``[-8, 7]``) of :func:`pack_int4`'s bytes:
    ``unpack_codes(packed, m, 4)``."""
    return unpack_codes(packed, m, 4)


def code_bytes(codes: np.ndarray, fmt: BlockFormat | None = None) -> np.ndarray:
    """The bytes (uint8) that carry :func:`quantize`'s ``codes`` on the wire: the int8 codes'
    two's complement bytes, the e4m3fn bit patterns, or the int4, int3 and int2 codes packed
    (:func:`pack_codes`). A packet is the scales (in the scale dtype's bytes) followed by these."""
    fmt = _as_format(fmt)
    codes = np.asarray(codes)
    if fmt.code_bits < 8:
        return pack_codes(codes, fmt.code_bits)
    return codes.astype(np.int8).view(np.uint8) if fmt.wire == "int8" else codes.astype(np.uint8)


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

    Returns ``(codes, scales)``: ``codes`` of ``x``'s shape (int8; for int4, int3 and int2 the
    unpacked codes in ``[-QMAX, QMAX]``, :func:`code_bytes` packs them; or the uint8 bit patterns
    of float8_e4m3fn) and
    ``scales`` of shape ``(..., ceil(m / block))``, float32 values that the scale dtype represents
    exactly.
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
    if fmt.wire != "fp8":  # the integer wires
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
    q = fp8_decode(codes) if fmt.wire == "fp8" else codes.astype(np.float32)
    per_value = np.repeat(scales, fmt.block, axis=-1)[..., :m]
    with np.errstate(invalid="ignore"):
        return (q * per_value).astype(np.float32)


def round_trip(x: np.ndarray, fmt: BlockFormat | None = None) -> np.ndarray:
    """``dequantize(*quantize(x, fmt), fmt, m)``: what the receiver of ``x`` sees (the narrow codes'
    packing loses nothing: they are dequantized unpacked)."""
    x = np.asarray(x, dtype=np.float32)
    codes, scales = quantize(x, fmt)
    return dequantize(codes, scales, fmt, x.shape[-1])


def ring_error_bound(world_size: int, fmt: BlockFormat | None = None, shape: str = "ring") -> float:
    """The predicted worst-rank relative error of a block ring (int8, fp8, int4, int3, int2) on i.i.d. inputs,
    relative to the root-sum-square of the ranks' inputs (the sum's norm for independent inputs);
    ``shape="direct"``: of the direct reduce-scatter (below).

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
    The same formula with ``QMAX = 3`` and 1 holds for int3 and int2 (their rounding is not
    uniform within ``s/2``, most ternary codes being 0, but its variance stays near ``s^2 / 12``):
    at their default blocks on Gaussian inputs at ``N = 4`` and 8 the simulated error is
    0.85-0.9x the bound for int3 and 0.85x for int2, ring and direct shapes (0.8-0.85x direct);
    Student-t(3) exceeds int3's by up to 1.16x (direct) as it does int4's.

    The direct shape (:func:`direct_round_trip`) rounds ``2N - 1`` inputs' worth instead of
    ``N (N + 1) / 2``: each of the ``N - 1`` other ranks' inputs once (the owner's own is summed
    unrounded) and the full sum once, so ``sqrt((N + 1) / 2)`` above becomes ``sqrt((2N - 1) / N)``:
    16% less error at ``N = 4``, half at ``N = 16``.
    """
    n = check_int("world_size", world_size, minimum=2)
    fmt = _as_format(fmt)
    check_choice("shape", shape, ("ring", "direct"))
    rounded = n * (n + 1) / 2 if shape == "ring" else 2 * n - 1  # inputs' variances rounded, summed
    if fmt.wire == "fp8":
        return 2.0**-3 / math.sqrt(12.0) * math.sqrt(rounded / n)
    a_b = math.sqrt(2.0 * math.log(2.0 * fmt.block))
    return (1.0 + SCALE_ROUNDOFF[fmt.scale]) * a_b / fmt.qmax * math.sqrt(rounded / (12.0 * n))


def direct_round_trip(inputs: np.ndarray, fmt: BlockFormat | None = None) -> np.ndarray:
    """The direct reduce-scatter's sum of the rows of ``inputs`` (``N x d``, float32), as every
    rank ends with it: the reference :func:`cerar.comm.algorithms.ring.direct.run_direct` is
    tested against. Chunk ``j`` (of ``ceil(d / N)`` values) is owned by rank ``j``: the other
    ranks' chunks are block-quantized once, summed in float32 in rank order with the owner's own
    unrounded, and the sum quantized once (the all-gather forwards that packet)."""
    fmt = _as_format(fmt)
    x = np.asarray(inputs, dtype=np.float32)
    n, d = x.shape
    chunk = -(-d // n)
    out = np.empty(d, dtype=np.float32)
    for j in range(n):
        a, b = j * chunk, min((j + 1) * chunk, d)
        if a >= b:
            continue
        total = x[j, a:b].copy()
        for i in range(1, n):
            total += round_trip(x[(j - i) % n, a:b], fmt)  # the owner adds peer j - 1, j - 2, ...
        out[a:b] = round_trip(total, fmt)
    return out
