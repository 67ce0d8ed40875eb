"""The bodies of cerar's calls, shared by the flat collectives (:mod:`cerar.comm.collective.api`) and
the hierarchical ones (:mod:`cerar.comm.collective.hierarchical`); they run on the communication
thread.

* :func:`call_context` opens a call: its number on the group (counted first), its statistics
  (timed and recorded even when the call fails, once: a call that is a stage of another, the
  hierarchical call's ring between nodes, records into that call's) and the contiguous working
  copy, written back on success (:class:`Working`);
* :func:`cerar_call` and :func:`ring_call` are one call each, top to bottom: the handshake, the
  packet scale (:class:`cerar.comm.algorithms.cerar.scale.PacketScale`), the rounds, the redo, the
  non-finite policy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from cerar.coding.linear_code import Code
from cerar.comm.algorithms import native
from cerar.comm.algorithms.cerar.decode import scale_by_power_of_two
from cerar.comm.algorithms.cerar.run import CerarRun
from cerar.comm.algorithms.cerar.scale import PacketScale
from cerar.comm.algorithms.ring.direct import run_direct
from cerar.comm.algorithms.ring.program import run_ring
from cerar.comm.algorithms.ring.wires import OWN
from cerar.comm.collective.request import Request
from cerar.comm.runtime.groups import count_call, group_state
from cerar.comm.runtime.handshake import NO_PROPOSAL, Proposal, Summary, handshake, open_handshake, settings_hash
from cerar.comm.runtime.links import Ring
from cerar.comm.runtime.maxima import max_abs
from cerar.comm.runtime.stats import CommStats

__all__ = ["NonFiniteError", "Working", "agree_call", "call_context", "cerar_call", "items", "ring_call"]


class NonFiniteError(ValueError):
    """Some rank's input held NaN or Inf and the policy was ``nonfinite="raise"``."""


@contextlib.contextmanager
def call_context(
    tensor: torch.Tensor, ring: Ring, stats: CommStats | None, within: CommStats | None = None
) -> Iterator[tuple[torch.Tensor, CommStats, int]]:
    """One call on the communication thread: ``(flat working tensor, its CommStats, its number
    on the group)``. The number is taken first; the statistics are timed and added to the
    group's (and ``stats``) even when the call fails; the result is written back on success.
    ``within``: the statistics of the call this one is a stage of (the hierarchical call's ring
    between nodes), which get its figures instead of the group, less its count and time (the
    enclosing call counts and times itself)."""
    counter = count_call(ring.group)
    started = time.perf_counter()
    call = CommStats(calls=1)
    try:
        with Working(tensor) as flat:
            yield flat, call, counter
    finally:
        call.wall_s = time.perf_counter() - started
        if within is not None:
            within.add(dataclasses.replace(call, calls=0, wall_s=0.0))
        else:
            group_state(ring.group).stats.add(call)
        if stats is not None:
            stats.add(call)


