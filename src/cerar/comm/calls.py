"""The bodies of cerar's calls, shared by the flat collectives (:mod:`cerar.comm.collective`) and
the hierarchical ones (:mod:`cerar.comm.hierarchical`): they run on the communication thread.

* :func:`call_context` opens a call: its number on the group (counted first), its statistics
  (timed and recorded even when the call fails) and the contiguous working copy, written back
  on success (:class:`Working`);
* :func:`cerar_call` and :func:`ring_call` are one call each: the handshake, the packet scale
  (:mod:`cerar.coding.scaling`), the rounds, the redo, the non-finite policy;
* :func:`default_code` and :func:`resolve_code` decide a call's code when none is given, the one
  place that does (the DDP states and the hierarchical path ask it too).
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from cerar.coding import codes
from cerar.coding.code import Code
from cerar.coding.precision import precision_name
from cerar.coding.scaling import ring_needs_scale, ring_scale_exponent
from cerar.comm import native
from cerar.comm.algorithms import Accept, CerarOutcome, CerarRun, cerar_scale_window, run_cerar, run_ring
from cerar.comm.groups import count_call, group_state
from cerar.comm.handshake import OpenHandshake, handshake, max_abs, open_handshake, settings_hash
from cerar.comm.stats import CommStats
from cerar.comm.transport import Ring, settle_round

__all__ = [
    "NonFiniteError",
    "Working",
    "call_context",
    "cerar_call",
    "check_usable",
    "default_code",
    "resolve_code",
    "ring_call",
    "ring_of",
    "working_dtype",
]


class NonFiniteError(ValueError):
    """Some rank's input held NaN or Inf and the policy was ``nonfinite="raise"``."""


@functools.cache
def default_code(world_size: int, precision: str = "fp32") -> Code:
    """The code used when none is given, tuned for the packet precision.

    * float32 packets: :func:`cerar.coding.codes.choose` with its default error budget (1e-3):
      the fewest bytes that meet it (``c = 2N``: ``(3N-2)/(2N)`` values per value, 0.83x ring at
      ``N = 4``, worst-rank error near 2e-4).
    * float64 packets: the fewest bytes whose predicted error is no larger than the float32
      default's, so that wider data never gets a less accurate sum by default (``c = 4N``, 1.125
      values per value at ``N = 4``, error 5e-5). With the 1e-3 budget itself ``choose`` reaches
      ``c = 5N``, whose decoder is far worse conditioned: 7x the error for 2% fewer bytes.
    * 16-bit packets: ``codes.optimized(N, 2N, precision)`` (predicted worst-rank error at
      ``N = 4``: 1.6e-2 in float16, 4.5e-2 in bfloat16); two ranks use the exact code.

    :func:`resolve_code` picks the precision from a call's dtypes."""
    if precision in ("fp16", "bf16"):
        return codes.exact(2) if world_size == 2 else codes.optimized(world_size, 2 * world_size, precision)
    if precision == "fp64":
        float32_error = default_code(world_size, "fp32").predicted_worst_error("fp32")
        return codes.choose(world_size, "fp64", error_budget=max(float32_error, 1e-12))
    return codes.choose(world_size, precision)


def resolve_code(world_size: int, tensor_dtype: torch.dtype, packet_dtype: torch.dtype | None = None) -> Code:
    """The default code of a call on ``world_size`` ranks with this tensor and packet dtype: the
    one place that decides it for the collective and the hierarchical path. Packets default to
    the working dtype (float64 for float64 tensors, float32 otherwise)."""
    return default_code(world_size, precision_name(packet_dtype or working_dtype(tensor_dtype)))


def working_dtype(tensor_dtype: torch.dtype) -> torch.dtype:
    """The dtype the ring works in: float64 for float64 tensors, float32 for all others."""
    return torch.float64 if tensor_dtype == torch.float64 else torch.float32


@contextlib.contextmanager
def call_context(
    tensor: torch.Tensor, ring: Ring, stats: CommStats | None
) -> Iterator[tuple[torch.Tensor, CommStats, int]]:
    """One call on the communication thread: ``(flat working tensor, its CommStats, its number
    on the group)``. The number is taken first; the statistics are timed and added to the
    group's (and ``stats``) even when the call fails; the result is written back on success."""
    counter = count_call(ring.group)
    started = time.perf_counter()
    call = CommStats(calls=1)
    try:
        with Working(tensor) as flat:
            yield flat, call, counter
    finally:
        call.wall_s = time.perf_counter() - started
        _record(ring, call, stats)


