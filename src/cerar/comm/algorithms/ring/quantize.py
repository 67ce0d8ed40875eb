"""The block-quantized ring's quantization (int8, float8 e4m3fn, packed int4, int3 and int2) as torch
ops: CPU and CUDA alike, no host synchronisation.

The format (:class:`cerar.coding.blocks.BlockFormat`, whose numpy functions are the reference these
ops match bit for bit): values in blocks of ``fmt.block`` (the last block of a piece may
be shorter, as if zero padded). Per block, ``absmax = max|x|`` (float32), ``s = absmax / QMAX``
(127 for int8, 448 for float8 e4m3fn, 7, 3, 1 for int4, int3, int2) in float32, rounded to the scale
type ``fmt.scale`` (``"fp32"``, ``"fp16"`` or ``"bf16"``, to nearest even) and used as that value;
codes ``q = x / s`` (a division), clamped to ``[-QMAX, QMAX]``, rounded half to even to the integer
wires or to nearest even to e4m3fn; a block whose ``s`` is 0 or not finite gets codes 0. Dequantized,
``q * s``: a block with a NaN or Inf scale (a NaN or Inf among its values, or a magnitude beyond
the scale type's range) is NaN, and an all-zero block is 0.

A packet (a piece of a chunk on the wire) is one uint8 buffer: the ``nb`` scales, in the scale
type's bytes, followed by the ``m`` codes, one byte each (e4m3fn as its bit pattern), or for the
``b``-bit wires (int4, int3, int2) packed as a little-endian bit stream of ``b``-bit two's
complement fields (:func:`cerar.coding.blocks.pack_codes`: int4 two a byte, value ``2i`` in the low
nibble; int3 eight in three bytes; int2 four a byte), the last byte's unused bits 0; a block is a
whole number of bytes of codes (:class:`BlockFormat` checks), so each block starts on a whole byte:
Gloo sends it as bytes. :func:`packet_bytes` is its size. The narrow codes are packed and
unpacked with integer tensor ops (``&``, ``|``, shifts, ``(f ^ h) - h`` for the sign, ``h = 2^(b-1)``)
over groups of codes that fill whole bytes (2 int4 codes in a byte, 8 int3 codes in 3, 4 int2 codes
in 1), which run alike on every device.

The functions here work on any device: the block arithmetic is reshaped into ``(blocks, B)``
tensors (the short last block as a second, one-row call), and nothing reads a value back to the
host, so on CUDA a ring's rounds queue their kernels without waiting. Divisions are divisions
(by a tensor: on CUDA, a division by a host scalar becomes a multiplication by its reciprocal),
and a dequantized value is rounded before it is added, so that these ops, the compiled ones
(:func:`cerar.comm.algorithms.native.quant_kernels`) and the numpy reference agree bit for bit (up
to the payload of NaNs: a block that dequantizes to NaN is NaN in each, with its own bits).
"""

from __future__ import annotations

import math

import torch

from cerar.coding.blocks import CODE_BITS, QMAX, SCALE_DTYPES, SCALE_ITEMSIZE, WIRES, BlockFormat
from cerar.comm.runtime.dtypes import DTYPES

__all__ = [
    "BlockFormat", "dequant_add_requant", "dequantize_add_", "dequantize_into", "packet_bytes", "qmax", "quantize_into",
    "scale_dtype", "wire_dtype",
]  # fmt: skip


def wire_dtype(fmt: BlockFormat) -> torch.dtype:
    """The torch dtype of the packet's code bytes: ``torch.int8``, ``torch.float8_e4m3fn``, or
    ``torch.uint8`` for the packed int4, int3 and int2 codes."""
    if fmt.wire not in WIRES:
        raise ValueError(f"Argument 'wire' must be one of {sorted(WIRES)}, not {fmt.wire!r}.")
    # Codes narrower than a byte have no torch dtype: they travel packed, in uint8 bytes.
    return torch.uint8 if CODE_BITS[fmt.wire] < 8 else DTYPES[fmt.wire]


def scale_dtype(fmt: BlockFormat) -> torch.dtype:
    """The scales' torch dtype on the wire."""
    scale = str(fmt.scale)
    if scale not in SCALE_DTYPES:
        raise ValueError(f"Argument 'scale' must be one of {sorted(SCALE_DTYPES)}, not {fmt.scale!r}.")
    return DTYPES[scale]


