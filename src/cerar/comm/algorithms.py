"""The two ring algorithms, on the pipelined engine of :mod:`cerar.comm.transport`.

* :func:`run_cerar` executes a :class:`cerar.protocol.schedule.RankPlan`. Layout: component ``k``
  of a rank's ``d`` values takes every ``c``-th value (values ``k, k + c, k + 2c, ...``), so the
  ``(c, m)`` component matrix is the ``(m, c)`` view of the flat tensor, transposed, and column
  ``q`` mixes the ``c`` neighbouring values ``qc .. qc + c - 1``: each parameter's error is
  relative to its own values, not to the largest parameter of the bucket. A column piece
  ``[a, b)`` is the contiguous slice ``[ac, bc)``; only the last piece is copied (zero padded)
  when ``c`` does not divide ``d``.
* :func:`run_ring` is the exact reduce-scatter + all-gather ring, optionally with a 16-bit wire.

CERAR's CPU work is spread over the rounds, piece by piece, and kept off the critical path (it
runs in the engine's ``landed`` hook, once the piece's next round is on the wire):

* encode: a piece's increments (``X f_t``) are computed ``B = max(4, c / 2)`` rounds at a time,
  one ``(B, c) x (c, w)`` product on the piece's rows (:func:`encode_rounds`; MKL runs it about four
  times faster per round than a matrix-vector product per round), a batch ahead of the rounds
  that send them, so sending a piece costs one add (received piece + increment);
* decode: ``S_hat = D X + W R`` is accumulated in float64, in the ``(c, w)`` layout of the
  component matrix (a short, wide product: two to three times faster than the tall, thin
  ``(w, c)`` one), in about three groups of observation slots (:func:`slot_groups`): the own
  part and the first group when that group has landed, each later group as one ``addmm`` when
  its last slot lands; the last group's piece is then written out, so the tail after the last
  byte is one piece's last group.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cerar.coding.code import Code
from cerar.coding.precision import precision_name
from cerar.coding.scaling import ScaleWindow, scale_window
from cerar.comm import native
from cerar.comm.handshake import MaximaChain
from cerar.comm.kernels import add_rounded, own_part_target, write_transposed
from cerar.comm.native import fused_decoder, fused_encoder
from cerar.comm.stats import CommStats
from cerar.comm.transport import WORKSPACE, Action, Piece, Program, Ring, run_program, segments
from cerar.protocol.schedule import Schedule

# ---------------------------------------------------------------------------------------------
# CERAR


@dataclass(frozen=True)
class _TorchPlan:
    increments: torch.Tensor  # (L, c), float64: row t-1 is round t's increment
    decode_own: torch.Tensor  # (c, c), float64: D, so that D @ (w, c) rows^T is the piece's D X
    decode_obs: torch.Tensor  # (c, c), float64: W (column s weights observation slot s)
    first_observed_round: int


_PLANS: dict[tuple[str, int, str], _TorchPlan] = {}


def _torch_plan(code: Code, rank: int, device: torch.device) -> _TorchPlan:
    key = (code.fingerprint, rank, str(device))
    if key not in _PLANS:
        plan = Schedule.for_code(code).plan(code, rank)
        c = code.components
        decode = torch.from_numpy(plan.decode).to(device=device, dtype=torch.float64)
        _PLANS[key] = _TorchPlan(
            increments=torch.from_numpy(plan.increments).to(device=device, dtype=torch.float64),
            decode_own=decode[:, :c].contiguous(),
            decode_obs=decode[:, c:].contiguous(),
            first_observed_round=plan.first_observed_round,
        )
    return _PLANS[key]


@dataclass(frozen=True)
class _ScaledMatrices:
    """A plan's matrices as one call uses them: divided or multiplied by its rows' scale
    ``2**r`` (exact), in its dtypes, grouped as its products take them."""

    per_product: int
    batch_rows: list[torch.Tensor]  # per batch, (B, c) in the data's dtype: increments / 2**r, zero padded
    batch_of: dict[int, tuple[int, int]]  # round -> (batch, row in it)
    group_weights: dict[int, torch.Tensor]  # first slot -> (c, k) columns of W * 2**r, accumulator dtype
    group_of_last_slot: dict[int, tuple[int, int]]  # last slot -> (first, stop)
    decode_own: torch.Tensor  # (c, c) D / 2**r in the data's dtype


_SCALED: dict[tuple[str, int, str, torch.dtype, torch.dtype, int], _ScaledMatrices] = {}


def _scaled_matrices(
    code: Code, rank: int, device: torch.device, dtype: torch.dtype, acc_dtype: torch.dtype, rows_exponent: int
) -> _ScaledMatrices:
    """The call's matrices, built once per (code, rank, device, dtypes, ``r``): a call of a
    size already seen only looks them up (DDP repeats its buckets and their scales every step)."""
    key = (code.fingerprint, rank, str(device), dtype, acc_dtype, rows_exponent)
    if key not in _SCALED:
        plan = _torch_plan(code, rank, device)
        scale, c = math.ldexp(1.0, rows_exponent), code.components
        per_product = rounds_per_product(c)
        batches = round_batches(plan.increments.shape[0], per_product)
        batch_rows = []
        for first, stop in batches:
            padded = torch.zeros(per_product, c, dtype=torch.float64, device=device)
            padded[: stop - first] = plan.increments[first - 1 : stop - 1] / scale
            batch_rows.append(padded.to(dtype))
        weights = (plan.decode_obs * scale).to(acc_dtype)  # column s: slot s's weights, times 2**r
        groups = slot_groups(c)
        if len(_SCALED) >= 256:  # scales move rarely; bound the cache all the same
            _SCALED.clear()
        _SCALED[key] = _ScaledMatrices(
            per_product=per_product,
            batch_rows=batch_rows,
            batch_of={t: (j, t - first) for j, (first, stop) in enumerate(batches) for t in range(first, stop)},
            group_weights={start: weights[:, start:stop].contiguous() for start, stop in groups},
            group_of_last_slot={stop - 1: (start, stop) for start, stop in groups},
            decode_own=(plan.decode_own / scale).to(dtype),  # exact: a power of two
        )
    return _SCALED[key]


_WINDOWS: dict[tuple[str, str, str], ScaleWindow] = {}


def cerar_scale_window(code: Code, data: torch.dtype, packet: torch.dtype) -> ScaleWindow:
    """The packet scale window of ``code`` for ``data`` (the working dtype) and ``packet``
    (:func:`cerar.coding.scaling.scale_window`), once per (code, dtypes): the same on every rank."""
    key = (code.fingerprint, str(data), str(packet))
    if key not in _WINDOWS:
        gain = Schedule.for_code(code).decode_gain(code)
        _WINDOWS[key] = scale_window(code, precision_name(data), precision_name(packet), gain)
    return _WINDOWS[key]


def accumulator_dtype(packet: torch.dtype) -> torch.dtype:
    """The dtype CERAR's decode accumulates in: float32 for 16-bit packets, float64 otherwise."""
    return torch.float32 if packet in (torch.float16, torch.bfloat16) else torch.float64


