"""CERAR's decode on one rank: each piece's sum ``S_hat = D X + W R``, by one of two small objects
:class:`cerar.comm.algorithms.cerar.run.CerarRun` chooses between (built on the layout,
:class:`cerar.comm.algorithms.cerar.state.CerarLayout`, and armed with each call,
:class:`cerar.comm.algorithms.cerar.state.CerarCall`):

* :class:`CompiledDecode`: the whole sum of a piece in one compiled pass once its last
  observation lands (:mod:`cerar.comm.algorithms.native`, CPU float32, up to 32 components);
* :class:`FoldedDecode`: the torch ops, accumulated in float64 (float32 for 16-bit packets) in the
  ``(c, w)`` layout of the component matrix (a short, wide product: two to three times faster
  than the tall, thin ``(w, c)`` one), about three groups of observation slots at a time
  (:func:`cerar.comm.algorithms.cerar.plans.slot_groups`): the own part and the first group when that
  group has landed, each later group as one ``addmm`` when its last slot lands, so the tail
  after the last byte is one piece's last group.

Both write the piece's sum, times ``2**q`` (the scale of a copied input), over its input only
if :meth:`cerar.comm.algorithms.cerar.state.CerarCall.decide` says so, and time themselves into the
call's ``decode_s`` and ``coding_cpu_s``. Three one-pass forms save a pass each and return,
bitwise, what the separate passes they replace return: :func:`own_part_target`,
:func:`write_transposed` and :func:`cerar.comm.algorithms.cerar.encode.add_rounded`. (Compiled kernels from
``torch.compile`` were measured too and not kept: each call pays dynamo's guard checks, more
than a piece's fused pass saves, and its folds were slower than MKL's ``addmm``.)
"""

from __future__ import annotations

import functools
import math
import time

import torch

from cerar.comm.algorithms.cerar.plans import ScaledMatrices, slot_groups
from cerar.comm.algorithms.cerar.state import Armed, CerarCall, CerarLayout
from cerar.comm.algorithms.native import FusedDecoder
from cerar.comm.algorithms.workspace import WORKSPACE
from cerar.comm.runtime.engine import Action

__all__ = [
    "CompiledDecode",
    "FoldedDecode",
    "fold_slots",
    "own_part",
    "own_part_target",
    "scale_by_power_of_two",
    "write_transposed",
]


def own_part(decode_own: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The own part ``D X`` of one piece's sum, divided by the packet scale: ``out =
    decode_own @ rows^T`` (``decode_own`` ``D / scale``, ``rows`` the piece's ``(w, c)`` values,
    ``out`` ``(c, w)``), in ``rows``' dtype. float32 suffices for it: the own rows are exact, so
    on i.i.d. data the decoded error is within 0.3% of a float64 own part's, while the
    observations' part needs float64 (about 9% more error in float32); and it saves a widening
    copy and a float64 product. Divided by the scale, it lies in the packets' range, so huge
    inputs do not overflow float32 in it."""
    return torch.mm(decode_own, rows.t(), out=out)


def own_part_target(total: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """Where to compute a piece's own part ``D X`` (``own``: the ``(c, w)`` scratch, in the data's
    dtype): straight into the accumulator ``total`` when it has that dtype (a float32 sum with
    16-bit packets), so that :func:`fold_slots`'s ``total.copy_(start)`` copies nothing (``copy_``
    of a tensor onto itself returns at once) and a pass is saved; else ``own``, which that copy
    widens (a float64 sum with float32 packets)."""
    return total if total.dtype == own.dtype else own


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


def write_transposed(total: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = total^T`` (``total`` a piece's ``(c, w)`` sum, ``out`` its ``(w, c)`` rows, in the
    data's dtype): bitwise ``out.copy_(total.t())``, written through ``out``'s transposed view
    (with both float32, ``out.copy_(total.t())`` takes the CPU's element-by-element transpose copy,
    ``out.t().copy_(total)`` the vectorized strided loops). Returns ``out``."""
    out.t().copy_(total)
    return out


def scale_by_power_of_two(tensor: torch.Tensor, exponent: int) -> None:
    """``tensor *= 2**exponent`` in place, exactly while the results stay normal: in steps that
    the tensor's dtype can hold as a scalar (``2**161`` is not a float32, and ``2**1090`` not even
    a float64), none for ``exponent = 0``."""
    limit = math.frexp(torch.finfo(tensor.dtype).max)[1] - 2  # 126 for float32, 1022 for float64
    while exponent:
        step = max(-limit, min(limit, exponent))
        tensor.mul_(math.ldexp(1.0, step))
        exponent -= step