def qmax(fmt: BlockFormat) -> float:
    """The largest code's magnitude: 127 (int8), 448 (float8 e4m3fn), 7 (int4), 3 (int3) or 1 (int2)."""
    wire_dtype(fmt)  # the wire's name checked
    return QMAX[fmt.wire]


def packet_bytes(values: int, fmt: BlockFormat) -> int:
    """The bytes of the packet of ``values`` values: ``ceil(values / B)`` scales, then the codes
    (``values`` bytes, or ``ceil(values b / 8)`` packed, ``b`` bits a code)."""
    return math.ceil(values / fmt.block) * SCALE_ITEMSIZE[fmt.scale] + fmt.code_bytes(values)


def _parts(values: int, fmt: BlockFormat) -> list[tuple[int, int, int]]:
    """``(first value, blocks, width)`` of the whole blocks and of the short last one (if any)."""
    full, rest = divmod(values, fmt.block)
    parts = [(0, full, fmt.block)] if full else []
    if rest:
        parts.append((full * fmt.block, 1, rest))
    return parts


def _scales(packet: torch.Tensor, values: int, fmt: BlockFormat) -> torch.Tensor:
    """The packet's scales as float32 (a view where the bytes are aligned, else a copy)."""
    dtype = scale_dtype(fmt)
    size = SCALE_ITEMSIZE[fmt.scale]
    raw = packet[: math.ceil(values / fmt.block) * size]
    if raw.data_ptr() % size:
        raw = raw.clone()
    return raw.view(dtype).float()


def _codes(packet: torch.Tensor, values: int, fmt: BlockFormat) -> torch.Tensor:
    """The packet's code bytes, as the wire's dtype (a view; int4, int3, int2: the packed uint8 bytes)."""
    start = math.ceil(values / fmt.block) * SCALE_ITEMSIZE[fmt.scale]
    return packet[start : start + fmt.code_bytes(values)].view(wire_dtype(fmt))


def _group(bits: int) -> tuple[int, int, torch.dtype]:
    """``(codes, bytes, word)`` of the fewest ``bits``-bit codes that fill whole bytes (``(2, 1)``
    for int4, ``(8, 3)`` for int3, ``(4, 1)`` for int2) and the integer dtype that holds them."""
    codes = 8 // math.gcd(bits, 8)
    nbytes = codes * bits // 8
    word = torch.int16 if nbytes == 1 else torch.int32 if nbytes <= 3 else torch.int64
    return codes, nbytes, word


