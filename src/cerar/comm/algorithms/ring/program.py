"""The ring all-reduce (reduce-scatter, then all-gather) on cerar's engine, in any wire
(:mod:`cerar.comm.algorithms.ring.wires`): the exact ring, the 16-bit rings and the block-quantized rings
are this one program with another codec.

``2 (N - 1)`` rounds; each chunk is cut into the wire's pieces (:meth:`Codec.spans`: about
256 KiB apiece, whole blocks for a block wire) pipelined by
:func:`cerar.comm.runtime.engine.run_program`. Round 1 encodes the rank's own chunk; a
reduce-scatter hop decodes what arrived, adds the rank's own chunk and encodes the partial sum
into the next packet, in one pass (the block wires' compiled dequantize-add-requantize, or torch
ops); the owner of a fully reduced chunk keeps what it sends; the all-gather forwards each packet
unchanged and decodes it off the critical path. Every rank thus ends with bitwise the same
values, which :func:`cerar.protocol.simulate_ring.simulate_ring` computes step for step.

On the CPU the codec's calls are timed into the call's :class:`CommStats`, as CERAR's coding is:
``encode_s`` the wall time of its ``encode`` and ``add_encode`` calls (round 1 and the
reduce-scatter hops), ``decode_s`` of its ``decode`` calls (the all-gather's packets), and
``coding_cpu_s`` the thread's CPU time in both (``time.thread_time``), accumulated call by call
(one per piece and round: a few hundred clock reads per call at most). The all-gather's
forwarding of a packet unchanged is the program's copy, not the codec's, and is not timed. On a
GPU a call only queues its kernels, and timing them would need a host sync inside the rounds:
nothing is timed there.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from cerar.comm.algorithms.cerar.decode import scale_by_power_of_two
from cerar.comm.algorithms.ring.feedback import check_residual, feedback_encode
from cerar.comm.algorithms.ring.wires import Codec, Wire
from cerar.comm.algorithms.workspace import WORKSPACE
from cerar.comm.runtime.engine import Action, Piece, Program, run_program
from cerar.comm.runtime.links import Ring
from cerar.comm.runtime.stats import CommStats

__all__ = ["CodecClock", "finish", "run_ring"]


def run_ring(
    flat: torch.Tensor, ring: Ring, stats: CommStats, wire: Wire, scale_exponent: int = 0,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """The ring all-reduce (sum) of the contiguous 1-d ``flat`` in ``wire``, in place; ``flat``'s
    dtype must be the wire's working dtype (float32 for a block wire). The values are divided by
    ``2**scale_exponent`` before the ring and multiplied back after (exact), to keep the wire's
    values in its range. Bytes and rounds are counted in ``stats`` at the transport; on the CPU
    the codec's time too (``encode_s``, ``decode_s``, ``coding_cpu_s``: see the module doc).
    ``residual``: error feedback's (:mod:`cerar.comm.algorithms.ring.feedback`), float32 of the
    padded size ``N * ceil(d / N)``, in the caller's units, updated in place: each hop adds its
    chunk's residual before it quantizes, with torch ops (not the fused kernel)."""
    if flat.dim() != 1 or not flat.is_contiguous() or flat.dtype != wire.work_dtype(flat.dtype):
        shape = tuple(flat.shape)
        raise ValueError(
            f"Argument 'flat' must be a contiguous 1-d tensor of the {wire.name} wire's working dtype, "
            f"not {flat.dtype} of shape {shape}."
        )
    n, d = ring.size, flat.numel()
    chunk = math.ceil(d / n)
    check_residual(residual, n * chunk)
    padded = WORKSPACE.padded("ring_padded", flat, n * chunk)
    scale_by_power_of_two(padded, -scale_exponent)
    chunks = padded.view(n, chunk)
    codec = wire.codec(flat.dtype, flat.device)
    fed = None
    if residual is not None:
        scale_by_power_of_two(residual, -scale_exponent)
        scratch = WORKSPACE.get("ring_feedback", (chunk,), flat.dtype, flat.device)
        fed = _Fed(codec, residual.view(n, chunk), scratch)
    spans = codec.spans(chunk)
    stride = spans[-1].offset + spans[-1].size if spans else 0
    send = WORKSPACE.get("ring_send", (2, stride), codec.buffer_dtype, flat.device)
    recv = WORKSPACE.get("ring_recv", (2, stride), codec.buffer_dtype, flat.device)
    clock = CodecClock() if flat.device.type == "cpu" else None
    encode, decode = (clock.encode, clock.decode) if clock is not None else (None, None)
    r = ring.rank
    owned = (r + 1) % n  # fully reduced here after the reduce-scatter
    rounds = []
    for t in range(1, 2 * (n - 1) + 1):
        pieces = []
        for a, b, offset, size in spans:
            out, arrived = send[t % 2, offset : offset + size], recv[t % 2, offset : offset + size]
            before = recv[(t - 1) % 2, offset : offset + size]  # what round t - 1 brought
            prepare: Action
            if t <= n and fed is not None:  # as below, plus the residual of the chunk's last call
                j = (r - t + 1) % n
                prepare = _bind(encode, fed.hop, chunks[j], j, a, b, None if t == 1 else before, out, t == n)
            elif t == 1:  # this rank's own chunk
                prepare = _bind(encode, codec.encode, chunks[r, a:b], out)
            elif t < n:  # the partial sum: what arrived plus this rank's chunk
                prepare = _bind(encode, codec.add_encode, chunks[(r - t + 1) % n, a:b], before, out, False)
            elif t == n:  # the full sum: the owner keeps what it sends
                prepare = _bind(encode, codec.add_encode, chunks[owned, a:b], before, out, True)
            else:  # the all-gather forwards the packet unchanged
                prepare = functools.partial(out.copy_, before)
            landed: Action | None = None
            if t >= n:  # the owner's values, off the critical path (while the next round is on the wire)
                landed = _bind(decode, codec.decode, arrived, chunks[(r - (t - n)) % n, a:b])
            pieces.append(Piece(out, arrived, prepare, None, landed))
        rounds.append(pieces)
    run_program(ring, stats, Program(rounds, flat.device))
    return finish(flat, padded, residual, scale_exponent, stats, clock)