def cerar_call(
    tensor: torch.Tensor,
    op: str,
    ring: Ring,
    code: Code | None,
    nonfinite: str,
    stats: CommStats | None,
    packet_dtype: torch.dtype | None = None,
    fresh_scale: bool = False,
) -> None:
    with call_context(tensor, ring, stats) as (flat, call, counter):
        if ring.size == 1:
            return
        packet = packet_dtype or flat.dtype
        precision = precision_name(packet)
        code = code if code is not None else resolve_code(ring.size, tensor.dtype, packet_dtype)
        # The caller's dtype, not the working copy's: a float16 tensor on one rank and a bfloat16
        # one on another share the float32 copy, but their sum means nothing.
        identity = ("cerar", code.fingerprint, str(tensor.dtype), str(packet), flat.numel(), op, nonfinite)
        described, agreement = code, ""  # what summary() names (code is no longer None here)

        def summary() -> str:  # only on a mismatch
            return (
                f"{described.describe()}, values {tensor.dtype}, packets {packet}, size {flat.numel()}, op {op}, "
                f"nonfinite={nonfinite!r}{agreement}"
            )

        # The packet scale 2**e: the one this size's previous call ended with (e = 0 at first),
        # agreed in the handshake; the maxima that travel with the rounds tell whether it fit.
        key = (ring.send_to, ring.recv_from, flat.numel(), precision)  # per ring
        state = group_state(ring.group)
        remembered = state.scale_exponents
        window = cerar_scale_window(code, flat.dtype, packet)
        settings = settings_hash(identity)
        # A layout (size and settings) whose call every rank has completed before: its scale is
        # the same everywhere, so round 1 can leave beside the handshake (module handshake). CPU only:
        # on an accelerator the check would wait for the device inside the round loop.
        # fresh_scale: measured from this call's data, as at a size's first call (the remembered
        # scale is kept until the call succeeds, so that a call refused on one rank changes nothing).
        agreed_before = (
            not fresh_scale and (key, settings) in state.agreed and key in remembered and flat.device.type == "cpu"
        )
        native.warm(flat.device, flat.dtype)  # a machine's first build, before the ranks line up
        began = time.perf_counter()
        if agreed_before:
            exponent = remembered[key]
            agreement = f", agreed layout at packet scale 2**{exponent}"
            opened = open_handshake(
                ring, settings_hash((*identity, "agreed", exponent)), counter, summary, device=flat.device
            )
        else:
            # A narrow format (float16) without a scale to go by pays one pass here, so that its
            # first call does not have to be redone; a wide one starts from 1.
            first_pass = (fresh_scale or key not in remembered) and window.target is not None
            agreed = handshake(
                ring,
                settings,
                counter,
                summary,
                max_abs=max_abs(flat) if first_pass else 0.0,
                scale_exponent=remembered.get(key, 0),
                device=flat.device,
            )
            # Some rank measured (the same decision everywhere), or the largest proposal.
            exponent = window.exponent_for(agreed.max_abs) if agreed.max_abs > 0.0 else agreed.scale_exponent
        call.handshake_s += time.perf_counter() - began

        def accept(maxima: list[float]) -> bool:
            if not all(math.isfinite(v) for v in maxima):
                return nonfinite == "ignore"  # NaN/Inf: the policy decides, after the rounds
            return window.admits(max(maxima), exponent)

        if agreed_before:
            outcome = _run_agreed(flat, code, ring, call, accept, window.split(exponent), packet, opened)
        else:
            outcome = run_cerar(
                flat, code, ring, call, accept, scale_exponents=window.split(exponent), packet_dtype=packet
            )
        largest = max(outcome.maxima)
        if not outcome.written and math.isfinite(largest):
            # The packets left the format's safe range at this scale (the same finding on every
            # rank, and every input is intact): redo the call at a scale that fits, and keep it.
            exponent = window.exponent_for(largest)
            call.rescales += 1
            outcome = run_cerar(flat, code, ring, call, scale_exponents=window.split(exponent), packet_dtype=packet)
        # The next call's scale: this one's, or re-centred if the data has drifted (the maxima
        # are every rank's, so every rank takes the same).
        remembered[key] = window.follow(largest if outcome.written else 0.0, exponent)
        state.agreed.add((key, settings))
        if not outcome.written:  # NaN/Inf: the same list on every rank, every input intact
            flagged = [r for r, v in enumerate(outcome.maxima) if not math.isfinite(v)]
            call.nonfinite_events += 1
            if nonfinite == "raise":
                raise NonFiniteError(
                    f"cerar.all_reduce: NaN or Inf in the input of rank(s) {flagged} "
                    f"(group ranks); CERAR's mixing would spread it across its column (all c components) "
                    f"on every rank. Pass nonfinite='exact' to fall back to the exact ring instead."
                )
            call.fallbacks += 1
            run_ring(flat, ring, call)
        elif not all(math.isfinite(v) for v in outcome.maxima):
            call.nonfinite_events += 1  # nonfinite="ignore": decoded anyway
        if op == "avg":
            flat.div_(ring.size)


