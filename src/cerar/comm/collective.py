"""`cerar.all_reduce` and `cerar.ring_all_reduce`: drop-ins for ``torch.distributed.all_reduce``.

Both are in place, take any shape and contiguity (but no view whose elements share memory, as
``expand()`` makes) and tensors that require grad (written as ``dist.all_reduce`` writes them,
unseen by autograd), and return None, or with ``async_op=True`` a :class:`CerarWork` handle.
All of a process's cerar calls run in order on one communication thread
(:mod:`cerar.comm.worker_thread`), so async and sync calls interleave exactly as issued on
every rank; :func:`shutdown` stops it (also at interpreter exit). They must come from one
Python thread at a time: a call from a second thread while the first one's calls are in
flight raises ``RuntimeError``.

Every call starts with a handshake over the ring's own point-to-point links
(:mod:`cerar.comm.handshake`; no collective, so none can pair with the program's own collectives
on the group) that

* checks that every rank runs the same call: the same code (N, c, construction, parameters,
  decoder), packet dtype, size, op and non-finite policy, and the same call number on the group;
  any mismatch raises :class:`SettingsMismatchError` with the same message on every rank, before
  any data moves, instead of a hang or a wrong sum;
* for float16 wires, carries the largest magnitude for the scaling.

CERAR's non-finite check then runs while round 1 is on the wire and its flags travel beside
rounds ``2 .. N`` (mixing would spread one NaN across the ``c`` components of its column on every
rank): every rank knows every rank's flag before decoding, decides the same, and its input is
still intact for ``nonfinite="exact"``'s fallback.

A dead or stuck peer makes the ring's point-to-point waits fail within the process group's
timeout (``init_process_group(timeout=...)``) on every surviving rank.
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

from cerar._checks import check_float
from cerar.coding import codes
from cerar.coding.code import MAX_ERROR, Code, check_max_error
from cerar.coding.precision import precision_name
from cerar.coding.scaling import ring_needs_scale, ring_scale_exponent
from cerar.comm.algorithms import cerar_scale_window, run_cerar, run_ring
from cerar.comm.call_checks import check_bool, check_coded_call, check_op, check_stats, check_tensor
from cerar.comm.groups import count_call, group_state
from cerar.comm.handshake import SettingsMismatchError, handshake, max_abs, settings_hash
from cerar.comm.policies import NONFINITE_POLICIES
from cerar.comm.stats import CommStats
from cerar.comm.transport import WORKSPACE, Ring
from cerar.comm.worker_thread import COMM, DEFAULT_SHUTDOWN_TIMEOUT_S, CerarWork, ShutdownError

__all__ = [
    "NONFINITE_POLICIES",
    "CerarWork",
    "NonFiniteError",
    "SettingsMismatchError",
    "ShutdownError",
    "all_reduce",
    "default_code",
    "get_stats",
    "reset_stats",
    "resolve_code",
    "ring_all_reduce",
    "shutdown",
]


class NonFiniteError(ValueError):
    """Some rank's input held NaN or Inf and the policy was ``nonfinite="raise"``."""


# ---------------------------------------------------------------------------------------------
# Public API


