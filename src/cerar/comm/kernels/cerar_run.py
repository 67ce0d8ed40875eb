"""CERAR on one rank for one layout: its buffers and the program of its rounds, bound once and run
for each call on the engine of :mod:`cerar.comm.ring.engine`.

Layout: component ``k`` of a rank's ``d`` values takes every ``c``-th value (values ``k, k + c,
k + 2c, ...``), so the ``(c, m)`` component matrix is the ``(m, c)`` view of the flat tensor,
transposed, and column ``q`` mixes the ``c`` neighbouring values ``qc .. qc + c - 1``: each
parameter's error is relative to its own values, not to the largest parameter of the bucket. A
column piece ``[a, b)`` is the contiguous slice ``[ac, bc)``; only the last piece is copied (zero
padded) when ``c`` does not divide ``d``.

The coding is spread over the rounds, piece by piece, and kept off the critical path (in the
engine's ``landed`` hook, once the piece's next round is on the wire): the encode and the decode
are each one of two small objects (:mod:`cerar.comm.kernels.encode`, :mod:`cerar.comm.kernels.decode`),
compiled where :mod:`cerar.comm.kernels.native` can serve the layout, torch ops elsewhere.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from cerar.coding.code import Code
from cerar.comm.kernels import native
from cerar.comm.kernels.decode import CompiledDecode, FoldedDecode
from cerar.comm.kernels.encode import BatchedEncode, CompiledEncode, add_rounded
from cerar.comm.kernels.plans import accumulator_dtype, rank_matrices, scaled_matrices
from cerar.comm.kernels.scale import PacketScale
from cerar.comm.kernels.workspace import WORKSPACE
from cerar.comm.ring.engine import Action, Gate, Piece, Program, run_program, segments
from cerar.comm.ring.links import Ring
from cerar.comm.ring.maxima import MaximaChain
from cerar.comm.ring.stats import CommStats

__all__ = ["CerarOutcome", "CerarRun"]

_MAX_BOUND_LAYOUTS = 64  # DDP has a few dozen buckets at most; other callers' sizes are bounded too


@dataclass(frozen=True)
class CerarOutcome:
    """What one run found: every rank's ``max|x|`` (``inf``: NaN/Inf) and whether the sum was
    written (if not, the input is intact)."""

    maxima: list[float]
    written: bool

    @property
    def largest(self) -> float:
        return max(self.maxima)

    @property
    def finite(self) -> bool:
        return all(math.isfinite(v) for v in self.maxima)


class CerarRun:
    """CERAR on this rank for one layout (code, ring, size, dtypes, rows' scale), kept while the
    workspace keeps its buffers (DDP repeats its buckets every step), then run for each call.

    1. While round 1 is on the wire, one pass over the input finds its ``max|x|`` (``inf`` for
       NaN/Inf); :class:`cerar.comm.ring.maxima.MaximaChain` carries every rank's in front of the
       first piece of rounds ``2 .. N`` (no message of its own).
    2. Each piece's increments are computed ahead (:attr:`encode`) from ``X / s``: ``s = 2**(r +
       q)`` for the scale's split ``(r, q)`` (:meth:`cerar.comm.kernels.scale.PacketScale.split`),
       ``2**r`` folded into the increment rows and the decoder (exact, and free), ``2**q`` (0 but
       near the ends of the dtype's range) dividing a copy of the input. Sending a piece (its
       ``prepare``) adds its round's increment to what arrived, in the packet dtype (a 16-bit
       packet is computed in the data's dtype and rounded once): the critical path is that add.
    3. Observations arrive straight into their slot and are decoded (:attr:`decode`), times
       ``2**r``, once the piece's next round is on the wire.
    4. When the last round's piece lands, the chain has long completed: :meth:`decide` asks the
       call's :class:`~cerar.comm.kernels.scale.PacketScale` whether every rank's data fitted
       (the same answer on every rank; non-finite data: ``write_nonfinite``), and the piece's
       sum, times ``2**q``, is written (or nothing is, and the input stays intact for the
       caller's fallback or redo).

    What belongs to one call (the input's views, the chain's values, the decision) is set by
    :meth:`run` and dropped when it returns: a kept layout holds no caller's tensor.
    """

    @classmethod
    def for_call(cls, flat: torch.Tensor, code: Code, ring: Ring, scale: PacketScale, packet: torch.dtype) -> CerarRun:
        """The run of ``flat``'s layout at ``scale``'s rows exponent: the one kept in the
        workspace, or a new one (kept)."""
        rows_exponent = scale.split()[0]
        # native.enabled(): a process that switches the compiled coding off (CERAR_NATIVE=0) gets
        # the torch ops from its next call on, also for the layouts it has run.
        key = (
            "cerar", code.fingerprint, ring, flat.numel(), flat.dtype, packet, str(flat.device), rows_exponent,
            native.enabled(),
        )  # fmt: skip
        run = WORKSPACE.bound.get(key)
        if run is None:
            run = cls(code, ring, flat.numel(), flat.dtype, packet, flat.device, rows_exponent)
            if len(WORKSPACE.bound) >= _MAX_BOUND_LAYOUTS:
                WORKSPACE.bound.clear()
            WORKSPACE.bound[key] = run  # after its buffers: taking them may clear the kept runs
        return run

    def __init__(
        self,
        code: Code,
        ring: Ring,
        numel: int,
        dtype: torch.dtype,
        packet: torch.dtype,
        device: torch.device,
        rows_exponent: int = 0,
    ) -> None:
        self.ring, self.dtype, self.device = ring, dtype, device
        c = self.c = code.components
        d = self.d = numel
        self.full_rows = d // c  # columns held in flat (or its scaled copy) as they are
        m = self.m = math.ceil(d / c)
        plan = rank_matrices(code, ring.rank, device)
        self.rounds = plan.increments.shape[0]
        self.first_observed = plan.first_observed_round
        self.rows_scale = math.ldexp(1.0, rows_exponent)  # |r| stays far inside float64
        # The sum accumulates in the precision the packets need: float64 for float32/float64
        # packets, float32 for 16-bit ones, whose own rounding dwarfs float32's.
        self.acc_dtype = accumulator_dtype(packet)
        scaled = scaled_matrices(code, ring.rank, device, dtype, self.acc_dtype, rows_exponent)
        self.pieces = segments(m, torch.empty((), dtype=packet).element_size())
        # Every packet row starts with the maxima chain's front (8 N bytes), sent only by the
        # first piece of rounds 2 .. N; the values follow it.
        self.chain = MaximaChain(ring, device, packet)
        f = self.front = self.chain.front
        self.send = WORKSPACE.get("send", (2, f + m), packet, device)
        self.recv = WORKSPACE.get("recv", (2, f + m), packet, device)  # rounds before the first observation
        # Observation rounds receive straight into their slot (kept until the decode reads them);
        # rounds before them into two alternating scratch packets.
        self.observations = WORKSPACE.get("observations", (c, f + m), packet, device)
        # The compiled coding where it serves this layout (cerar.comm.kernels.native), else the torch ops.
        encoder = native.fused_encoder(plan.increments / self.rows_scale, dtype, device)  # exact: a power of two
        decoder = native.fused_decoder(plan.decode_own, plan.decode_obs * self.rows_scale, dtype, packet, device)
        self.encode = BatchedEncode(self, scaled) if encoder is None else CompiledEncode(self, encoder)
        self.decode = FoldedDecode(self, scaled) if decoder is None else CompiledDecode(self, decoder)
        self.program = self._bind(packet != dtype)
        # The chain's bytes, sent inside data packets: not counted as data.
        carrying = sum(self.chain.carries(t, self.rounds) for t in range(1, self.rounds + 1)) if self.pieces else 0
        self.control_bytes = carrying * f * self.send.element_size()
        # One call's state, set by run().
        self.flat: torch.Tensor | None = None
        self.scale: PacketScale | None = None
        self.write_nonfinite = False
        self.data_exponent = 0
        self.columns: dict[int, torch.Tensor] = {}
        self.encode_s = self.decode_s = self.coding_cpu_s = 0.0
        self.maxima: list[float] = []
        self.written: bool | None = None  # decided once, after the last round

    @property
    def encoder(self) -> object | None:
        """The compiled encoder, or None where the torch ops run."""
        return getattr(self.encode, "encoder", None)

    @property
    def decoder(self) -> object | None:
        """The compiled decoder, or None where the torch ops run."""
        return getattr(self.decode, "decoder", None)

    def _arrived(self, t: int) -> torch.Tensor:
        """The packet row round ``t`` arrives in: its observation slot, or a scratch row."""
        slot = t - self.first_observed
        return self.observations[slot] if slot >= 0 else self.recv[t % 2]

    def _bind(self, widen: bool) -> Program:
        """Every round's pieces: their views and the ops that fill and use them."""
        f, program = self.front, []
        for t in range(1, self.rounds + 1):
            carrying = self.chain.carries(t, self.rounds)
            pieces = []
            for a, b in self.pieces:
                row = self.send[t % 2]
                out, arrived = row[f + a : f + b], self._arrived(t)
                increment = self.encode.increment(a, t)
                prepare: Action
                if t == 1:  # the piece's first encode, while earlier pieces are on the wire
                    prepare = functools.partial(self._first_round, a, out, increment)
                elif widen:  # computed in flat's dtype, rounded once to the packet dtype
                    prepare = functools.partial(add_rounded, increment, self._arrived(t - 1)[f + a : f + b], out)
                else:
                    prepare = functools.partial(torch.add, self._arrived(t - 1)[f + a : f + b], increment, out=out)
                received: Action | None = None
                if a == 0 and carrying:  # the chain's hop rides in front of the first piece
                    prepare = functools.partial(self._with_chain, prepare, row[:f])
                    received = functools.partial(self.chain.absorb, arrived[:f])
                    out, arrived = row[: f + b], arrived[: f + b]
                else:
                    arrived = arrived[f + a : f + b]
                pieces.append(Piece(out, arrived, prepare, received, self._landed(t, a, b)))
            program.append(pieces)
        return Program(program, self.device, posted={1: self._own_maximum})

    def _landed(self, t: int, a: int, b: int) -> Action | None:
        """Off the critical path, once round ``t``'s piece has landed and round ``t + 1``'s is on
        the wire: the encode's next batch, if due, then the decode's share."""
        encode, decode = self.encode.landed(t, a), self.decode.landed(t, a, b)
        if encode is None or decode is None:
            return encode or decode
        return functools.partial(_both, encode, decode)

    def run(
        self,
        stats: CommStats,
        flat: torch.Tensor,
        scale: PacketScale,
        write_nonfinite: bool = False,
        gate: Gate | None = None,
    ) -> CerarOutcome:
        """One call on ``flat`` (this layout's size and dtype) at ``scale``: the rounds, then the
        decision. ``gate``: a handshake to finish once round 1 is on the wire
        (:func:`cerar.comm.ring.engine.run_program`)."""
        data_exponent = scale.split()[1]
        self._arm(flat, scale, write_nonfinite, data_exponent)
        try:
            try:
                run_program(self.ring, stats, self.program, gate=gate)
            finally:
                stats.bytes_sent -= self.control_bytes
                stats.bytes_received -= self.control_bytes
                if data_exponent:  # held only by calls at the ends of the range
                    stats.peak_extra_bytes = max(stats.peak_extra_bytes, WORKSPACE.held_bytes)
                    WORKSPACE.release("scaled_input")
            stats.encode_s += self.encode_s
            stats.decode_s += self.decode_s
            stats.coding_cpu_s += self.coding_cpu_s
            stats.peak_extra_bytes = max(stats.peak_extra_bytes, WORKSPACE.held_bytes)
            return CerarOutcome(maxima=self.maxima, written=self.decide())  # decided here if there was no piece
        finally:
            self.flat, self.scale = None, None
            self.columns.clear()

    def _arm(self, flat: torch.Tensor, scale: PacketScale, write_nonfinite: bool, data_exponent: int) -> None:
        """This call's state: the input's rows per piece as ``(w, c)`` views (the last piece
        copied and zero padded if ``c`` does not divide ``d``), of ``flat`` or, near the ends of
        the dtype's range, of a copy divided by ``2**q`` (exact), released after the call."""
        if flat.numel() != self.d or flat.dtype != self.dtype:
            raise ValueError(
                f"Argument 'flat' must hold {self.d} values of {self.dtype}, not {flat.numel()} of {flat.dtype}."
            )
        self.flat, self.scale, self.write_nonfinite = flat, scale, write_nonfinite
        self.data_exponent = data_exponent
        self.encode_s = self.decode_s = self.coding_cpu_s = 0.0
        self.maxima, self.written = [], None
        self.chain.reset()
        c, d = self.c, self.d
        source = flat
        if data_exponent:
            source = WORKSPACE.get("scaled_input", (d,), self.dtype, self.device)
            torch.mul(flat, math.ldexp(1.0, -data_exponent), out=source)
        self.columns.clear()
        for a, b in self.pieces:
            if b <= self.full_rows:
                self.columns[a] = source[a * c : b * c].view(b - a, c)
            else:
                padded = WORKSPACE.get("tail", (b - a, c), self.dtype, self.device)
                padded.view(-1)[: d - a * c].copy_(source[a * c :])
                padded.view(-1)[d - a * c :].zero_()
                self.columns[a] = padded

    def decide(self) -> bool:
        """Whether to write the sum, the same on every rank, asked once: every rank's data fitted
        the packet scale, or held NaN/Inf and the call writes it anyway (``nonfinite="ignore"``)."""
        if self.written is None:
            self.maxima.extend(self.chain.maxima(self.rounds + 1))
            if all(math.isfinite(v) for v in self.maxima):
                assert self.scale is not None
                self.written = self.scale.admits(max(self.maxima))
            else:
                self.written = self.write_nonfinite
        return self.written

    # The ops bound into the program that need this call's input or state.

    def _own_maximum(self) -> None:
        self.chain.set_own_from(self.flat)  # one pass over the input, while round 1 is on the wire

    def _first_round(self, a: int, out: torch.Tensor, increment: torch.Tensor) -> None:
        self.encode.first(a)
        out.copy_(increment)

    def _with_chain(self, prepare: Action, front: torch.Tensor) -> None:
        prepare()
        self.chain.write(front)


def _both(first: Action, second: Action) -> None:
    first()
    second()
