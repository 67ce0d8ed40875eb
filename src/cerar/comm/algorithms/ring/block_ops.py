"""The block wires' kernels as a ring uses them (:class:`QuantOps`: quantize, dequantize,
dequantize-add-requantize), compiled or torch ops, and how a chunk is cut into pieces of whole
blocks (:func:`quant_pieces`). The ring itself is :func:`cerar.comm.algorithms.ring.program.run_ring`
with a :class:`cerar.comm.algorithms.ring.wires.BlockWire`.

The compiled kernels (:func:`cerar.comm.algorithms.native.quant_kernels`) run for float32 on the
CPU on the int8, fp8 and int4 wires; elsewhere (int3 and int2 everywhere) the torch ops of
:mod:`cerar.comm.algorithms.ring.quantize`, which on CUDA queue their kernels without a host
synchronisation inside the rounds.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from cerar.coding.blocks import SCALE_ITEMSIZE, BlockFormat
from cerar.comm.algorithms import native
from cerar.comm.algorithms.ring.quantize import (
    dequant_add_requant,
    dequantize_add_,
    dequantize_into,
    packet_bytes,
    quantize_into,
)
from cerar.comm.runtime.engine import segments

__all__ = ["QuantOps", "TorchQuantOps", "quant_ops", "quant_pieces"]

_ALIGN = 16  # bytes between the starts of a round's packets in its buffer


class QuantOps(Protocol):
    """The 8-bit coding a run uses: :class:`cerar.comm.algorithms.native.QuantKernels` or
    :class:`TorchQuantOps` (the same bits)."""

    def quantize(self, x: torch.Tensor, packet: torch.Tensor) -> None: ...
    def dequantize(self, packet: torch.Tensor, out: torch.Tensor, accumulate: bool = False) -> None: ...
    def dequant_add_requant(self, own: torch.Tensor, arrived: torch.Tensor, out: torch.Tensor, keep: bool) -> None: ...


class TorchQuantOps:
    """:mod:`cerar.comm.algorithms.ring.quantize`'s torch ops for one format, as :class:`QuantOps`."""

    __slots__ = ("fmt",)

    def __init__(self, fmt: BlockFormat) -> None:
        self.fmt = fmt

    def quantize(self, x: torch.Tensor, packet: torch.Tensor) -> None:
        quantize_into(x, packet, self.fmt)

    def dequantize(self, packet: torch.Tensor, out: torch.Tensor, accumulate: bool = False) -> None:
        (dequantize_add_ if accumulate else dequantize_into)(out, packet, self.fmt)

    def dequant_add_requant(self, own: torch.Tensor, arrived: torch.Tensor, out: torch.Tensor, keep: bool) -> None:
        dequant_add_requant(own, arrived, out, self.fmt, keep=keep)


def quant_ops(fmt: BlockFormat, data: torch.dtype, device: torch.device) -> QuantOps:
    """The compiled kernels where they apply (float32 on the CPU, the int8, fp8 or int4 wire,
    ``CERAR_NATIVE`` not 0, a compiler), else the torch ops."""
    compiled = native.quant_kernels(fmt.wire, fmt.scale, fmt.block, data, device)
    return compiled if compiled is not None else TorchQuantOps(fmt)


def quant_pieces(chunk: int, fmt: BlockFormat) -> list[tuple[int, int, int, int]]:
    """The pieces of a chunk of ``chunk`` values: ``(first value, end, packet offset, packet bytes)``,
    whole blocks each (the chunk's last block may be shorter), about 256 KiB of packet apiece
    (:func:`cerar.comm.runtime.engine.segments`), the packets ``_ALIGN``-aligned in a round's buffer.
    Each piece is its own packet, its scales then its codes; a block of packed codes fills whole
    bytes (:class:`BlockFormat` refuses an int4 block that is odd, an int3 one not a multiple of
    8, an int2 one not a multiple of 4), so a piece's first value, a block's start, is a whole byte
    into the chunk's codes and only the chunk's last piece can end on pad bits."""
    blocks = math.ceil(chunk / fmt.block)
    pieces, offset = [], 0
    for first, end in segments(blocks, fmt.code_bytes(fmt.block) + SCALE_ITEMSIZE[fmt.scale]):
        a, b = first * fmt.block, min(end * fmt.block, chunk)
        size = packet_bytes(b - a, fmt)
        pieces.append((a, b, offset, size))
        offset += -(-size // _ALIGN) * _ALIGN
    return pieces