def all_reduce(
    tensor: torch.Tensor,
    op: Any = "sum",
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    *,
    code: Code | None = None,
    nonfinite: str = "raise",
    packet_dtype: torch.dtype | None = None,
    max_error: float | None = MAX_ERROR,
    stats: CommStats | None = None,
) -> CerarWork | None:
    """Sum (or average) ``tensor`` over ``group`` with CERAR, in place.

    Each rank's result is the sum up to the code's small, bounded error (see
    :attr:`cerar.Code.error_bound`) and differs slightly between ranks: it is not bitwise
    identical as with ``torch.distributed.all_reduce``.

    Args:
        tensor: float32 or float64 (native packets), or float16/bfloat16 (sent as float32 and
            cast back); any shape and contiguity; sizes not divisible by ``c`` are padded.
        op: ``"sum"`` or ``"avg"`` (or ``dist.ReduceOp.SUM`` / ``AVG``).
        group: process group (default: the default group). Ranks are renumbered within it;
            ranks outside it return None, as in torch.
        async_op: return a :class:`CerarWork` instead of blocking.
        code: the :class:`cerar.Code` to use; its ``world_size`` must equal the group's size.
            Default: :func:`default_code` for the group's size.
        nonfinite: ``"raise"`` (raise :class:`NonFiniteError` on every rank, naming the ranks
            with NaN/Inf), ``"exact"`` (fall back to the exact ring for this call) or
            ``"ignore"`` (skip the check; one NaN then reaches its whole column, all ``c``
            components of its position, on every rank).
        packet_dtype: the dtype of the packets on the wire: ``None`` (float64 for float64
            tensors, else float32), ``torch.float32``, ``torch.float64``, or 16 bits,
            ``torch.float16`` or ``torch.bfloat16``: half the bytes, an error near 1-2% (see
            the README), the packets computed in the tensor's precision and rounded once, decoded
            in float64. The default code is then tuned for that precision (pass one built with
            ``precision="fp16"`` etc. to choose it yourself).
        max_error: a ``code`` whose predicted worst-rank error at the packet precision exceeds
            this (default 0.1) is refused with a ValueError naming ``N``, ``c`` and the error (a
            code tuned for float32 would return noise with bfloat16 packets, say); ``None``
            uses it anyway.
        stats: a :class:`cerar.comm.stats.CommStats` that this call's figures are added to.

    Packets are scaled by an exact power of two so that they can neither overflow nor fall into
    subnormals (:mod:`cerar.coding.scaling`): every rank's largest magnitude travels with the
    rounds, and a call whose data left the range of the scale it started with (the previous
    call's of its size) is redone at one that fits, the same on every rank (``stats.rescales``).
    """
    reduce_op, async_op, nonfinite, packet_dtype = check_coded_call(
        tensor, op, async_op, nonfinite, packet_dtype, code, stats
    )
    ring = _ring(group)
    if ring is None:
        return None
    if code is not None and code.world_size != ring.size:
        raise ValueError(f"Argument 'code' is for world_size={code.world_size} but the group has {ring.size} ranks.")
    if code is not None:
        precision = precision_name(packet_dtype or _working_dtype(tensor.dtype))
        _check_usable(code, precision, check_max_error(max_error))
    # detach(): the same storage, so the result lands in ``tensor``, without autograd, which
    # refuses in-place writes to a leaf that requires grad (dist.all_reduce also bypasses it).
    job = functools.partial(_cerar_call, tensor.detach(), reduce_op, ring, code, nonfinite, stats, packet_dtype)
    return COMM.submit(job, tensor, async_op)


def ring_all_reduce(
    tensor: torch.Tensor,
    op: Any = "sum",
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    *,
    wire_dtype: torch.dtype | None = None,
    stats: CommStats | None = None,
) -> CerarWork | None:
    """Exact ring all-reduce (reduce-scatter + all-gather) on cerar's transport, in place.

    The baseline that isolates CERAR's coding gain: same transport, ``2(N-1)/N`` values sent
    per value. With ``wire_dtype=torch.float16`` or ``torch.bfloat16`` the chunks travel in
    16 bits and are accumulated in float32 on each rank; every rank ends with the same values.
    float16 overflow is avoided by scaling: all ranks agree on the largest magnitude ``M`` and
    divide by a power of two so that ``N * M`` maps to about ``2**14`` (which also keeps small
    gradients out of float16's subnormal range), then multiply back; the scaling is exact.
    """
    check_tensor(tensor)
    reduce_op = check_op(op)
    async_op = check_bool("async_op", async_op)
    if wire_dtype not in (None, torch.float32, torch.float64, torch.float16, torch.bfloat16):
        raise ValueError(
            f"Argument 'wire_dtype' must be None, torch.float32, torch.float64, torch.float16 or "
            f"torch.bfloat16, not {wire_dtype!r}."
        )
    check_stats(stats)
    ring = _ring(group)
    if ring is None:
        return None
    job = functools.partial(_ring_call, tensor.detach(), reduce_op, ring, wire_dtype, stats)  # as above
    return COMM.submit(job, tensor, async_op)


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
    return default_code(world_size, precision_name(packet_dtype or _working_dtype(tensor_dtype)))


def _working_dtype(tensor_dtype: torch.dtype) -> torch.dtype:
    """The dtype the ring works in: float64 for float64 tensors, float32 for all others."""
    return torch.float64 if tensor_dtype == torch.float64 else torch.float32


def get_stats(group: dist.ProcessGroup | None = None) -> CommStats:
    """Cumulative statistics of this process's cerar calls on ``group`` (live object; ``None``
    and ``dist.group.WORLD`` are the same group)."""
    return group_state(group).stats


def reset_stats(group: dist.ProcessGroup | None = None) -> None:
    get_stats(group).reset()


def shutdown(timeout_s: float | None = DEFAULT_SHUTDOWN_TIMEOUT_S) -> bool:
    """Stop the communication thread once the calls already submitted have run.

    Call it before ``destroy_process_group()``, or let the interpreter do it: it is registered
    with ``atexit`` at the first call, because a process that exits while a call is still on
    the wire would otherwise be aborted by the C++ runtime (SIGABRT) as Gloo is torn down under
    the thread. Idempotent, and a no-op in a process that never made a call; the next cerar
    call starts a new thread. The scratch buffers are released.

    Args:
        timeout_s: how long to wait for the submitted calls (``None``: as long as they take).

    Returns:
        True if the thread stopped; False if a call was still running after ``timeout_s``:
        the calls queued behind it then fail with :class:`ShutdownError` and the thread is
        left to finish that call (it fails by itself within the process group's timeout if a
        peer is gone).
    """
    if timeout_s is not None:
        timeout_s = check_float("timeout_s", timeout_s, nonnegative=True)
    stopped = COMM.shutdown(timeout_s)
    if stopped:
        WORKSPACE.clear()  # only the thread used it, and it is gone
    return stopped