def _run_agreed(
    flat: torch.Tensor,
    code: Code,
    ring: Ring,
    call: CommStats,
    accept: Accept,
    scale_exponents: tuple[int, int],
    packet: torch.dtype,
    opened: OpenHandshake,
) -> CerarOutcome:
    """CERAR with round 1 posted beside the handshake's last hops (:class:`OpenHandshake`).

    Both neighbours agree: the program runs and the last hops are its gate, once round 1 is on
    the wire. One or none agrees (so the handshake will raise): only the messages of round 1 that
    an agreeing neighbour posts to or expects from this rank are posted, and completed before
    the error leaves."""
    run = CerarRun.for_call(flat, code, ring, scale_exponents[0], packet)

    def gate() -> None:
        began = time.perf_counter()
        try:
            opened.finish()
        finally:
            call.handshake_s += time.perf_counter() - began

    if opened.predecessor_agrees and opened.successor_agrees:
        call.agreed_calls += 1
        return run.run(call, flat, accept, scale_exponents[1], gate=gate)
    first = run.program.rounds[0] if run.program.rounds else []
    settle_round(ring, first, send=opened.successor_agrees, recv=opened.predecessor_agrees, then=gate)
    # A neighbour's header differed from this rank's, so finishing the handshake raised.
    raise AssertionError("cerar: the handshake agreed although a neighbour's header differed")


def ring_call(
    tensor: torch.Tensor,
    op: str,
    ring: Ring,
    wire_dtype: torch.dtype | None,
    stats: CommStats | None,
) -> None:
    with call_context(tensor, ring, stats) as (flat, call, counter):
        if ring.size == 1:
            return
        wire = wire_dtype or flat.dtype
        identity = ("ring", str(tensor.dtype), str(wire), flat.numel(), op)
        summary = f"exact ring, values {tensor.dtype}, wire {wire}, size {flat.numel()}, op {op}"
        # A wire narrower than the data (float16 always; bfloat16 or float32 for float64 data,
        # bfloat16 for float32 data) needs every rank's largest magnitude before its first
        # round: one pass here (aminmax), carried by the handshake; NaN/Inf make it infinite and
        # the scaling is skipped.
        needs_scale = ring_needs_scale(flat.dtype, wire)
        largest = max_abs(flat) if needs_scale else 0.0
        began = time.perf_counter()
        agreed = handshake(ring, settings_hash(identity), counter, summary, max_abs=largest, device=flat.device)
        call.handshake_s += time.perf_counter() - began
        agreed_max = agreed.max_abs
        exponent = ring_scale_exponent(ring.size, agreed_max, flat.dtype, wire) if needs_scale else 0
        run_ring(flat, ring, call, wire_dtype=wire_dtype, scale_exponent=exponent)
        if op == "avg":
            flat.div_(ring.size)


@functools.lru_cache(maxsize=256)
def check_usable(code: Code, precision: str, max_error: float | None) -> None:
    """``code.check_error`` once per (code, precision, limit): the prediction costs milliseconds."""
    code.check_error(precision, max_error)


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


def _record(ring: Ring, call: CommStats, stats: CommStats | None) -> None:
    group_state(ring.group).stats.add(call)
    if stats is not None:
        stats.add(call)


def ring_of(group: dist.ProcessGroup | None) -> Ring | None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("cerar: torch.distributed is not initialised; call init_process_group first.")
    state = group_state(group)
    if state.ring is None:  # once per group: its members and their global ranks do not change
        state.ring = Ring.of(group) or False
    return state.ring or None
