"""The wires a ring sends its chunks in: a codec each, one interface.

A ring (:func:`cerar.comm.algorithms.ring.program.run_ring`) does three things to a piece of a chunk, and
a wire says how each is done in its format:

* ``encode(values, packet)``: the rank's own values into a packet (round 1);
* ``add_encode(own, arrived, packet, keep)``: a reduce-scatter hop: the packet that arrived,
  decoded, plus the rank's own values, encoded into the next packet; with ``keep`` (the owner of
  a fully reduced chunk) ``own`` is overwritten with the decoded packet, so that the owner keeps
  exactly what every other rank will receive;
* ``decode(packet, out)``: an all-gather packet's values written into ``out``
  (``decode_add``: added to it, the direct shape's owner summing what it received).

The wires (:data:`WIRES`, by the name the route table uses):

* :class:`FloatWire` ``"fp32"``/``"fp64"``: the data as it is (exact up to the sums' rounding);
  ``"fp16"``/``"bf16"``: a cast, the sums in the data's dtype, a power-of-two scale agreed
  before the rounds keeping them in the wire's range (:func:`cerar.coding.scaling.ring_scale_exponent`);
* :class:`BlockWire` ``"int8"``, ``"fp8"``, ``"int4"``, ``"int3"``, ``"int2"``: block quantization
  (:mod:`cerar.coding.blocks`; compiled kernels for float32 on the CPU, else torch ops), the data
  pre-scaled by a power of two only where its range needs it
  (:func:`cerar.coding.scaling.block_scale_exponent`).

A new wire is a codec here and a row in :mod:`cerar.comm.collective.routes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from cerar.coding.blocks import BlockFormat
from cerar.coding.scaling import block_scale_exponent, ring_needs_scale, ring_scale_exponent
from cerar.comm.algorithms.ring.block_ops import quant_ops, quant_pieces
from cerar.comm.algorithms.workspace import WORKSPACE
from cerar.comm.runtime.engine import segments

__all__ = ["OWN", "WIRES", "BlockWire", "Codec", "FloatWire", "Span", "Wire"]


class Span(NamedTuple):
    """One piece of a chunk: values ``[first, end)``, its packet at ``offset`` in the round's
    buffer, ``size`` elements of the buffer's dtype."""

    first: int
    end: int
    offset: int
    size: int


class Codec(Protocol):
    """A wire bound to a call's data dtype and device: what the ring program calls."""

    buffer_dtype: torch.dtype

    def spans(self, chunk: int) -> list[Span]: ...
    def encode(self, values: torch.Tensor, packet: torch.Tensor) -> None: ...
    def add_encode(self, own: torch.Tensor, arrived: torch.Tensor, packet: torch.Tensor, keep: bool) -> None: ...
    def decode(self, packet: torch.Tensor, out: torch.Tensor) -> None: ...
    def decode_add(self, packet: torch.Tensor, out: torch.Tensor) -> None: ...


class Wire(Protocol):
    """A wire format: its name, its bytes, and a codec for a call's data."""

    name: str

    @property
    def lossy(self) -> bool: ...
    def describe(self) -> str: ...
    @property
    def quantized(self) -> bool: ...
    def work_dtype(self, data: torch.dtype) -> torch.dtype: ...
    def needs_max(self, data: torch.dtype) -> bool: ...
    def scale_exponent(self, world_size: int, max_abs: float, data: torch.dtype) -> int: ...
    def codec(self, data: torch.dtype, device: torch.device) -> Codec: ...


@dataclass(frozen=True)
class FloatWire:
    """A float dtype on the wire: ``dtype`` None is the data's own (float32, or float64 for
    float64 data); a narrower one is a cast with the sums kept in the data's dtype."""

    name: str
    dtype: torch.dtype | None

    @property
    def lossy(self) -> bool:
        return self.dtype in (torch.float16, torch.bfloat16)

    def describe(self) -> str:
        return self.name if self.dtype is None else str(self.dtype).replace("torch.", "")

    @property
    def quantized(self) -> bool:
        return False

    def work_dtype(self, data: torch.dtype) -> torch.dtype:
        return data

    def scale_exponent(self, world_size: int, max_abs: float, data: torch.dtype) -> int:
        wire = self.dtype or data
        return ring_scale_exponent(world_size, max_abs, data, wire) if ring_needs_scale(data, wire) else 0

    def needs_max(self, data: torch.dtype) -> bool:
        return self.dtype is not None and ring_needs_scale(data, self.dtype)

    def codec(self, data: torch.dtype, device: torch.device) -> Codec:
        return _CastCodec(data, self.dtype or data, device)


