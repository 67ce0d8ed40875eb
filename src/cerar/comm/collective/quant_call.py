"""One call of the 8-bit ring (:func:`quant_ring_call`), as :func:`cerar.comm.collective.call.ring_call`
is one of the exact ring: the handshake before any data, then the non-finite policy, decided the
same on every rank before data moves, then the rounds (:func:`cerar.comm.kernels.quant_ring.run_quantized_ring`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from cerar.coding.blocks import BlockFormat
from cerar.comm.collective.call import NonFiniteError, _items, call_context
from cerar.comm.kernels import native
from cerar.comm.kernels.quant_ring import run_quantized_ring
from cerar.comm.kernels.ring_run import run_ring
from cerar.comm.ring.handshake import Proposal, Summary, handshake, settings_hash
from cerar.comm.ring.links import Ring
from cerar.comm.ring.maxima import max_abs
from cerar.comm.ring.stats import CommStats

__all__ = ["quant_ring_call"]


def quant_ring_call(
    tensor: torch.Tensor,
    op: str,
    ring: Ring,
    fmt: BlockFormat,
    nonfinite: str,
    stats: CommStats | None,
    context: Mapping[str, Any] | None = None,
) -> None:
    """One 8-bit ring call on ``tensor`` (``op`` ``"sum"`` or ``"avg"``); ``context`` as
    :func:`cerar.comm.collective.call.cerar_call`'s.

    Every rank's ``max|x|`` (infinite for NaN/Inf) travels in the handshake, with the highest
    group rank whose input is not finite (the proposal's exponent field, which this call does
    not otherwise use: the handshake keeps the largest); so before any data moves every rank
    knows whether some rank's input is not finite, and which one at least. Then ``nonfinite``:
    ``"raise"`` raises :class:`cerar.comm.collective.call.NonFiniteError` on every rank;
    ``"exact"`` runs the exact float32 ring instead (counted in ``fallbacks``); ``"ignore"``
    runs the 8-bit ring, where a NaN or Inf makes its block NaN on every rank and nothing else.
    A float64 tensor travels as float32 (the format's values), written back as float64.
    """
    with call_context(tensor, ring, stats) as (flat, call, counter):
        if ring.size == 1:
            return
        identity = ("ring-q8", str(tensor.dtype), fmt.wire, fmt.block, fmt.scale, flat.numel(), op, nonfinite)
        identity += _items(context)
        summary: Summary = (
            f"8-bit ring, values {tensor.dtype}, wire {fmt.describe()}, size {flat.numel()}, op {op}, "
            f"nonfinite={nonfinite!r}"
        )
        if context is not None:
            summary = {**context, "method": f"ring, wire {fmt.describe()}"}
        native.warm(flat.device, torch.float32)  # a machine's first build, before the ranks line up
        own = max_abs(flat)  # one pass, read on the host: before the rounds, not inside them
        me = ring.peers[ring.rank] if ring.peers else ring.rank
        proposal = Proposal(own, 0 if math.isfinite(own) else me + 1)
        agreed = handshake(ring, settings_hash(identity), counter, summary, proposal, device=flat.device, stats=call)
        if not math.isfinite(agreed.max_abs):
            call.nonfinite_events += 1
            if nonfinite == "raise":
                mine = "is not" if not math.isfinite(own) else "is"
                raise NonFiniteError(
                    f"cerar.all_reduce: NaN or Inf in the input of group rank {agreed.scale_exponent - 1} (the "
                    f"highest-numbered such rank; group rank {me}'s input {mine} finite); the 8-bit ring would "
                    f"make each block that holds one NaN on every rank. Pass nonfinite='exact' to fall back to "
                    f"the exact ring instead, or nonfinite='ignore' to let those blocks be NaN."
                )
            if nonfinite == "exact":
                call.fallbacks += 1
                run_ring(flat, ring, call)
                if op == "avg":
                    flat.div_(ring.size)
                return
        work = flat if flat.dtype == torch.float32 else flat.to(torch.float32)
        run_quantized_ring(work, ring, call, fmt)
        if work is not flat:
            flat.copy_(work)
        if op == "avg":
            flat.div_(ring.size)