def cerar_call(request: Request, ring: Ring, *, within: CommStats | None = None) -> None:
    """One CERAR call of ``request`` (its code bound by the route); ``request.context``: the
    settings of a layer above (``method="auto"``'s) that every rank must share too, agreed in the
    same handshake and named first on a mismatch; ``within``: as :func:`call_context`'s."""
    tensor, op, code = request.tensor, request.op, request.code
    nonfinite, max_error = request.nonfinite, request.max_error
    with call_context(tensor, ring, request.stats, within) as (flat, call, counter):
        if ring.size == 1:
            return
        assert code is not None, "the route binds CERAR's code"
        packet = request.packet_dtype or flat.dtype
        fresh_scale, context = request.fresh_scale, request.context
        # The caller's dtype, not the working copy's: a float16 tensor on one rank and a bfloat16
        # one on another share the float32 copy, but their sum means nothing.
        identity = (request.route, code.fingerprint, str(tensor.dtype), str(packet), flat.numel(), op, nonfinite)
        identity += (repr(max_error), *items(context))
        settings = settings_hash(identity)
        scale = PacketScale(ring, code, flat, packet, fresh_scale)
        summary = _Summary(code, tensor.dtype, packet, flat.numel(), op, nonfinite, context, max_error)
        # A layout every rank has completed before has the same scale everywhere: its round 1 leaves
        # beside the handshake's last hops (cerar.comm.runtime.handshake). CPU only: on an accelerator
        # the check of the neighbours' headers would wait for the device inside the round loop.
        agreed = group_state(ring.group).agreed
        beside = not fresh_scale and scale.remembered is not None and (scale.key, settings) in agreed
        beside = beside and flat.device.type == "cpu"
        native.warm(flat.device, flat.dtype)  # a machine's first build, before the ranks line up
        if beside:
            summary.agreement = f", agreed layout at packet scale 2**{scale.exponent}"
            settings_now = settings_hash((*identity, "agreed", scale.exponent))
            gate = open_handshake(ring, settings_now, counter, summary, device=flat.device, stats=call)
        else:
            proposal = scale.proposal(flat)
            scale.agree(handshake(ring, settings, counter, summary, proposal, device=flat.device, stats=call))
            gate = None
        run = CerarRun.for_call(flat, code, ring, scale, packet)
        outcome = run.run(call, flat, scale, nonfinite == "ignore", gate)
        if not outcome.written and outcome.finite:
            # The packets left the format's safe range at this scale (the same finding on every
            # rank, and every input is intact): redo the call at a scale that fits.
            scale.redo(outcome.largest)
            call.rescales += 1
            outcome = CerarRun.for_call(flat, code, ring, scale, packet).run(call, flat, scale)
        scale.remember(outcome.largest, outcome.written)
        agreed.add((scale.key, settings))
        if not outcome.finite:
            call.nonfinite_events += 1
        if not outcome.written:  # NaN/Inf: the same list on every rank, every input intact
            if nonfinite == "raise":
                flagged = [r for r, v in enumerate(outcome.maxima) if not math.isfinite(v)]
                raise NonFiniteError(
                    f"cerar.all_reduce: NaN or Inf in the input of rank(s) {flagged} (group ranks); CERAR's mixing "
                    f"would spread it across its column (all c components) on every rank. Pass nonfinite='exact' "
                    f"to fall back to the exact ring instead."
                )
            call.fallbacks += 1
            run_ring(flat, ring, call, OWN)
        if op == "avg":
            flat.div_(ring.size)


class _Summary:
    """A CERAR call's settings as text, made only on a mismatch (the handshake calls it); with a
    caller's ``context``, as named settings, the context's first."""

    def __init__(
        self, code: Code, dtype: torch.dtype, packet: torch.dtype, size: int, op: str, policy: str,
        context: Mapping[str, Any] | None = None, max_error: float | None = None,
    ) -> None:  # fmt: skip
        self.fields, self.context, self.agreement = (code, dtype, packet, size, op, policy, max_error), context, ""

    def __call__(self) -> str | dict[str, Any]:
        code, dtype, packet, size, op, policy, max_error = self.fields
        if self.context is not None:
            return {**self.context, "method": code.describe(), "packets": packet, "max_error": max_error}
        return (
            f"{code.describe()}, values {dtype}, packets {packet}, size {size}, op {op}, "
            f"nonfinite={policy!r}, max_error={max_error}{self.agreement}"
        )


def items(context: Mapping[str, Any] | None) -> tuple[tuple[str, str], ...]:
    """A caller's settings as part of a call's identity (hashed)."""
    return () if context is None else tuple((k, repr(v)) for k, v in context.items())


