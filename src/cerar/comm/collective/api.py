"""`cerar.all_reduce` and `cerar.ring_all_reduce`: drop-ins for ``torch.distributed.all_reduce``.

Both are in place, take any shape and contiguity (but no view whose elements share memory, as
``expand()`` makes) and tensors that require grad (written as ``dist.all_reduce`` writes them,
unseen by autograd), and return None, or with ``async_op=True`` a :class:`~cerar.comm.runtime.work.Work`.
All of a process's cerar calls run in order on one communication thread
(:mod:`cerar.comm.runtime.thread`), so async and sync calls interleave exactly as issued on
every rank; :func:`shutdown` stops it (also at interpreter exit). They come from one Python
thread at a time: a call from a second thread while the first one's calls are in flight waits
until they have completed.

Every call starts with a handshake over the ring's own point-to-point links
(:mod:`cerar.comm.runtime.handshake`; no collective, so none can pair with the program's own collectives
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

from typing import Any

import torch
import torch.distributed as dist

from cerar._checks import check_float, renamed
from cerar.coding.linear_code import MAX_ERROR, Code
from cerar.comm.algorithms.ring.feedback import ErrorFeedback
from cerar.comm.algorithms.workspace import WORKSPACE
from cerar.comm.collective.call import NonFiniteError
from cerar.comm.collective.checks import check_wire_dtype
from cerar.comm.collective.default_code import default_code
from cerar.comm.collective.policies import NONFINITE_POLICIES
from cerar.comm.collective.routes import ROUTES, Route, get_route, route_for, start
from cerar.comm.runtime.groups import group_state
from cerar.comm.runtime.handshake import SettingsMismatchError
from cerar.comm.runtime.stats import CommStats
from cerar.comm.runtime.thread import COMM, DEFAULT_SHUTDOWN_TIMEOUT_S, ShutdownError
from cerar.comm.runtime.work import WaitTimeoutError, Work

__all__ = [
    "NONFINITE_POLICIES",
    "ROUTES",
    "ErrorFeedback",
    "NonFiniteError",
    "Route",
    "SettingsMismatchError",
    "ShutdownError",
    "WaitTimeoutError",
    "Work",
    "all_reduce",
    "default_code",
    "get_route",
    "get_stats",
    "hierarchical_all_reduce",
    "hierarchical_ring_all_reduce",
    "reset_stats",
    "ring_all_reduce",
    "shutdown",
]


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
    wire_dtype: torch.dtype | None = None,
    max_error: float | None = MAX_ERROR,
    stats: CommStats | None = None,
    method: str = "cerar",
    fresh_scale: bool = False,
    packet_dtype: torch.dtype | None = None,
    error_feedback: ErrorFeedback | None = None,
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
        async_op: return a :class:`~cerar.comm.runtime.work.Work` instead of blocking.
        code: the :class:`cerar.Code` to use; its ``world_size`` must equal the group's size.
            Default: :func:`default_code` for the group's size.
        nonfinite: ``"raise"`` (raise :class:`NonFiniteError` on every rank, naming the ranks
            with NaN/Inf), ``"exact"`` (fall back to the exact ring for this call) or
            ``"ignore"`` (skip the check; one NaN then reaches its whole column, all ``c``
            components of its position, on every rank).
        wire_dtype: the dtype of the packets on the wire (the deprecated ``packet_dtype`` is
            accepted with a ``DeprecationWarning``): ``None`` (float64 for float64
            tensors, else float32), ``torch.float32``, ``torch.float64``, or 16 bits,
            ``torch.float16`` or ``torch.bfloat16``: half the bytes, an error near 1-2% (see
            the README), the packets computed in the tensor's precision and rounded once, decoded
            in float64. The default code is then tuned for that precision (pass one built with
            ``precision="fp16"`` etc. to choose it yourself).
        max_error: a ``code`` whose predicted worst-rank error at the packet precision exceeds
            this (default 0.1) is refused with a ValueError naming ``N``, ``c`` and the error (a
            code tuned for float32 would return noise with bfloat16 packets, say); ``None``
            uses it anyway.
        stats: a :class:`cerar.comm.runtime.stats.CommStats` that this call's figures are added to.
        method: ``"cerar"``, another row of :data:`cerar.comm.collective.routes.ROUTES`
            (``"ring-fp16"``, ``"hier-cerar"``...; ``code``, ``packet_dtype`` and
            ``fresh_scale`` apply to CERAR's rows only), or ``"auto"``:
            the calls of this size go by the fastest method whose predicted worst-rank error is
            within ``max_error`` (the exact all-reduce, the float16 ring, CERAR in float32 or
            16 bits), decided from their measured times, the same on every rank
            (:mod:`cerar.comm.auto.collective`, a row it registers; ``code``,
            ``packet_dtype`` and ``fresh_scale`` left at their defaults).
        fresh_scale: take the packet scale from this call's data (every rank's largest
            magnitude, carried by the handshake before the first round, as at the first call of
            a size) instead of from the previous call of this size. For 16-bit packets in a
            stream of calls that other methods interrupted (``method="auto"`` switching back),
            whose remembered scale may no longer fit: such a call would be redone. Every rank
            must pass the same value: on a size the ranks agreed before, a rank that differs
            makes every rank raise :class:`SettingsMismatchError`.
        error_feedback: a :class:`cerar.ErrorFeedback`, for the flat block rows (``ring-int8``,
            ``ring-int4``, ``direct-int8``, ``direct-int4``...): each rank adds what its
            quantizer rounded away at this store's last call to what it quantizes now, so the
            error of the sum over many calls stays bounded. One store per tensor all-reduced call
            after call (a store holding another method's, size's or group's residual is
            refused); every rank must pass one or none (else :class:`SettingsMismatchError`);
            the ranks still end bitwise the same. ``None`` (default): no feedback.

    Packets are scaled by an exact power of two so that they can neither overflow nor fall into
    subnormals (:mod:`cerar.coding.scaling`): every rank's largest magnitude travels with the
    rounds, and a call whose data left the range of the scale it started with (the previous
    call's of its size) is redone at one that fits, the same on every rank (``stats.rescales``).
    """
    wire_dtype = renamed("packet_dtype", packet_dtype, "wire_dtype", wire_dtype)
    options = {"code": code, "wire_dtype": wire_dtype, "fresh_scale": fresh_scale, "error_feedback": error_feedback}
    return start(method, tensor, op, group, async_op, nonfinite=nonfinite, max_error=max_error, stats=stats, **options)