class _CastCodec:
    """A float wire's codec: ``copy_`` casts (round to nearest even), sums in the data's dtype."""

    def __init__(self, data: torch.dtype, wire: torch.dtype, device: torch.device) -> None:
        self.data, self.buffer_dtype, self.device = data, wire, device
        self.itemsize = torch.empty((), dtype=data).element_size()
        self.widened: torch.Tensor | None = None

    def spans(self, chunk: int) -> list[Span]:
        if self.buffer_dtype != self.data:  # the sums widen what arrived into one buffer
            self.widened = WORKSPACE.get("ring_widened", (chunk,), self.data, self.device)
        return [Span(a, b, a, b - a) for a, b in segments(chunk, self.itemsize)]

    def encode(self, values: torch.Tensor, packet: torch.Tensor) -> None:
        packet.copy_(values)

    def add_encode(self, own: torch.Tensor, arrived: torch.Tensor, packet: torch.Tensor, keep: bool) -> None:
        if self.widened is None:
            own.add_(arrived)
        else:
            widened = self.widened[: arrived.numel()]
            widened.copy_(arrived)
            own.add_(widened)
        packet.copy_(own)
        if keep and self.widened is not None:  # every rank must end with the values it receives
            own.copy_(packet)

    def decode(self, packet: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(packet)

    def decode_add(self, packet: torch.Tensor, out: torch.Tensor) -> None:
        out.add_(packet)


@dataclass(frozen=True)
class BlockWire:
    """A block-quantized wire (:class:`cerar.coding.blocks.BlockFormat`): float32 sums, one
    scale per block."""

    name: str
    fmt: BlockFormat

    @property
    def lossy(self) -> bool:
        return True

    def describe(self) -> str:
        return self.fmt.describe()

    @property
    def quantized(self) -> bool:
        return True

    def work_dtype(self, data: torch.dtype) -> torch.dtype:
        return torch.float32

    def needs_max(self, data: torch.dtype) -> bool:
        return True  # the non-finite policy and the range's scaling both need every rank's max|x|

    def scale_exponent(self, world_size: int, max_abs: float, data: torch.dtype) -> int:
        return block_scale_exponent(world_size, max_abs, self.fmt)

    def codec(self, data: torch.dtype, device: torch.device) -> Codec:
        return _BlockCodec(self.fmt, device)


class _BlockCodec:
    """A block wire's codec: packets of bytes, the block kernels (compiled or torch ops)."""

    buffer_dtype = torch.uint8

    def __init__(self, fmt: BlockFormat, device: torch.device) -> None:
        self.fmt, self.ops = fmt, quant_ops(fmt, torch.float32, device)

    def spans(self, chunk: int) -> list[Span]:
        return [Span(*piece) for piece in quant_pieces(chunk, self.fmt)]

    def encode(self, values: torch.Tensor, packet: torch.Tensor) -> None:
        self.ops.quantize(values, packet)

    def add_encode(self, own: torch.Tensor, arrived: torch.Tensor, packet: torch.Tensor, keep: bool) -> None:
        self.ops.dequant_add_requant(own, arrived, packet, keep)

    def decode(self, packet: torch.Tensor, out: torch.Tensor) -> None:
        self.ops.dequantize(packet, out)

    def decode_add(self, packet: torch.Tensor, out: torch.Tensor) -> None:
        self.ops.dequantize(packet, out, accumulate=True)


def _block_wires() -> dict[str, BlockWire]:
    from cerar.coding.blocks import WIRES as BLOCK_NAMES

    return {name: BlockWire(name, BlockFormat(name)) for name in BLOCK_NAMES}


#: The data's own dtype on the wire (float32, or float64 for float64 data): the ``ring`` row's
#: default and the exact ring the non-finite policies fall back to.
OWN = FloatWire("own", None)

#: Every wire by its name in the route table.
WIRES: dict[str, Wire] = {
    "fp32": FloatWire("fp32", torch.float32),
    "fp64": FloatWire("fp64", torch.float64),
    "fp16": FloatWire("fp16", torch.float16),
    "bf16": FloatWire("bf16", torch.bfloat16),
    **_block_wires(),
}
