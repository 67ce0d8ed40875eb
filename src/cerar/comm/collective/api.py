"""`cerar.all_reduce` and `cerar.ring_all_reduce`: drop-ins for ``torch.distributed.all_reduce``.

Both are in place, take any shape and contiguity (but no view whose elements share memory, as
``expand()`` makes) and tensors that require grad (written as ``dist.all_reduce`` writes them,
unseen by autograd), and return None, or with ``async_op=True`` a :class:`CerarWork` handle.
All of a process's cerar calls run in order on one communication thread
(:mod:`cerar.comm.ring.thread`), so async and sync calls interleave exactly as issued on
every rank; :func:`shutdown` stops it (also at interpreter exit). They come from one Python
thread at a time: a call from a second thread while the first one's calls are in flight waits
until they have completed.

Every call starts with a handshake over the ring's own point-to-point links
(:mod:`cerar.comm.ring.handshake`; no collective, so none can pair with the program's own collectives
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

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from cerar._checks import check_float
from cerar.coding.code import MAX_ERROR, Code, check_max_error
from cerar.coding.precision import precision_name
from cerar.comm.collective.call import NonFiniteError, cerar_call, ring_call
from cerar.comm.collective.checks import (
    check_bool,
    check_coded_call,
    check_op,
    check_packet_dtype,
    check_stats,
    check_tensor,
)
from cerar.comm.collective.codes import check_usable, default_code, resolve_code, working_dtype
from cerar.comm.collective.policies import NONFINITE_POLICIES
from cerar.comm.kernels.workspace import WORKSPACE
from cerar.comm.ring.groups import group_state, ring_of
from cerar.comm.ring.handshake import SettingsMismatchError
from cerar.comm.ring.stats import CommStats
from cerar.comm.ring.thread import COMM, DEFAULT_SHUTDOWN_TIMEOUT_S, CerarWork, ShutdownError

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


#: The methods :func:`all_reduce` routes to besides ``"cerar"``, each registered by the layer that
#: defines it when it loads (:mod:`cerar.comm.auto.collective` registers ``"auto"``; ``import
#: cerar`` loads it): ``route(tensor, op, group, async_op, *, max_error, nonfinite, stats)``.
METHODS: dict[str, Callable[..., Any]] = {}


def register_method(name: str, route: Callable[..., Any]) -> None:
    """Route ``all_reduce(..., method=name)`` to ``route`` (see :data:`METHODS`)."""
    METHODS[name] = route


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
    method: str = "cerar",
    fresh_scale: bool = False,
) -> Any:
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
        stats: a :class:`cerar.comm.ring.stats.CommStats` that this call's figures are added to.
        method: ``"cerar"`` (this call, returning None or a :class:`CerarWork`), or ``"auto"``:
            the calls of this size go by the fastest method whose predicted worst-rank error is
            within ``max_error`` (the exact all-reduce, the float16 ring, CERAR in float32 or
            16 bits), decided from their measured times, the same on every rank
            (:mod:`cerar.comm.auto.collective`, registered in :data:`METHODS`; ``code``,
            ``packet_dtype`` and ``fresh_scale`` left at their defaults).
        fresh_scale: take the packet scale from this call's data (every rank's largest
            magnitude, carried by the handshake before the first round, as at the first call of
            a size) instead of from the previous call of this size. For 16-bit packets in a
            stream of calls that other methods interrupted (``method="auto"`` switching back),
            whose remembered scale may no longer fit: such a call would be redone. Every rank
            must pass the same value: on a size the ranks agreed before, a rank that differs
            makes every rank raise :class:`SettingsMismatchError`.

    Packets are scaled by an exact power of two so that they can neither overflow nor fall into
    subnormals (:mod:`cerar.coding.scaling`): every rank's largest magnitude travels with the
    rounds, and a call whose data left the range of the scale it started with (the previous
    call's of its size) is redone at one that fits, the same on every rank (``stats.rescales``).
    """
    if method != "cerar":
        if method not in METHODS:
            raise ValueError(
                f"Argument 'method' must be 'cerar' or one of the registered {sorted(METHODS)} ('auto' registers "
                f"when cerar.collective, the facade, loads), not {method!r}."
            )
        route = METHODS[method]
        if code is not None or packet_dtype is not None or fresh_scale is not False:
            raise ValueError(
                f"Arguments 'code', 'packet_dtype' and 'fresh_scale' must be left at their defaults with "
                f"method={method!r} (it chooses them), not {code!r}, {packet_dtype!r}, {fresh_scale!r}."
            )
        return route(tensor, op, group, async_op, max_error=max_error, nonfinite=nonfinite, stats=stats)
    reduce_op, async_op, nonfinite, packet_dtype = check_coded_call(
        tensor, op, async_op, nonfinite, packet_dtype, code, stats
    )
    fresh_scale = check_bool("fresh_scale", fresh_scale)
    ring = ring_of(group)
    if ring is None:
        return None
    if code is not None and code.world_size != ring.size:
        raise ValueError(f"Argument 'code' is for world_size={code.world_size} but the group has {ring.size} ranks.")
    if code is not None:
        precision = precision_name(packet_dtype or working_dtype(tensor.dtype))
        check_usable(code, precision, check_max_error(max_error))
    # detach(): the same storage, so the result lands in ``tensor``, without autograd, which
    # refuses in-place writes to a leaf that requires grad (dist.all_reduce also bypasses it).
    job = functools.partial(
        cerar_call, tensor.detach(), reduce_op, ring, code, nonfinite, stats, packet_dtype, fresh_scale
    )
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
    wire_dtype = check_packet_dtype(wire_dtype, "wire_dtype")
    check_stats(stats)
    ring = ring_of(group)
    if ring is None:
        return None
    job = functools.partial(ring_call, tensor.detach(), reduce_op, ring, wire_dtype, stats)  # as above
    return COMM.submit(job, tensor, async_op)


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