def _pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """The 1-d integral-valued float codes ``q`` (within ``bits``-bit two's complement) packed as
    :func:`cerar.coding.blocks.pack_codes` packs them (uint8, ``ceil(len bits / 8)``): each group of
    codes that fills whole bytes gathered into one integer word (code ``j`` of the group at bit
    ``bits j``), the word cut into its bytes, low byte first; a length that does not fill its last
    group padded with 0 codes, and the bytes past ``ceil(len bits / 8)`` dropped."""
    count = q.numel()
    per, nbytes, word = _group(bits)
    fields = q.to(word) & ((1 << bits) - 1)
    if count % per:
        fields = torch.cat([fields, fields.new_zeros(per - count % per)])
    fields = fields.view(-1, per)
    packed = fields[:, 0]
    for j in range(1, per):
        packed = packed | (fields[:, j] << (bits * j))
    if nbytes > 1:
        packed = torch.stack([(packed >> (8 * k)) & 0xFF for k in range(nbytes)], dim=1).view(-1)
    return packed[: -(-count * bits // 8)].to(torch.uint8)


def _unpack_codes(packed: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    """The first ``count`` codes of the packed uint8 bytes, as float32: each group's bytes read as
    one integer word (low byte first), field ``j`` at bit ``bits j``; a field ``f`` is the two's
    complement value ``(f ^ h) - h``, ``h = 2^(bits - 1)``."""
    per, nbytes, word = _group(bits)
    b = packed.to(word)
    if b.numel() % nbytes:
        b = torch.cat([b, b.new_zeros(nbytes - b.numel() % nbytes)])
    if nbytes > 1:
        rows = b.view(-1, nbytes)
        b = rows[:, 0]
        for k in range(1, nbytes):
            b = b | (rows[:, k] << (8 * k))
    mask, half = (1 << bits) - 1, 1 << (bits - 1)
    codes = torch.stack([(((b >> (bits * j)) & mask) ^ half) - half for j in range(per)], dim=1).view(-1)
    return codes[:count].float()


def _code_values(codes: torch.Tensor, first: int, count: int, fmt: BlockFormat) -> torch.Tensor:
    """The ``count`` codes from value ``first`` (a block's start: a whole byte into packed codes) as float32."""
    bits = fmt.code_bits
    if bits < 8:
        start = first * bits // 8
        return _unpack_codes(codes[start : start + fmt.code_bytes(count)], count, bits)
    return codes[first : first + count].float()


def _limit(fmt: BlockFormat, device: torch.device) -> torch.Tensor:
    """QMAX as a 0-d tensor on ``device``: divided by, not multiplied by its reciprocal."""
    return torch.full((), qmax(fmt), dtype=torch.float32, device=device)


def quantize_into(x: torch.Tensor, packet: torch.Tensor, fmt: BlockFormat) -> None:
    """``packet`` (uint8, :func:`packet_bytes` of ``x.numel()``) = the 1-d float32 ``x`` quantized."""
    m = x.numel()
    nb = math.ceil(m / fmt.block)
    dtype = scale_dtype(fmt)
    size = SCALE_ITEMSIZE[fmt.scale]
    scales = torch.empty(nb, dtype=dtype, device=x.device)
    codes = packet[nb * size : nb * size + fmt.code_bytes(m)]
    limit, top = _limit(fmt, x.device), qmax(fmt)
    wire = wire_dtype(fmt)
    for first, blocks, width in _parts(m, fmt):
        rows = x[first : first + blocks * width].view(blocks, width)
        s = torch.div(rows.abs().amax(dim=1), limit)  # amax: NaN if the block holds one
        if dtype != torch.float32:
            s = s.to(dtype)
        scales[first // fmt.block : first // fmt.block + blocks] = s
        s = s.float()
        valid = (torch.isfinite(s) & (s != 0)).unsqueeze(1)
        q = torch.div(rows, s.unsqueeze(1)).clamp_(-top, top)
        q = torch.where(valid, q, torch.zeros((), dtype=q.dtype, device=q.device))
        if wire != torch.float8_e4m3fn:
            q = q.round_()
        bits = fmt.code_bits
        if bits < 8:  # a block is whole bytes of codes: this part's codes start on a whole byte
            start = first * bits // 8
            codes[start : start + fmt.code_bytes(blocks * width)].copy_(_pack_codes(q.view(-1), bits))
        else:
            codes[first : first + blocks * width].copy_(q.to(wire).view(torch.uint8).view(-1))
    packet[: nb * size].copy_(scales.view(torch.uint8))


def _dequantize(packet: torch.Tensor, values: int, fmt: BlockFormat) -> list[tuple[int, int, torch.Tensor]]:
    """``(first value, values, dequantized (blocks, width))`` per part of the packet."""
    scales, codes = _scales(packet, values, fmt), _codes(packet, values, fmt)
    parts = []
    for first, blocks, width in _parts(values, fmt):
        b = first // fmt.block
        q = _code_values(codes, first, blocks * width, fmt).view(blocks, width)
        parts.append((first, blocks * width, q * scales[b : b + blocks].unsqueeze(1)))
    return parts


def dequantize_into(out: torch.Tensor, packet: torch.Tensor, fmt: BlockFormat) -> None:
    """The 1-d float32 ``out`` = ``packet``'s values."""
    for first, count, values in _dequantize(packet, out.numel(), fmt):
        out[first : first + count].copy_(values.view(-1))


def dequantize_add_(acc: torch.Tensor, packet: torch.Tensor, fmt: BlockFormat) -> None:
    """``acc += packet``'s values (1-d float32; each product rounded, then added)."""
    for first, count, values in _dequantize(packet, acc.numel(), fmt):
        acc[first : first + count].add_(values.view(-1))


def dequant_add_requant(
    own: torch.Tensor, arrived: torch.Tensor, out: torch.Tensor, fmt: BlockFormat, keep: bool = False
) -> None:
    """A reduce-scatter hop: ``own += arrived``'s values (the float32 partial sum, in place),
    ``out`` = ``own`` quantized, and with ``keep``, ``own`` = ``out``'s values (the owner of a
    chunk keeps what it sends, so that every rank ends with the same values)."""
    dequantize_add_(own, arrived, fmt)
    quantize_into(own, out, fmt)
    if keep:
        dequantize_into(own, out, fmt)