def _count_call(group: dist.ProcessGroup | None) -> int:
    """Count a call on ``group`` and return its number, on the communication thread when the
    call starts: the calls accepted by this process, in the order they run. A call that fails
    on one rank before its handshake (its input copy runs out of memory, say) still counts
    there, so the ranks' next call has different numbers and the handshake raises on every rank
    instead of pairing it with the others' earlier call. (A call refused up front, on the
    caller's thread, is not counted: it was never accepted, on any rank.)"""
    return count_call(group)


# ---------------------------------------------------------------------------------------------
# The calls (run on the communication thread)


@contextlib.contextmanager
def _call(tensor: torch.Tensor, ring: Ring, stats: CommStats | None) -> Iterator[tuple[torch.Tensor, CommStats, int]]:
    """One call on the communication thread: ``(flat working tensor, its CommStats, its number
    on the group)``. The number is taken first; the statistics are timed and added to the
    group's (and ``stats``) even when the call fails; the result is written back on success."""
    counter = _count_call(ring.group)
    started = time.perf_counter()
    call = CommStats(calls=1)
    try:
        with _Working(tensor) as flat:
            yield flat, call, counter
    finally:
        call.wall_s = time.perf_counter() - started
        _record(ring, call, stats)


def _cerar_call(
    tensor: torch.Tensor,
    op: str,
    ring: Ring,
    code: Code | None,
    nonfinite: str,
    stats: CommStats | None,
    packet_dtype: torch.dtype | None = None,
) -> None:
    with _call(tensor, ring, stats) as (flat, call, counter):
        if ring.size == 1:
            return
        packet = packet_dtype or flat.dtype
        precision = precision_name(packet)
        code = code if code is not None else resolve_code(ring.size, tensor.dtype, packet_dtype)
        # The caller's dtype, not the working copy's: a float16 tensor on one rank and a bfloat16
        # one on another share the float32 copy, but their sum means nothing.
        identity = ("cerar", code.fingerprint, str(tensor.dtype), str(packet), flat.numel(), op, nonfinite)
        summary = (
            f"{code.describe()}, values {tensor.dtype}, packets {packet}, size {flat.numel()}, op {op}, "
            f"nonfinite={nonfinite!r}"
        )
        # The packet scale 2**e: the one this size's previous call ended with (e = 0 at first),
        # agreed in the handshake; the maxima that travel with the rounds tell whether it fit.
        key = (ring.send_to, ring.recv_from, flat.numel(), precision)  # per ring
        remembered = group_state(ring.group).scale_exponents
        window = cerar_scale_window(code, flat.dtype, packet)
        # A narrow format (float16) without a scale to go by pays one pass here, so that its
        # first call does not have to be redone; a wide one starts from 1.
        first_pass = key not in remembered and window.target is not None
        began = time.perf_counter()
        agreed = handshake(
            ring,
            settings_hash(identity),
            counter,
            summary,
            max_abs=max_abs(flat) if first_pass else 0.0,
            scale_exponent=remembered.get(key, 0),
            device=flat.device,
        )
        call.handshake_s += time.perf_counter() - began
        # Some rank measured (the same decision everywhere), or the largest proposal.
        exponent = window.exponent_for(agreed.max_abs) if agreed.max_abs > 0.0 else agreed.scale_exponent

        def accept(maxima: list[float]) -> bool:
            if not all(math.isfinite(v) for v in maxima):
                return nonfinite == "ignore"  # NaN/Inf: the policy decides, after the rounds
            return window.admits(max(maxima), exponent)

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
        remembered[key] = exponent
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


def _ring_call(
    tensor: torch.Tensor,
    op: str,
    ring: Ring,
    wire_dtype: torch.dtype | None,
    stats: CommStats | None,
) -> None:
    with _call(tensor, ring, stats) as (flat, call, counter):
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
def _check_usable(code: Code, precision: str, max_error: float | None) -> None:
    """``code.check_error`` once per (code, precision, limit): the prediction costs milliseconds."""
    code.check_error(precision, max_error)


class _Working:
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
    get_stats(ring.group).add(call)
    if stats is not None:
        stats.add(call)


def _ring(group: dist.ProcessGroup | None) -> Ring | None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("cerar: torch.distributed is not initialised; call init_process_group first.")
    return Ring.of(group)
