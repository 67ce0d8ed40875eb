"""The block-quantized 8-bit ring all-reduce (int8 or float8 e4m3fn on the wire, one scale per block
of values: :class:`cerar.coding.blocks.BlockFormat`) on cerar's engine, as PRIME's and PCCL's
quantized rings and torchft's quantized all-reduce run over Gloo.

Reduce-scatter, then all-gather, as :func:`cerar.comm.kernels.ring_run.run_ring`: ``2 (N - 1)``
rounds, each chunk cut into pieces that hold whole blocks (a chunk's blocks start at the chunk;
its last block may be shorter) and pipelined by :func:`cerar.comm.ring.engine.run_program`. A
reduce-scatter hop dequantizes the packet that arrived, adds it to the rank's own float32 chunk
and quantizes that partial sum into the next packet, in one pass (the compiled
dequantize-add-requantize, or the torch ops). The owner of a fully reduced chunk quantizes it,
sends it and overwrites its own values with the dequantized packet; the all-gather forwards
each packet unchanged and writes its dequantized values. Every rank thus ends with bitwise the
same result, which :func:`cerar.protocol.simulate_ring.simulate_ring` computes step for step.

The compiled kernels (:func:`cerar.comm.kernels.native.quant_kernels`) run for float32 on the
CPU; elsewhere the torch ops of :mod:`cerar.comm.kernels.quantize`, which on CUDA queue their
kernels without a host synchronisation inside the rounds.
"""

from __future__ import annotations

import functools
import math
from typing import Protocol

import torch

from cerar.coding.blocks import SCALE_ITEMSIZE, BlockFormat
from cerar.comm.kernels import native
from cerar.comm.kernels.quantize import (
    dequant_add_requant,
    dequantize_add_,
    dequantize_into,
    packet_bytes,
    quantize_into,
)
from cerar.comm.kernels.workspace import WORKSPACE
from cerar.comm.ring.engine import Action, Piece, Program, run_program, segments
from cerar.comm.ring.links import Ring
from cerar.comm.ring.stats import CommStats

__all__ = ["QuantOps", "TorchQuantOps", "quant_ops", "quant_pieces", "run_quantized_ring"]

_ALIGN = 16  # bytes between the starts of a round's packets in its buffer


class QuantOps(Protocol):
    """The 8-bit coding a run uses: :class:`cerar.comm.kernels.native.QuantKernels` or
    :class:`TorchQuantOps` (the same bits)."""

    def quantize(self, x: torch.Tensor, packet: torch.Tensor) -> None: ...
    def dequantize(self, packet: torch.Tensor, out: torch.Tensor, accumulate: bool = False) -> None: ...
    def dequant_add_requant(self, own: torch.Tensor, arrived: torch.Tensor, out: torch.Tensor, keep: bool) -> None: ...


class TorchQuantOps:
    """:mod:`cerar.comm.kernels.quantize`'s torch ops for one format, as :class:`QuantOps`."""

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
    """The compiled kernels where they apply (float32 on the CPU, ``CERAR_NATIVE`` not 0, a
    compiler), else the torch ops."""
    compiled = native.quant_kernels(fmt.wire, fmt.scale, fmt.block, data, device)
    return compiled if compiled is not None else TorchQuantOps(fmt)


def quant_pieces(chunk: int, fmt: BlockFormat) -> list[tuple[int, int, int, int]]:
    """The pieces of a chunk of ``chunk`` values: ``(first value, end, packet offset, packet bytes)``,
    whole blocks each (the chunk's last block may be shorter), about 256 KiB of packet apiece
    (:func:`cerar.comm.ring.engine.segments`), the packets ``_ALIGN``-aligned in a round's buffer.
    Each piece is its own packet, its scales then its codes; an int4 block is even
    (:class:`BlockFormat` refuses an odd one), so a piece's first value, a block's start, is a
    whole byte into the chunk's codes and only the chunk's last piece can end on a pad nibble."""
    blocks = math.ceil(chunk / fmt.block)
    pieces, offset = [], 0
    for first, end in segments(blocks, fmt.code_bytes(fmt.block) + SCALE_ITEMSIZE[fmt.scale]):
        a, b = first * fmt.block, min(end * fmt.block, chunk)
        size = packet_bytes(b - a, fmt)
        pieces.append((a, b, offset, size))
        offset += -(-size // _ALIGN) * _ALIGN
    return pieces


def run_quantized_ring(flat: torch.Tensor, ring: Ring, stats: CommStats, fmt: BlockFormat) -> torch.Tensor:
    """The 8-bit ring all-reduce (sum) of the contiguous 1-d float32 ``flat``, in place; bytes and
    rounds counted in ``stats`` at the transport, as :func:`cerar.comm.ring.engine.run_program`
    counts them."""
    if flat.dtype != torch.float32 or flat.dim() != 1 or not flat.is_contiguous():
        shape = tuple(flat.shape)
        raise ValueError(f"Argument 'flat' must be a contiguous 1-d float32 tensor, not {flat.dtype} of shape {shape}.")
    n, d = ring.size, flat.numel()
    chunk = math.ceil(d / n)
    padded = WORKSPACE.padded("ring_padded", flat, n * chunk)
    chunks = padded.view(n, chunk)
    layout = quant_pieces(chunk, fmt)
    stride = layout[-1][2] + layout[-1][3] if layout else 0
    send = WORKSPACE.get("quant_send", (2, stride), torch.uint8, flat.device)
    recv = WORKSPACE.get("quant_recv", (2, stride), torch.uint8, flat.device)
    ops = quant_ops(fmt, flat.dtype, flat.device)
    r = ring.rank
    owned = (r + 1) % n  # fully reduced here after the reduce-scatter
    rounds = []
    for t in range(1, 2 * (n - 1) + 1):
        pieces = []
        for a, b, offset, size in layout:
            out, arrived = send[t % 2, offset : offset + size], recv[t % 2, offset : offset + size]
            before = recv[(t - 1) % 2, offset : offset + size]  # what round t - 1 brought
            prepare: Action
            if t == 1:  # this rank's own chunk
                prepare = functools.partial(ops.quantize, chunks[r, a:b], out)
            elif t < n:  # the partial sum: what arrived plus this rank's chunk, requantized
                prepare = functools.partial(ops.dequant_add_requant, chunks[(r - t + 1) % n, a:b], before, out, False)
            elif t == n:  # the full sum, requantized: the owner keeps what it sends
                prepare = functools.partial(ops.dequant_add_requant, chunks[owned, a:b], before, out, True)
            else:  # the all-gather forwards the packet unchanged
                prepare = functools.partial(out.copy_, before)
            landed: Action | None = None
            if t >= n:  # the owner's values, off the critical path (while the next round is on the wire)
                landed = functools.partial(ops.dequantize, arrived, chunks[(r - (t - n)) % n, a:b])
            pieces.append(Piece(out, arrived, prepare, None, landed))
        rounds.append(pieces)
    run_program(ring, stats, Program(rounds, flat.device))
    if padded is not flat:
        flat.copy_(padded[:d])
    stats.peak_extra_bytes = max(stats.peak_extra_bytes, WORKSPACE.held_bytes)
    return flat