def ring_all_reduce(
    tensor: torch.Tensor,
    op: Any = "sum",
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    *,
    wire_dtype: torch.dtype | None = None,
    stats: CommStats | None = None,
    nonfinite: str = "raise",
) -> Work | None:
    """Exact ring all-reduce (reduce-scatter + all-gather) on cerar's transport, in place.

    The baseline that isolates CERAR's coding gain: same transport, ``2(N-1)/N`` values sent
    per value. With ``wire_dtype=torch.float16`` or ``torch.bfloat16`` the chunks travel in
    16 bits and are accumulated in float32 on each rank; every rank ends with the same values.
    float16 overflow is avoided by scaling: all ranks agree on the largest magnitude ``M`` and
    divide by a power of two so that ``N * M`` maps to about ``2**14`` (which also keeps small
    gradients out of float16's subnormal range), then multiply back; the scaling is exact.

    With ``wire_dtype=torch.int8`` (or ``torch.float8_e4m3fn``) the chunks travel block-quantized
    (:mod:`cerar.coding.blocks`: one scale per block of values, symmetric absmax, round to
    nearest; about 1.03 bytes per value), dequantized and added in float32 and requantized at
    every hop; the owner of a chunk keeps the values it sends, so every rank ends with bitwise
    the same result. ``nonfinite`` applies to these wires, as CERAR's: ``"raise"`` raises
    :class:`NonFiniteError` on every rank before any data moves, ``"exact"`` runs the float32
    ring instead, ``"ignore"`` lets a NaN or Inf make its block NaN. The other wires leave
    non-finite values where they are, as torch's all-reduce does. The wire named runs with no
    error budget (``cerar.all_reduce(t, method="ring-int8", max_error=...)`` has one).
    """
    wire_dtype = check_wire_dtype(wire_dtype)
    route = route_for("ring", wire_dtype)
    return start(
        route, tensor, op, group, async_op, stats=stats, wire_dtype=_own(wire_dtype), nonfinite=nonfinite,
        max_error=None,  # the wire the caller named, with no budget: cerar.all_reduce(method=...) has one
    )


def hierarchical_all_reduce(
    tensor: torch.Tensor,
    op: Any = "sum",
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    *,
    ranks_per_node: int | None = None,
    code: Code | None = None,
    nonfinite: str = "raise",
    wire_dtype: torch.dtype | None = None,
    stats: CommStats | None = None,
    max_error: float | None = MAX_ERROR,
    packet_dtype: torch.dtype | None = None,
) -> Work | None:
    """Sum (or average) ``tensor`` over ``group``, exactly inside each node and with CERAR
    between nodes, in place (:mod:`cerar.comm.collective.hierarchical`).

    Args:
        tensor, op, group, async_op, wire_dtype, stats: as :func:`all_reduce` (the packets are
            those between nodes; ``packet_dtype``, deprecated, as there).
        ranks_per_node: ``G``, ranks on each node; group ranks ``k*G .. k*G + G - 1`` form node
            ``k``. Default: torchrun's ``LOCAL_WORLD_SIZE`` (default group only).
        code: a :class:`cerar.Code` for the number of nodes ``M`` (``code.world_size == M``).
            Default: :func:`cerar.comm.collective.default_code.code_within` for ``M``, the packets'
            precision and ``max_error``.
        nonfinite: ``"raise"``, ``"exact"`` (the shards holding NaN/Inf cross the nodes by the
            exact ring) or ``"ignore"``.
        max_error: as :func:`all_reduce`, for the code between nodes: a given code predicted
            above it is refused, the default replaced by one within it or refused with the figures.
    """
    wire_dtype = renamed("packet_dtype", packet_dtype, "wire_dtype", wire_dtype)
    return start(
        "hier-cerar", tensor, op, group, async_op, ranks_per_node=ranks_per_node, code=code, nonfinite=nonfinite,
        wire_dtype=wire_dtype, stats=stats, max_error=max_error,
    )  # fmt: skip


def hierarchical_ring_all_reduce(
    tensor: torch.Tensor,
    op: Any = "sum",
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    *,
    ranks_per_node: int | None = None,
    stats: CommStats | None = None,
) -> Work | None:
    """:func:`hierarchical_all_reduce` with the exact ring between nodes (``hier-ring``), the
    baseline that isolates CERAR's gain on the links between nodes. Every rank ends with the
    same values, the exact sum up to float rounding (the order of the additions differs from
    the flat ring's). Non-finite values stay where they are, as with :func:`ring_all_reduce`.
    """
    return start("hier-ring", tensor, op, group, async_op, ranks_per_node=ranks_per_node, stats=stats)


def _own(wire: torch.dtype | None) -> torch.dtype | None:
    """A wire of the data's own width (float32, float64) as the ring row's ``wire_dtype``."""
    return wire if wire in (torch.float32, torch.float64) else None


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
        WORKSPACE.clear_all()  # only the threads used them, and they are gone
    return stopped
