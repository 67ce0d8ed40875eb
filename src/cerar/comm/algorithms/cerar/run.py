"""CERAR on one rank for one layout: its buffers and the program of its rounds, bound once and run
for each call on the engine of :mod:`cerar.comm.runtime.engine`.

Layout: component ``k`` of a rank's ``d`` values takes every ``c``-th value (values ``k, k + c,
k + 2c, ...``), so the ``(c, m)`` component matrix is the ``(m, c)`` view of the flat tensor,
transposed, and column ``q`` mixes the ``c`` neighbouring values ``qc .. qc + c - 1``: each
parameter's error is relative to its own values, not to the largest parameter of the bucket. A
column piece ``[a, b)`` is the contiguous slice ``[ac, bc)``; only the last piece is copied (zero
padded) when ``c`` does not divide ``d``.

The coding is spread over the rounds, piece by piece, and kept off the critical path (in the
engine's ``landed`` hook, once the piece's next round is on the wire): the encode and the decode
are each one of two small objects (:mod:`cerar.comm.algorithms.cerar.encode`,
:mod:`cerar.comm.algorithms.cerar.decode`),
compiled where :mod:`cerar.comm.algorithms.native` can serve the layout, torch ops elsewhere. What
the layout fixes and what one call holds are two records (:mod:`cerar.comm.algorithms.cerar.state`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from cerar.coding.linear_code import Code
from cerar.comm.algorithms import native
from cerar.comm.algorithms.cerar.decode import CompiledDecode, FoldedDecode
from cerar.comm.algorithms.cerar.encode import BatchedEncode, CompiledEncode, add_rounded
from cerar.comm.algorithms.cerar.plans import accumulator_dtype, rank_matrices, scaled_matrices
from cerar.comm.algorithms.cerar.scale import PacketScale
from cerar.comm.algorithms.cerar.state import CerarCall, CerarLayout
from cerar.comm.algorithms.workspace import WORKSPACE
from cerar.comm.runtime.engine import Action, Gate, Piece, Program, run_program, segments
from cerar.comm.runtime.links import Ring
from cerar.comm.runtime.maxima import MaximaChain
from cerar.comm.runtime.stats import CommStats

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
       NaN/Inf); :class:`cerar.comm.runtime.maxima.MaximaChain` carries every rank's in front of the
       first piece of rounds ``2 .. N`` (no message of its own).
    2. Each piece's increments are computed ahead (:attr:`encode`) from ``X / s``: ``s = 2**(r +
       q)`` for the scale's split ``(r, q)`` (:meth:`cerar.comm.algorithms.cerar.scale.PacketScale.split`),
       ``2**r`` folded into the increment rows and the decoder (exact, and free), ``2**q`` (0 but
       near the ends of the dtype's range) dividing a copy of the input. Sending a piece (its
       ``prepare``) adds its round's increment to what arrived, in the packet dtype (a 16-bit
       packet is computed in the data's dtype and rounded once): the critical path is that add.
    3. Observations arrive straight into their slot and are decoded (:attr:`decode`), times
       ``2**r``, once the piece's next round is on the wire.
    4. When the last round's piece lands, the chain has long completed: the call
       (:meth:`cerar.comm.algorithms.cerar.state.CerarCall.decide`) asks its
       :class:`~cerar.comm.algorithms.cerar.scale.PacketScale` whether every rank's data fitted (the same
       answer on every rank; non-finite data: ``write_nonfinite``), and the piece's sum, times
       ``2**q``, is written (or nothing is, and the input stays intact for the caller's fallback
       or redo).

    Kept per layout: :attr:`layout` (sizes, pieces, buffers), the chain, the encode and decode
    objects and the bound :attr:`program`. One call's state is a
    :class:`~cerar.comm.algorithms.cerar.state.CerarCall` that :meth:`run` makes, hands to the
    encode and decode (:attr:`call`, the program's own ops read it there) and drops when it
    returns: a kept layout holds no caller's tensor.
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
        self.ring = ring
        c, d = code.components, numel
        m = math.ceil(d / c)
        plan = rank_matrices(code, ring.rank, device)
        rows_scale = math.ldexp(1.0, rows_exponent)  # |r| stays far inside float64
        # The sum accumulates in the precision the packets need: float64 for float32/float64
        # packets, float32 for 16-bit ones, whose own rounding dwarfs float32's.
        acc_dtype = accumulator_dtype(packet)
        scaled = scaled_matrices(code, ring.rank, device, dtype, acc_dtype, rows_exponent)
        # Every packet row starts with the maxima chain's front (8 N bytes), sent only by the
        # first piece of rounds 2 .. N; the values follow it.
        self.chain = MaximaChain(ring, device, packet)
        f = self.chain.front
        self.layout = layout = CerarLayout(
            c=c, d=d, m=m, full_rows=d // c,  # full rows: held in flat (or its scaled copy) as they are
            dtype=dtype, packet=packet, acc_dtype=acc_dtype, device=device,
            rounds=plan.increments.shape[0], first_observed=plan.first_observed_round, rows_scale=rows_scale,
            pieces=tuple(segments(m, torch.empty((), dtype=packet).element_size())),
            front=f,
            send=WORKSPACE.get("send", (2, f + m), packet, device),
            recv=WORKSPACE.get("recv", (2, f + m), packet, device),  # rounds before the first observation
            observations=WORKSPACE.get("observations", (c, f + m), packet, device),
        )  # fmt: skip
        # The compiled coding where it serves this layout (cerar.comm.algorithms.native), else the torch ops.
        encoder = native.fused_encoder(plan.increments / rows_scale, dtype, device)  # exact: a power of two
        decoder = native.fused_decoder(plan.decode_own, plan.decode_obs * rows_scale, dtype, packet, device)
        self.encode = BatchedEncode(layout, scaled) if encoder is None else CompiledEncode(layout, encoder)
        self.decode = FoldedDecode(layout, scaled) if decoder is None else CompiledDecode(layout, decoder)
        self.program = self._bind()
        # The chain's bytes, sent inside data packets: not counted as data.
        rounds = layout.rounds
        carrying = sum(self.chain.carries(t, rounds) for t in range(1, rounds + 1)) if layout.pieces else 0
        self.control_bytes = carrying * f * layout.send.element_size()
        self.call: CerarCall | None = None  # the call in progress (run()), also held by encode and decode

    @property
    def encoder(self) -> native.FusedEncoder | None:
        """The compiled encoder, or None where the torch ops run."""
        return self.encode.encoder if isinstance(self.encode, CompiledEncode) else None

    @property
    def decoder(self) -> native.FusedDecoder | None:
        """The compiled decoder, or None where the torch ops run."""
        return self.decode.decoder if isinstance(self.decode, CompiledDecode) else None

    def _arrived(self, t: int) -> torch.Tensor:
        """The packet row round ``t`` arrives in: its observation slot, or a scratch row."""
        layout = self.layout
        slot = t - layout.first_observed
        return layout.observations[slot] if slot >= 0 else layout.recv[t % 2]

    def _bind(self) -> Program:
        """Every round's pieces: their views and the ops that fill and use them."""
        layout, program = self.layout, []
        f = layout.front
        widen = layout.packet != layout.dtype
        for t in range(1, layout.rounds + 1):
            carrying = self.chain.carries(t, layout.rounds)
            pieces = []
            for a, b in layout.pieces:
                row = layout.send[t % 2]
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
        return Program(program, layout.device, posted={1: self._own_maximum})

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
        (:func:`cerar.comm.runtime.engine.run_program`)."""
        call = self._start(flat, scale, write_nonfinite)
        self._arm(call)
        try:
            try:
                run_program(self.ring, stats, self.program, gate=gate)
            finally:
                stats.bytes_sent -= self.control_bytes
                stats.bytes_received -= self.control_bytes
                if call.data_exponent:  # held only by calls at the ends of the range
                    stats.peak_extra_bytes = max(stats.peak_extra_bytes, WORKSPACE.held_bytes)
                    WORKSPACE.release("scaled_input")
            call.times.add_to(stats)
            stats.peak_extra_bytes = max(stats.peak_extra_bytes, WORKSPACE.held_bytes)
            return CerarOutcome(maxima=call.maxima, written=call.decide())  # decided here if there was no piece
        finally:
            self._arm(None)

    def _start(self, flat: torch.Tensor, scale: PacketScale, write_nonfinite: bool) -> CerarCall:
        """This call's state: the input's rows per piece as ``(w, c)`` views (the last piece
        copied and zero padded if ``c`` does not divide ``d``), of ``flat`` or, near the ends of
        the dtype's range, of a copy divided by ``2**q`` (exact), released after the call."""
        layout = self.layout
        c, d = layout.c, layout.d
        if flat.numel() != d or flat.dtype != layout.dtype:
            raise ValueError(
                f"Argument 'flat' must hold {d} values of {layout.dtype}, not {flat.numel()} of {flat.dtype}."
            )
        data_exponent = scale.split()[1]
        self.chain.reset()
        source = flat
        if data_exponent:
            source = WORKSPACE.get("scaled_input", (d,), layout.dtype, layout.device)
            torch.mul(flat, math.ldexp(1.0, -data_exponent), out=source)
        columns = {}
        for a, b in layout.pieces:
            if b <= layout.full_rows:
                columns[a] = source[a * c : b * c].view(b - a, c)
            else:
                padded = WORKSPACE.get("tail", (b - a, c), layout.dtype, layout.device)
                padded.view(-1)[: d - a * c].copy_(source[a * c :])
                padded.view(-1)[d - a * c :].zero_()
                columns[a] = padded
        return CerarCall(
            flat=flat, columns=columns, data_exponent=data_exponent,
            scale=scale, write_nonfinite=write_nonfinite, chain=self.chain, next_round=layout.rounds + 1,
        )  # fmt: skip

    def _arm(self, call: CerarCall | None) -> None:
        """Hand the call to the ops bound into the program (``None``: drop it); nothing is rebound."""
        self.call = call
        self.encode.arm(call)
        self.decode.arm(call)

    # The ops bound into the program that need this call's input or state.

    def _own_maximum(self) -> None:
        assert self.call is not None  # armed by run()
        self.chain.set_own_from(self.call.flat)  # one pass over the input, while round 1 is on the wire

    def _first_round(self, a: int, out: torch.Tensor, increment: torch.Tensor) -> None:
        self.encode.first(a)
        out.copy_(increment)

    def _with_chain(self, prepare: Action, front: torch.Tensor) -> None:
        prepare()
        self.chain.write(front)


def _both(first: Action, second: Action) -> None:
    first()
    second()