def _output(layout: CerarLayout, call: CerarCall, a: int, b: int) -> torch.Tensor:
    """Where piece ``[a, b)``'s sum is written: its rows, or flat's where the rows are the scaled
    copy's (the last, copied piece is written back by :func:`_write_back`)."""
    c, out = layout.c, call.columns[a]
    if call.data_exponent and b <= layout.full_rows:
        out = call.flat[a * c : b * c].view(b - a, c)
    return out


def _write_back(layout: CerarLayout, call: CerarCall, a: int, b: int, out: torch.Tensor) -> None:
    if b > layout.full_rows:  # the copied last piece: its values back into flat
        call.flat[a * layout.c :].copy_(out.view(-1)[: layout.d - a * layout.c])


class CompiledDecode(Armed):
    """A piece's whole sum in one compiled pass, once its last slot is in."""

    __slots__ = ("decoder", "layout")

    def __init__(self, layout: CerarLayout, decoder: FusedDecoder) -> None:
        super().__init__()
        self.layout, self.decoder = layout, decoder

    def landed(self, t: int, a: int, b: int) -> Action | None:
        return functools.partial(self.decode, a, b) if t == self.layout.rounds else None

    def decode(self, a: int, b: int) -> None:
        """The piece's sum written over its input, times ``2**q``, if the call decides to write;
        otherwise nothing is read or written."""
        layout, call = self.layout, self.call
        assert call is not None  # armed by the run for its call
        if not call.decide():
            return
        began, cpu = time.perf_counter(), time.thread_time()
        out = _output(layout, call, a, b)
        f = layout.front
        observed = layout.observations[:, f + a : f + b]
        self.decoder.decode(call.columns[a], observed, math.ldexp(1.0, call.data_exponent), out)
        _write_back(layout, call, a, b, out)
        call.times.decode_s += time.perf_counter() - began
        call.times.coding_cpu_s += time.thread_time() - cpu


class FoldedDecode(Armed):
    """The torch ops: a group of slots folded into the piece's sum as its last slot lands."""

    __slots__ = ("decode_own", "folds", "group_of_last_slot", "group_weights", "layout", "own_targets", "totals")

    def __init__(self, layout: CerarLayout, scaled: ScaledMatrices) -> None:
        super().__init__()
        self.layout = layout
        self.group_weights, self.group_of_last_slot = scaled.group_weights, scaled.group_of_last_slot
        self.decode_own = scaled.decode_own
        c, f, acc, device = layout.c, layout.front, layout.acc_dtype, layout.device
        widest = max((b - a for a, b in layout.pieces), default=0)
        own = WORKSPACE.get("own_part", (c, widest), layout.dtype, device)
        deepest = max(stop - start for start, stop in slot_groups(c))
        arrived = WORKSPACE.get("arrived", (deepest, widest), acc, device)
        totals = WORKSPACE.get("decoded", (c * layout.m,), acc, device)
        # Per piece: its sum (c, w) in the accumulator's dtype, contiguous; the own part's target;
        # per group of slots, the scratch it is widened into and the slots it reads.
        self.totals = {a: totals[c * a : c * b].view(c, b - a) for a, b in layout.pieces}
        self.own_targets = {a: own_part_target(self.totals[a], own[:, : b - a]) for a, b in layout.pieces}
        self.folds = {
            (a, start): (arrived[: stop - start, : b - a], layout.observations[start:stop, f + a : f + b])
            for a, b in layout.pieces
            for start, stop in slot_groups(c)
        }

    def landed(self, t: int, a: int, b: int) -> Action | None:
        group = self.group_of_last_slot.get(t - self.layout.first_observed)
        return None if group is None else functools.partial(self.fold, t, a, b, group)

    def fold(self, t: int, a: int, b: int, group: tuple[int, int]) -> None:
        """Fold a group of slots into the piece's sum (the own part ``D X`` with the first); after
        the last round, write the sum if the call decides to."""
        layout, call = self.layout, self.call
        assert call is not None  # armed by the run for its call
        began, cpu = time.perf_counter(), time.thread_time()
        start, _ = group
        acc = self.totals[a]
        arrived, observed = self.folds[(a, start)]
        arrived.copy_(observed)
        # The own part straight into the accumulator where the dtypes agree (16-bit packets).
        begin = own_part(self.decode_own, call.columns[a], self.own_targets[a]) if start == 0 else None
        fold_slots(acc, arrived, self.group_weights[start], begin, layout.rows_scale)
        if t == layout.rounds and call.decide():
            out = _output(layout, call, a, b)
            write_transposed(acc, out)
            scale_by_power_of_two(out, call.data_exponent)  # exact, in the data's dtype
            _write_back(layout, call, a, b, out)
        call.times.decode_s += time.perf_counter() - began
        call.times.coding_cpu_s += time.thread_time() - cpu