def rounds_per_product(components: int) -> int:
    """Rounds whose increments one product computes: ``max(4, c // 2)``. MKL picks a much faster
    kernel for a ``(B, c) x (c, w)`` product from ``B = 4`` rows on (about four times faster per
    round than ``B = 1 .. 3``), so a batch of four costs what one round did; wider codes take
    ``c / 2`` rows (fewer passes over the input) for the same memory, half the input's size."""
    return max(4, components // 2)


def round_batches(rounds: int, per_product: int) -> list[tuple[int, int]]:
    """The rounds ``[first, stop)`` whose increments are computed together, ``per_product`` at
    a time (the last batch may be shorter; it is computed padded)."""
    return [(first, min(first + per_product, rounds + 1)) for first in range(1, rounds + 1, per_product)]


def encode_rounds(rows: torch.Tensor, piece: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """A batch of rounds' increments of one piece: ``out = rows @ piece^T`` (``rows`` the
    batch's ``(B, c)`` increment rows, zero padded to :func:`rounds_per_product`; ``piece`` the
    piece's ``(w, c)`` values; ``out`` ``(B, w)``, row ``r`` the batch's ``r``-th round)."""
    return torch.mm(rows, piece.t(), out=out)


def own_part(decode_own: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The own part ``D X`` of one piece's sum, divided by the packet scale: ``out =
    decode_own @ rows^T`` (``decode_own`` ``D / scale``, ``rows`` the piece's ``(w, c)`` values,
    ``out`` ``(c, w)``), in ``rows``' dtype. float32 suffices for it: the own rows are exact, so
    on i.i.d. data the decoded error is within 0.3% of a float64 own part's, while the
    observations' part needs float64 (about 9% more error in float32); and it saves a widening
    copy and a float64 product. Divided by the scale, it lies in the packets' range, so huge
    inputs do not overflow float32 in it."""
    return torch.mm(decode_own, rows.t(), out=out)


def fold_slots(
    total: torch.Tensor, arrived: torch.Tensor, weights: torch.Tensor, start: torch.Tensor | None = None,
    scale: float = 1.0,
) -> None:  # fmt: skip
    """Fold a group of ``k`` observation slots of one piece into the sum ``total`` (``(c, w)``,
    the piece's component matrix, in the accumulator's dtype: float64, float32 for 16-bit
    packets): ``total += weights @ arrived`` (``weights`` the group's ``(c, k)`` columns of ``W``,
    times ``scale``; ``arrived`` ``(k, w)`` in the same dtype). With
    ``start`` (the piece's :func:`own_part`) the accumulator starts from it, times ``scale`` (a
    power of two: exact): ``total = scale start + weights @ arrived``."""
    if start is None:
        total.addmm_(weights, arrived)
    else:  # widened first (start * scale may overflow start's dtype), then scaled by the product's beta
        total.copy_(start)
        total.addmm_(weights, arrived, beta=scale)


def slot_groups(components: int) -> list[tuple[int, int]]:
    """The observation slots folded together, ``[(first, stop), ...]``: about three groups, the
    last the smallest, so that the accumulator is streamed three times (a rank-1 update per
    slot streamed it ``c`` times, and the folds are memory-bound) and the work
    left after the last round lands is the last group's."""
    size = max(2, math.ceil(components / 3))
    return [(start, min(start + size, components)) for start in range(0, components, size)]


#: ``accept(maxima)``: given every rank's ``max|x|`` (``inf``: NaN/Inf), whether to write the
#: decoded sum. The same list reaches every rank, so every rank decides the same.
Accept = Callable[[list[float]], bool]


@dataclass(frozen=True)
class CerarOutcome:
    """What one :class:`CerarRun` found: every rank's ``max|x|`` and whether the sum was
    written (if not, the input is intact)."""

    maxima: list[float]
    written: bool


def run_cerar(
    flat: torch.Tensor,
    code: Code,
    ring: Ring,
    stats: CommStats,
    accept: Accept | None = None,
    *,
    scale_exponents: tuple[int, int] = (0, 0),
    packet_dtype: torch.dtype | None = None,
) -> CerarOutcome:
    """Run CERAR on this rank's contiguous 1-d ``flat`` (float32 or float64) and write the
    decoded sum into it if ``accept`` (default: always) agrees; see :class:`CerarRun`."""
    return CerarRun.for_call(flat, code, ring, scale_exponents[0], packet_dtype).run(
        stats, flat, accept, scale_exponents[1]
    )


_MAX_BOUND_LAYOUTS = 64  # DDP has a few dozen buckets at most; other callers' sizes are bounded too


class CerarRun:
    """CERAR on this rank for one layout (code, ring, size, dtypes, rows' scale): its buffers and
    the :class:`cerar.comm.transport.Program` of its rounds, bound once and kept while the
    workspace keeps its buffers (DDP repeats its buckets every step), then run for each call.

    1. While round 1 is on the wire, one pass over the input finds its ``max|x|`` (``inf`` for
       NaN/Inf, :meth:`_own_maximum`); :class:`cerar.comm.handshake.MaximaChain` carries every
       rank's in front of the first piece of rounds ``2 .. N`` (no message of its own).
    2. Each piece's increments are computed ``max(4, c / 2)`` rounds at a time, a batch ahead
       (in the piece's ``landed``), from ``X / s``: ``s = 2**(r + q)`` for ``scale_exponents =
       (r, q)`` (:meth:`cerar.coding.scaling.ScaleWindow.split`), ``2**r`` folded into the
       increment rows and the decoder (exact, and free), ``2**q`` (0 but near the ends of the
       dtype's range) dividing a copy of the input. Sending a piece (its ``prepare``) adds its
       round's increment to what arrived, in ``packet_dtype`` (default ``flat``'s dtype; a 16-bit
       packet is computed in ``flat``'s dtype and rounded once): the critical path is that one add.
    3. Observations arrive straight into their slot and are folded into a float64 accumulator
       (float32 for 16-bit packets) a group of slots at a time, times ``2**r`` (:meth:`_fold`,
       once the piece's next round is on the wire).
    4. When the last round's piece lands, the chain has long completed: ``accept(maxima)``
       decides, the same on every rank, and the piece's sum, times ``2**q``, is written (or
       nothing is, and ``flat`` keeps its input for the caller's fallback or redo).

    What belongs to one call (the input's views, the chain's values, the decision) is set by
    :meth:`run` and dropped when it returns: a kept layout holds no caller's tensor.
    """

    @classmethod
    def for_call(
        cls, flat: torch.Tensor, code: Code, ring: Ring, rows_exponent: int = 0, packet_dtype: torch.dtype | None = None
    ) -> CerarRun:
        """The run of ``flat``'s layout: the one kept in the workspace, or a new one (kept)."""
        packet = packet_dtype or flat.dtype
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
        m = math.ceil(d / c)
        plan = _torch_plan(code, ring.rank, device)
        self.rounds = plan.increments.shape[0]
        self.first_observed = plan.first_observed_round
        self.rows_scale = math.ldexp(1.0, rows_exponent)  # |r| stays far inside float64
        # The sum accumulates in the precision the packets need: float64 for float32/float64
        # packets, float32 for 16-bit ones, whose own rounding dwarfs float32's.
        self.acc_dtype = accumulator_dtype(packet)
        scaled = _scaled_matrices(code, ring.rank, device, dtype, self.acc_dtype, rows_exponent)
        self.batch_rows, self.batch_of = scaled.batch_rows, scaled.batch_of
        self.group_weights, self.group_of_last_slot = scaled.group_weights, scaled.group_of_last_slot
        self.decode_own = scaled.decode_own
        # On the CPU the coding is compiled where a compiler was found (cerar.comm.native): the
        # decode one pass per piece, the encode every round's increment of a piece in one pass;
        # elsewhere the torch ops below, a group of slots and a batch of rounds at a time.
        self.decoder = fused_decoder(plan.decode_own, plan.decode_obs * self.rows_scale, dtype, packet, device)
        self.encoder = fused_encoder(plan.increments / self.rows_scale, dtype, device)  # exact: a power of two
        self.pieces = segments(m, torch.empty((), dtype=packet).element_size())
        widest = max((b - a for a, b in self.pieces), default=0)
        # Every packet row starts with the maxima chain's front (8 N bytes), sent only by the
        # first piece of rounds 2 .. N; the values follow it.
        self.chain = MaximaChain(ring, device, packet)
        f = self.front = self.chain.front
        self.send = WORKSPACE.get("send", (2, f + m), packet, device)
        self.recv = WORKSPACE.get("recv", (2, f + m), packet, device)  # rounds before the first observation
        # Observation rounds receive straight into their slot (kept until the slot's group is
        # folded, or the compiled decode reads them all); rounds before them into two
        # alternating scratch packets.
        self.observations = WORKSPACE.get("observations", (c, f + m), packet, device)
        # Per piece (keyed by its first column): its increments, contiguous: every round's (L, w)
        # with the compiled encode (the input read once), else a batch's (B, w) at a time.
        rows = self.rounds if self.encoder is not None else scaled.per_product
        increments = WORKSPACE.get("increments", (rows * m,), dtype, device)
        self.increments = {a: increments[rows * a : rows * b].view(rows, b - a) for a, b in self.pieces}
        self.totals: dict[int, torch.Tensor] = {}
        self.own_targets: dict[int, torch.Tensor] = {}
        self.folds: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        if self.decoder is None:  # the torch ops' scratch: the fused decode needs none
            own = WORKSPACE.get("own_part", (c, widest), dtype, device)
            deepest = max(stop - start for start, stop in slot_groups(c))
            arrived = WORKSPACE.get("arrived", (deepest, widest), self.acc_dtype, device)
            totals = WORKSPACE.get("decoded", (c * m,), self.acc_dtype, device)
            # Per piece: its sum (c, w) in the accumulator's dtype, contiguous; the own part's
            # target; per group of slots, the scratch it is widened into and the slots it reads.
            self.totals = {a: totals[c * a : c * b].view(c, b - a) for a, b in self.pieces}
            self.own_targets = {a: own_part_target(self.totals[a], own[:, : b - a]) for a, b in self.pieces}
            self.folds = {
                (a, start): (arrived[: stop - start, : b - a], self.observations[start:stop, f + a : f + b])
                for a, b in self.pieces
                for start, stop in slot_groups(c)
            }
        self.program = self._bind(packet != dtype)
        # The chain's bytes, sent inside data packets: not counted as data.
        carrying = sum(self.chain.carries(t, self.rounds) for t in range(1, self.rounds + 1)) if self.pieces else 0
        self.control_bytes = carrying * f * self.send.element_size()
        # One call's state, set by run().
        self.flat: torch.Tensor | None = None
        self.accept: Accept | None = None
        self.data_exponent = 0
        self.columns: dict[int, torch.Tensor] = {}
        self.encode_s = self.decode_s = self.coding_cpu_s = 0.0
        self.maxima: list[float] = []
        self.written: bool | None = None  # decided once, after the last round

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
                increment = self.increments[a][t - 1 if self.encoder is not None else self.batch_of[t][1]]
                prepare: Action
                if t == 1:  # the piece's first batch, while earlier pieces are on the wire
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
        the wire: the next batch of increments if round ``t + 1`` used the batch's last row (the
        next batch is needed from round ``t + 2``), and the fold of a group of slots that this
        observation completes."""
        upcoming = self.batch_of.get(t + 2) if self.encoder is None else None  # else all encoded in round 1
        batch = upcoming[0] if upcoming is not None and upcoming[1] == 0 else None
        fold: Action | None
        if self.decoder is not None:  # the whole decode in one pass, once the last slot is in
            fold = functools.partial(self._fused_decode, a, b) if t == self.rounds else None
        else:
            group = self.group_of_last_slot.get(t - self.first_observed)
            fold = None if group is None else functools.partial(self._fold, t, a, b, group)
        if batch is None:
            return fold
        encode = functools.partial(self._encode_batch, batch, a)
        return encode if fold is None else functools.partial(_both, encode, fold)

    def run(
        self,
        stats: CommStats,
        flat: torch.Tensor,
        accept: Accept | None = None,
        data_exponent: int = 0,
        gate: Action | None = None,
    ) -> CerarOutcome:
        """One call on ``flat`` (this layout's size and dtype): the rounds, then the decision.
        ``gate`` runs once round 1 is on the wire (:func:`cerar.comm.transport.run_program`)."""
        self._arm(flat, accept, data_exponent)
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
            self.flat, self.accept, self.columns = None, None, {}

    def _arm(self, flat: torch.Tensor, accept: Accept | None, data_exponent: int) -> None:
        """This call's state: the input's rows per piece as ``(w, c)`` views (the last piece
        copied and zero padded if ``c`` does not divide ``d``), of ``flat`` or, near the ends of
        the dtype's range, of a copy divided by ``2**q`` (exact), released after the call."""
        if flat.numel() != self.d or flat.dtype != self.dtype:
            raise ValueError(
                f"Argument 'flat' must hold {self.d} values of {self.dtype}, not {flat.numel()} of {flat.dtype}."
            )
        self.flat, self.accept, self.data_exponent = flat, accept, data_exponent
        self.encode_s = self.decode_s = self.coding_cpu_s = 0.0
        self.maxima, self.written = [], None
        self.chain.reset()
        c, d = self.c, self.d
        source = flat
        if data_exponent:
            source = WORKSPACE.get("scaled_input", (d,), self.dtype, self.device)
            torch.mul(flat, math.ldexp(1.0, -data_exponent), out=source)
        self.columns = {}
        for a, b in self.pieces:
            if b <= self.full_rows:
                self.columns[a] = source[a * c : b * c].view(b - a, c)
            else:
                padded = WORKSPACE.get("tail", (b - a, c), self.dtype, self.device)
                padded.view(-1)[: d - a * c].copy_(source[a * c :])
                padded.view(-1)[d - a * c :].zero_()
                self.columns[a] = padded

    def decide(self) -> bool:
        """Whether to write the sum: ``accept(maxima)``, the same on every rank, asked once."""
        if self.written is None:
            self.maxima.extend(self.chain.maxima(self.rounds + 1))
            self.written = self.accept is None or self.accept(self.maxima)
        return self.written

    # The ops bound into the program that need this call's input or state.

    def _own_maximum(self) -> None:
        self.chain.set_own_from(self.flat)  # one pass over the input, while round 1 is on the wire

    def _first_round(self, a: int, out: torch.Tensor, increment: torch.Tensor) -> None:
        if self.encoder is not None:
            began, cpu = time.perf_counter(), time.thread_time()
            self.encoder.encode(self.columns[a], self.increments[a])
            self.encode_s += time.perf_counter() - began
            self.coding_cpu_s += time.thread_time() - cpu
        else:
            self._encode_batch(0, a)
        out.copy_(increment)

    def _with_chain(self, prepare: Action, front: torch.Tensor) -> None:
        prepare()
        self.chain.write(front)

    def _encode_batch(self, j: int, a: int) -> None:
        """Batch ``j``'s increments of the piece starting at column ``a``."""
        began, cpu = time.perf_counter(), time.thread_time()
        encode_rounds(self.batch_rows[j], self.columns[a], self.increments[a])
        self.encode_s += time.perf_counter() - began
        self.coding_cpu_s += time.thread_time() - cpu

    def _fused_decode(self, a: int, b: int) -> None:
        """The piece's sum in one compiled pass (:mod:`cerar.comm.native`), written over its
        input, times ``2**q``, if :meth:`decide` says so; otherwise nothing is read or written."""
        if not self.decide():
            return
        began, cpu = time.perf_counter(), time.thread_time()
        c, d, rows = self.c, self.d, self.columns[a]
        out = rows
        if self.data_exponent and b <= self.full_rows:  # the scaled copy's pieces are not flat's
            out = self.flat[a * c : b * c].view(b - a, c)
        f = self.front
        assert self.decoder is not None
        self.decoder.decode(rows, self.observations[:, f + a : f + b], math.ldexp(1.0, self.data_exponent), out)
        if b > self.full_rows:  # the copied last piece: its values back into flat
            self.flat[a * c :].copy_(out.view(-1)[: d - a * c])
        self.decode_s += time.perf_counter() - began
        self.coding_cpu_s += time.thread_time() - cpu

    def _fold(self, t: int, a: int, b: int, group: tuple[int, int]) -> None:
        """Fold a group of slots into the piece's sum (the own part ``D X`` with the first); after
        the last round, write the sum if :meth:`decide` says so."""
        began, cpu = time.perf_counter(), time.thread_time()
        start, _ = group
        acc = self.totals[a]
        arrived, observed = self.folds[(a, start)]
        arrived.copy_(observed)
        # The own part straight into the accumulator where the dtypes agree (16-bit packets).
        begin = own_part(self.decode_own, self.columns[a], self.own_targets[a]) if start == 0 else None
        fold_slots(acc, arrived, self.group_weights[start], begin, self.rows_scale)
        if t == self.rounds and self.decide():
            c, d, out = self.c, self.d, self.columns[a]
            if self.data_exponent and b <= self.full_rows:  # the scaled copy's pieces are not flat's
                out = self.flat[a * c : b * c].view(b - a, c)
            write_transposed(acc, out)
            scale_by_power_of_two(out, self.data_exponent)  # exact, in the data's dtype
            if b > self.full_rows:  # the copied last piece: its values back into flat
                self.flat[a * c :].copy_(out.view(-1)[: d - a * c])
        self.decode_s += time.perf_counter() - began
        self.coding_cpu_s += time.thread_time() - cpu


def _both(first: Action, second: Action) -> None:
    first()
    second()


def _round_to(values: torch.Tensor, wire: torch.dtype) -> None:
    values.copy_(values.to(wire))


def _add_widened(into: torch.Tensor, arrived: torch.Tensor, widened: torch.Tensor) -> None:
    widened.copy_(arrived)
    into.add_(widened)


# ---------------------------------------------------------------------------------------------
# Exact ring


def scale_by_power_of_two(tensor: torch.Tensor, exponent: int) -> None:
    """``tensor *= 2**exponent`` in place, exactly while the results stay normal: in steps that
    the tensor's dtype can hold as a scalar (``2**161`` is not a float32, and ``2**1090`` not even
    a float64), none for ``exponent = 0``."""
    limit = math.frexp(torch.finfo(tensor.dtype).max)[1] - 2  # 126 for float32, 1022 for float64
    while exponent:
        step = max(-limit, min(limit, exponent))
        tensor.mul_(math.ldexp(1.0, step))
        exponent -= step


def run_ring(
    flat: torch.Tensor,
    ring: Ring,
    stats: CommStats,
    wire_dtype: torch.dtype | None = None,
    scale_exponent: int = 0,
) -> torch.Tensor:
    """Exact ring all-reduce (reduce-scatter then all-gather) of the contiguous 1-d ``flat``,
    in place. With ``wire_dtype`` the chunks travel in that dtype and are accumulated in
    ``flat``'s dtype; the values are divided by ``2**scale_exponent`` before the ring and
    multiplied back after (exact), to keep float16 sums in range."""
    n = ring.size
    d = flat.numel()
    chunk = math.ceil(d / n)
    wire = wire_dtype or flat.dtype
    if d == n * chunk:
        padded = flat
    else:
        padded = WORKSPACE.get("ring_padded", (n * chunk,), flat.dtype, flat.device)
        padded[:d].copy_(flat)
        padded[d:].zero_()
    scale_by_power_of_two(padded, -scale_exponent)
    chunks = padded.view(n, chunk)
    send = WORKSPACE.get("ring_send", (2, chunk), wire, flat.device)
    recv = WORKSPACE.get("ring_recv", (2, chunk), wire, flat.device)
    widened = WORKSPACE.get("ring_widened", (chunk,), flat.dtype, flat.device) if wire != flat.dtype else None
    r = ring.rank
    owned = (r + 1) % n  # fully reduced here after the reduce-scatter
    rounds = []
    for t in range(1, 2 * (n - 1) + 1):
        pieces = []
        for a, b in segments(chunk, flat.element_size()):
            out, arrived = send[t % 2, a:b], recv[t % 2, a:b]
            index = (r - t + 1) % n if t < n else (r + 1 - (t - n)) % n
            prepare: Action = functools.partial(out.copy_, chunks[index, a:b])
            if t == n and wire != flat.dtype:
                # Every rank must end with the same values: the owner keeps what it sends.
                prepare = functools.partial(_both, functools.partial(_round_to, chunks[owned, a:b], wire), prepare)
            received: Action
            if t < n:  # reduce-scatter: accumulate in flat's dtype
                into = chunks[(r - t) % n, a:b]
                if widened is not None:
                    received = functools.partial(_add_widened, into, arrived, widened[a:b])
                else:
                    received = functools.partial(into.add_, arrived)
            else:  # all-gather: take the owner's values
                received = functools.partial(chunks[(r - (t - n)) % n, a:b].copy_, arrived)
            pieces.append(Piece(out, arrived, prepare, received))
        rounds.append(pieces)
    run_program(ring, stats, Program(rounds, flat.device))
    scale_by_power_of_two(padded, scale_exponent)
    if padded is not flat:
        flat.copy_(padded[:d])
    stats.peak_extra_bytes = max(stats.peak_extra_bytes, WORKSPACE.held_bytes)
    return flat
