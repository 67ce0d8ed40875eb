"""The direct reduce-scatter and all-gather in a wire: the shape that quantizes least.

The ring (:func:`cerar.comm.algorithms.ring.program.run_ring`) requantizes a partial sum at every
hop, so a value is rounded ``N`` times. Here each rank sends chunk ``j`` of its own input straight
to its owner, rank ``j``, quantized once; the owner sums the ``N - 1`` chunks it receives with its
own, unrounded, in float32, quantizes the sum once and sends that packet to every rank, itself
included (it decodes its own packet): two roundings whatever ``N`` is, and every rank ends with
bitwise the same values. The bytes are the ring's, ``2 (N - 1) / N`` of the tensor per rank, as
``N - 1`` messages to different peers per phase instead of ``N - 1`` rounds to one neighbour
(what torchft's quantized all-reduce, EQuARX and ZeRO++'s qgZ do, the last over an all-to-all).

The messages to the rank ``k`` places ahead go over :meth:`Ring.at_distance` ``(k)``, cerar's
transport and tags; each is encoded just before it is posted, so the first is on the wire while
the others are encoded. With a residual (:mod:`cerar.comm.algorithms.ring.feedback`) each
sender adds what it rounded away last time to the chunks it sends, and the owner to its sum.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from cerar.comm.algorithms.cerar.decode import scale_by_power_of_two
from cerar.comm.algorithms.ring.feedback import check_residual, feedback_encode
from cerar.comm.algorithms.ring.program import CodecClock, finish
from cerar.comm.algorithms.ring.wires import Codec, Span, Wire
from cerar.comm.algorithms.workspace import WORKSPACE
from cerar.comm.runtime.links import Ring, pair_poster, wait_for
from cerar.comm.runtime.stats import CommStats

__all__ = ["run_direct"]


def run_direct(
    flat: torch.Tensor, ring: Ring, stats: CommStats, wire: Wire, scale_exponent: int = 0,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """The direct all-reduce (sum) of the contiguous 1-d ``flat`` in ``wire``, in place, as
    :func:`cerar.comm.algorithms.ring.program.run_ring` takes it (the same dtype rule, prescale
    and statistics; ``rounds`` counts the two phases). ``residual``: error feedback's, float32 of
    the padded size ``N * ceil(d / N)``, in the caller's units, updated in place."""
    if flat.dim() != 1 or not flat.is_contiguous() or flat.dtype != wire.work_dtype(flat.dtype):
        shape = tuple(flat.shape)
        raise ValueError(
            f"Argument 'flat' must be a contiguous 1-d tensor of the {wire.name} wire's working dtype, "
            f"not {flat.dtype} of shape {shape}."
        )
    n, d = ring.size, flat.numel()
    chunk = math.ceil(d / n)
    check_residual(residual, n * chunk)
    padded = WORKSPACE.padded("direct_padded", flat, n * chunk)
    scale_by_power_of_two(padded, -scale_exponent)
    chunks = padded.view(n, chunk)
    residuals = None
    if residual is not None:
        scale_by_power_of_two(residual, -scale_exponent)
        residuals = residual.view(n, chunk)
    clock = CodecClock() if flat.device.type == "cpu" else None
    codec = _Whole(wire.codec(flat.dtype, flat.device), chunk, clock)
    send = WORKSPACE.get("direct_send", (n, codec.stride), codec.buffer_dtype, flat.device)  # row k: to rank r + k
    recv = WORKSPACE.get("direct_recv", (n, codec.stride), codec.buffer_dtype, flat.device)  # row k: from rank r - k
    scratch = WORKSPACE.get("direct_scratch", (chunk,), flat.dtype, flat.device) if residual is not None else None
    r, device = ring.rank, flat.device
    links = [ring.at_distance(k) for k in range(n)]
    posters = [pair_poster(links[k], device) for k in range(1, n)]

    # 1. Reduce-scatter: chunk r + k to its owner, quantized once.
    arriving, sent = [], []
    for k in range(1, n):
        j = (r + k) % n
        if residuals is None:
            codec.encode(chunks[j], send[k])
        else:
            assert scratch is not None
            scratch.copy_(chunks[j])
            codec.encode_fed(scratch, residuals[j], send[k])
        received, sending = posters[k - 1](send[k], recv[k], k)
        arriving.append(received)
        sent.append(sending)
    # 2. The owner's sum: its own chunk, unrounded, plus the others' in order of distance.
    own = chunks[r]
    for k in range(1, n):
        wait_for(arriving[k - 1], links[k], k)
        codec.decode_add(recv[k], own)
    # 3. The sum quantized once; the owner keeps what the packet decodes to, as every rank will.
    if residuals is None:
        codec.encode(own, send[0])
        codec.decode(send[0], own)
    else:
        assert scratch is not None
        scratch.copy_(own)
        codec.encode_fed(scratch, residuals[r], send[0], own)
    # 4. All-gather: the packet to every rank (the receive buffers are free again: all arrived).
    arriving = []
    for k in range(1, n):
        wait_for(sent[k - 1], links[k], k)
        received, sending = posters[k - 1](send[0], recv[k], n - 1 + k)
        arriving.append(received)
        sent[k - 1] = sending
    for k in range(1, n):
        wait_for(arriving[k - 1], links[k], n - 1 + k)
        codec.decode(recv[k], chunks[(r - k) % n])
    for k in range(1, n):
        wait_for(sent[k - 1], links[k], n - 1 + k)

    per_message = codec.stride * send.element_size()
    stats.bytes_sent += 2 * (n - 1) * per_message
    stats.bytes_received += 2 * (n - 1) * per_message
    stats.rounds += 2
    return finish(flat, padded, residual, scale_exponent, stats, clock)


class _Whole:
    """A codec over whole chunks: each call runs the wire's codec piece by piece (its spans) and
    times it on the CPU (:class:`CodecClock`)."""

    def __init__(self, codec: Codec, chunk: int, clock: CodecClock | None) -> None:
        self.codec, self.clock = codec, clock
        self.spans: list[Span] = codec.spans(chunk)
        self.stride = self.spans[-1].offset + self.spans[-1].size if self.spans else 0
        self.buffer_dtype = codec.buffer_dtype

    def _run(self, timer: Any, call: Any, *args: Any) -> None:
        if self.clock is None:
            call(*args)
        else:
            getattr(self.clock, timer)(call, *args)

    def encode(self, values: torch.Tensor, packet: torch.Tensor) -> None:
        for a, b, offset, size in self.spans:
            self._run("encode", self.codec.encode, values[a:b], packet[offset : offset + size])

    def decode(self, packet: torch.Tensor, out: torch.Tensor) -> None:
        for a, b, offset, size in self.spans:
            self._run("decode", self.codec.decode, packet[offset : offset + size], out[a:b])

    def decode_add(self, packet: torch.Tensor, out: torch.Tensor) -> None:
        for a, b, offset, size in self.spans:
            self._run("decode", self.codec.decode_add, packet[offset : offset + size], out[a:b])

    def encode_fed(
        self, value: torch.Tensor, residual: torch.Tensor, packet: torch.Tensor, sent: torch.Tensor | None = None
    ) -> None:
        """:func:`feedback_encode` piece by piece (``value`` is scratch)."""
        for a, b, offset, size in self.spans:
            out, piece = None if sent is None else sent[a:b], packet[offset : offset + size]
            self._run("encode", feedback_encode, self.codec, value[a:b], residual[a:b], piece, out)