def finish(
    flat: torch.Tensor, padded: torch.Tensor, residual: torch.Tensor | None, scale_exponent: int,
    stats: CommStats, clock: CodecClock | None,
) -> torch.Tensor:  # fmt: skip
    """A shape's last steps (the ring's and the direct one's): the codec's time and the memory
    held into ``stats``, the prescale undone on the values and the residual, the values written
    back into ``flat``."""
    if clock is not None:
        clock.add_to(stats)
    scale_by_power_of_two(padded, scale_exponent)
    if residual is not None:
        scale_by_power_of_two(residual, scale_exponent)
    if padded is not flat:
        flat.copy_(padded[: flat.numel()])
    extra = WORKSPACE.held_bytes + (0 if residual is None else residual.numel() * residual.element_size())
    stats.peak_extra_bytes = max(stats.peak_extra_bytes, extra)
    return flat


class _Fed:
    """A ring hop with error feedback: what arrived (none in round 1) plus the rank's chunk plus
    the chunk's residual, encoded; the residual keeps what was rounded away."""

    def __init__(self, codec: Codec, residuals: torch.Tensor, scratch: torch.Tensor) -> None:
        self.codec, self.residuals, self.scratch = codec, residuals, scratch

    def hop(
        self, own: torch.Tensor, j: int, a: int, b: int, arrived: torch.Tensor | None, packet: torch.Tensor, keep: bool
    ) -> None:
        value, mine = self.scratch[a:b], own[a:b]
        if arrived is None:
            value.copy_(mine)
        else:
            self.codec.decode(arrived, value)
            value.add_(mine)
        feedback_encode(self.codec, value, self.residuals[j, a:b], packet, mine if keep else None)


def _bind(timer: Callable[..., None] | None, call: Callable[..., object], *args: Any) -> Action:
    """``call(*args)`` as an action, through ``timer`` (a :class:`CodecClock`'s) where one times it."""
    return functools.partial(call, *args) if timer is None else functools.partial(timer, call, *args)


class CodecClock:
    """The codec's time in one call (see the module doc): wall seconds of its encodes and of its
    decodes, and the thread's CPU seconds in both."""

    __slots__ = ("cpu_s", "decode_s", "encode_s")

    def __init__(self) -> None:
        self.encode_s = self.decode_s = self.cpu_s = 0.0

    def encode(self, call: Callable[..., object], *args: Any) -> None:
        began, cpu = time.perf_counter(), time.thread_time()
        call(*args)
        self.encode_s += time.perf_counter() - began
        self.cpu_s += time.thread_time() - cpu

    def decode(self, call: Callable[..., object], *args: Any) -> None:
        began, cpu = time.perf_counter(), time.thread_time()
        call(*args)
        self.decode_s += time.perf_counter() - began
        self.cpu_s += time.thread_time() - cpu

    def add_to(self, stats: CommStats) -> None:
        stats.encode_s += self.encode_s
        stats.decode_s += self.decode_s
        stats.coding_cpu_s += self.cpu_s
