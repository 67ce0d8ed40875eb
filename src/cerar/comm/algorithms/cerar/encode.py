"""CERAR's encode on one rank: every round's increment ``X f_t`` of each piece, computed ahead of
the round that sends it, by one of two small objects :class:`cerar.comm.algorithms.cerar.run.CerarRun`
chooses between (built on the layout, :class:`cerar.comm.algorithms.cerar.state.CerarLayout`, and
armed with each call, :class:`cerar.comm.algorithms.cerar.state.CerarCall`):

* :class:`CompiledEncode`: every round's increments of a piece in one pass over its input, in
  round 1 (:mod:`cerar.comm.algorithms.native`, CPU float32, codes of 8, 16, 24 or 32 components);
* :class:`BatchedEncode`: the torch ops, ``B = max(4, c / 2)`` rounds at a time, one ``(B, c) x
  (c, w)`` product on the piece's rows (MKL runs it about four times faster per round than a
  matrix-vector product per round), a batch ahead of the rounds that send them.

Sending a piece then costs one add (received piece + increment, :func:`add_rounded` for a 16-bit
packet). Both time themselves into the call's ``encode_s`` and ``coding_cpu_s``.
"""

from __future__ import annotations

import functools
import time

import torch

from cerar.comm.algorithms.cerar.plans import ScaledMatrices
from cerar.comm.algorithms.cerar.state import Armed, CerarLayout
from cerar.comm.algorithms.native import FusedEncoder
from cerar.comm.algorithms.workspace import WORKSPACE
from cerar.comm.runtime.engine import Action

__all__ = ["BatchedEncode", "CompiledEncode", "add_rounded", "encode_rounds"]


def encode_rounds(rows: torch.Tensor, piece: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """A batch of rounds' increments of one piece: ``out = rows @ piece^T`` (``rows`` the
    batch's ``(B, c)`` increment rows, zero padded to
    :func:`cerar.comm.algorithms.cerar.plans.rounds_per_product`; ``piece`` the piece's ``(w, c)`` values;
    ``out`` ``(B, w)``, row ``r`` the batch's ``r``-th round)."""
    return torch.mm(rows, piece.t(), out=out)


def add_rounded(increment: torch.Tensor, received: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = received + increment``, computed in the wider of the two dtypes and rounded once
    to ``out``'s: with 16-bit packets (``received`` and ``out`` float16 or bfloat16,
    ``increment`` float32) bitwise ``torch.add(increment, received, out=f32); out.copy_(f32)``,
    in one pass and without ``f32`` (type promotion computes the sum in float32 and rounds it
    once on the store). Returns ``out``."""
    return torch.add(increment, received, out=out)


def _increments(layout: CerarLayout, rows: int) -> dict[int, torch.Tensor]:
    """Per piece (keyed by its first column): its ``(rows, w)`` increments, contiguous."""
    held = WORKSPACE.get("increments", (rows * layout.m,), layout.dtype, layout.device)
    return {a: held[rows * a : rows * b].view(rows, b - a) for a, b in layout.pieces}


class CompiledEncode(Armed):
    """Every round's increments of a piece, in round 1, in one compiled pass (the input read once)."""

    __slots__ = ("encoder", "increments")

    def __init__(self, layout: CerarLayout, encoder: FusedEncoder) -> None:
        super().__init__()
        self.encoder = encoder
        self.increments = _increments(layout, layout.rounds)

    def increment(self, a: int, t: int) -> torch.Tensor:
        """Round ``t``'s increment row of the piece starting at column ``a``."""
        return self.increments[a][t - 1]

    def first(self, a: int) -> None:
        call = self.call
        assert call is not None  # armed by the run for its call
        began, cpu = time.perf_counter(), time.thread_time()
        self.encoder.encode(call.columns[a], self.increments[a])
        call.times.encode_s += time.perf_counter() - began
        call.times.coding_cpu_s += time.thread_time() - cpu

    def landed(self, t: int, a: int) -> Action | None:
        return None  # all encoded in round 1


class BatchedEncode(Armed):
    """The torch ops: a batch of rounds' increments at a time, a batch ahead (see the module doc)."""

    __slots__ = ("batch_of", "batch_rows", "increments")

    def __init__(self, layout: CerarLayout, scaled: ScaledMatrices) -> None:
        super().__init__()
        self.batch_rows, self.batch_of = scaled.batch_rows, scaled.batch_of
        self.increments = _increments(layout, scaled.per_product)

    def increment(self, a: int, t: int) -> torch.Tensor:
        return self.increments[a][self.batch_of[t][1]]

    def first(self, a: int) -> None:
        self.batch(0, a)

    def landed(self, t: int, a: int) -> Action | None:
        """Once round ``t``'s piece has landed: the next batch if round ``t + 1`` used the
        batch's last row (the next batch is needed from round ``t + 2``)."""
        upcoming = self.batch_of.get(t + 2)
        if upcoming is None or upcoming[1] != 0:
            return None
        return functools.partial(self.batch, upcoming[0], a)

    def batch(self, j: int, a: int) -> None:
        """Batch ``j``'s increments of the piece starting at column ``a``."""
        call = self.call
        assert call is not None  # armed by the run for its call
        began, cpu = time.perf_counter(), time.thread_time()
        encode_rounds(self.batch_rows[j], call.columns[a], self.increments[a])
        call.times.encode_s += time.perf_counter() - began
        call.times.coding_cpu_s += time.thread_time() - cpu