def ring_call(request: Request, ring: Ring, *, within: CommStats | None = None) -> None:
    """One ring call of ``request`` in its wire (``within`` as :func:`cerar_call`'s).

    1. The handshake, before any data: every rank's settings and call number, and, where the wire
       needs it (a narrower float, a block wire), every rank's ``max|x|`` (one pass here; infinite
       for NaN/Inf) and, in a field of its own, the highest group rank whose input is not finite.
    2. A block wire's non-finite policy, the same decision on every rank: ``"raise"`` raises
       :class:`NonFiniteError` naming a rank; ``"exact"`` runs the exact ring in the data's own
       dtype instead (counted in ``fallbacks``); ``"ignore"`` lets each block that holds a NaN or
       Inf be NaN on every rank, nothing else. The float wires leave non-finite values where
       they are, as torch's all-reduce does.
    3. The power-of-two scale the agreed maximum calls for (none for an ordinary gradient), then
       the rounds (:func:`cerar.comm.algorithms.ring.program.run_ring`, or the direct shape's
       :func:`cerar.comm.algorithms.ring.direct.run_direct`) in the wire's working dtype: a block
       wire's is float32 (float64 data is scaled in float64 first, so that values beyond
       float32's range survive the narrowing), with the stream's error-feedback residual where
       the request carries a store (given back when the call ends, its non-finite entries zeroed
       where an input held NaN or Inf).
    """
    tensor, op, wire, nonfinite = request.tensor, request.op, request.wire, request.nonfinite
    with call_context(tensor, ring, request.stats, within) as (flat, call, counter):
        if ring.size == 1:
            return
        identity = (request.route, str(tensor.dtype), repr(wire), flat.numel(), op, *items(request.context))
        quantized, store = wire.quantized, request.error_feedback
        if quantized:
            identity += (nonfinite, repr(request.max_error), store is not None)
        summary: Summary = f"{request.route}, wire {wire.describe()}, values {tensor.dtype}, size {flat.numel()}"
        summary += f", op {op}"
        if quantized:
            summary += f", nonfinite={nonfinite!r}, max_error={request.max_error}, error feedback {store is not None}"
        if request.context is not None:
            summary = {**request.context, "method": f"{request.route}, wire {wire.describe()}"}
        native.warm(flat.device, torch.float32)  # a machine's first build, before the ranks line up
        proposal = NO_PROPOSAL
        me = ring.peers[ring.rank] if ring.peers else ring.rank
        if wire.needs_max(flat.dtype):
            own = max_abs(flat)  # one pass, read on the host: before the rounds, not inside them
            proposal = Proposal(own, nonfinite_rank=0 if math.isfinite(own) else me + 1)
        agreed = handshake(ring, settings_hash(identity), counter, summary, proposal, device=flat.device, stats=call)
        if quantized and agreed.nonfinite_rank:
            call.nonfinite_events += 1
            if nonfinite == "raise":
                mine = "is not" if proposal.nonfinite_rank else "is"
                raise NonFiniteError(
                    f"cerar.all_reduce: NaN or Inf in the input of group rank {agreed.nonfinite_rank - 1} (the "
                    f"highest-numbered such rank; group rank {me}'s input {mine} finite); the {wire.name} ring would "
                    f"make each block that holds one NaN on every rank. Pass nonfinite='exact' to fall back to "
                    f"the exact ring instead, or nonfinite='ignore' to let those blocks be NaN."
                )
            if nonfinite == "exact":
                call.fallbacks += 1
                run_ring(flat, ring, call, OWN)
                if op == "avg":
                    flat.div_(ring.size)
                return
        exponent = wire.scale_exponent(ring.size, agreed.max_abs, flat.dtype)
        run = run_direct if request.direct else run_ring
        residual = None
        if store is not None:  # error feedback (the block rows): the stream's residual, held for the call
            padded = ring.size * math.ceil(flat.numel() / ring.size)
            residual = store.take(request.route, tensor.numel(), ring.size, padded, flat.device)
        try:
            if wire.work_dtype(flat.dtype) == flat.dtype:
                run(flat, ring, call, wire, exponent, residual)
            else:  # float64 data on a block wire: scaled in float64, so that it survives the narrowing
                scale_by_power_of_two(flat, -exponent)
                if residual is not None:
                    scale_by_power_of_two(residual, -exponent)
                work = flat.to(wire.work_dtype(flat.dtype))
                run(work, ring, call, wire, 0, residual)
                flat.copy_(work)
                scale_by_power_of_two(flat, exponent)
                if residual is not None:
                    scale_by_power_of_two(residual, exponent)
        finally:
            if store is not None:
                store.give_back(nonfinite=bool(agreed.nonfinite_rank))
        if op == "avg":
            flat.div_(ring.size)


def agree_call(
    ring: Ring, context: Mapping[str, Any], device: torch.device, stats: CommStats | None, sent: int = 0
) -> None:
    """The handshake alone, for a call whose data goes another way (``method="auto"``'s exact
    candidate, torch's all-reduce): every rank agrees ``context`` and the call count first, so a
    rank that differs raises :class:`SettingsMismatchError` everywhere before any data moves.
    ``sent``: the bytes that other way sends (torch's ring, by its formula), added to the
    statistics beside the handshake's own."""
    call = CommStats()
    identity, number = ("agreed", *items(context)), count_call(ring.group)
    try:
        handshake(ring, settings_hash(identity), number, lambda: dict(context), device=device, stats=call)
        call.bytes_sent += sent  # only once agreed: a refused call sends nothing that way
        call.bytes_received += sent
    finally:
        group_state(ring.group).stats.add(call)
        if stats is not None:
            stats.add(call)


class Working:
    """The contiguous float32/float64 1-d tensor the ring works on, written back on exit."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        native = tensor.dtype in (torch.float32, torch.float64)
        if native and tensor.is_contiguous():
            self.flat, self.copy = tensor.view(-1), False
        else:
            dtype = tensor.dtype if native else torch.float32
            self.flat, self.copy = tensor.reshape(-1).to(dtype=dtype, copy=True), True

    def __enter__(self) -> torch.Tensor:
        return self.flat

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if self.copy and exc_type is None:
            self.tensor.copy_(self.flat.view(self.tensor.shape))
