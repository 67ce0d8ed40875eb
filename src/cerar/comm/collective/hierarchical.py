"""Hierarchical all-reduce for clusters of nodes: exact inside each node, CERAR or the ring in any
wire between nodes.

A group of ``N = M x G`` ranks on ``M`` nodes of ``G`` ranks each (group ranks
``k*G .. k*G + G - 1`` on node ``k``, as torchrun numbers them) reduces one tensor in three stages:

1. an exact reduce-scatter inside each node, with the node group's built-in collective
   (``dist.reduce_scatter_tensor``: NCCL on GPU, Gloo on CPU): local rank ``l`` ends with the
   node's sum of shard ``l`` (``ceil(d / G)`` values; the tensor is zero padded to ``G`` shards);
2. across nodes, one ring per local rank: the ``M`` ranks with local rank ``l`` all-reduce
   shard ``l`` with CERAR (a code for ``M`` ranks, :func:`hierarchical_all_reduce`) or with the
   ring in the row's wire (``hier-ring``: exact, :func:`hierarchical_ring_all_reduce`;
   ``hier-ring-int8``, ``hier-ring-int4``...: the block wires, whose ``nonfinite`` policy works as
   CERAR's here). The ``G`` rings run at the same time, on
   different node pairs, so each node's link carries ``G`` shards' worth: per node,
   ``1 + (M-2)/c`` tensors for CERAR and ``2(M-1)/M`` for the ring, against the flat ring's
   ``G x 2(N-1)/N``;
3. an exact all-gather inside each node (``dist.all_gather_into_tensor``).

Every rank of a node ends with the same values; nodes differ by CERAR's decoding error (within
the code's error bound for the node sums), as the ranks of the flat :func:`cerar.all_reduce` do.

The promises of the flat collective hold, checked before any data moves:

* a handshake over the whole group's ring (:func:`cerar.comm.runtime.handshake.handshake`) checks that
  every rank runs the same call: method, ``ranks_per_node``, code, dtype, size, op, policy and
  call number; a mismatch raises :class:`SettingsMismatchError` with the same message on every
  rank. The first call of a ``(group, ranks_per_node)`` also agrees on the layout before the
  node groups are created, so ranks that disagree on ``ranks_per_node`` raise instead of
  hanging in ``dist.new_group``;
* ``nonfinite``: ``"raise"`` raises :class:`NonFiniteError` on every rank naming the group ranks
  whose input held NaN/Inf (the tensor is left as it was); ``"exact"`` sends the shards that
  hold NaN/Inf through the exact ring across nodes (the others still use CERAR), so NaN/Inf stay
  where the exact sum puts them; ``"ignore"`` skips the check;
* a dead or stalled peer makes every survivor raise :class:`cerar.transport.RingError`: in the
  node stages the node group's collective fails (within the parent group's timeout, which the
  node groups inherit), and across nodes the ring's point-to-point waits do.

Bytes: ``CommStats.bytes_sent`` counts what this rank sent between nodes, measured at cerar's
transport (the built-in node collectives are not counted); a node's link carries the sum over
its ``G`` ranks.

Layout: :mod:`cerar.comm.runtime.layout` (:class:`NodeLayout`, from ``ranks_per_node`` or torchrun's
variables) and :mod:`cerar.comm.runtime.nodes` (the node groups and the rings between nodes, made once
per ``(group, ranks_per_node)``); this module is one call's body.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from cerar.comm.algorithms.workspace import WORKSPACE
from cerar.comm.collective.call import NonFiniteError, call_context, cerar_call, items, ring_call
from cerar.comm.collective.request import Request
from cerar.comm.runtime.handshake import Summary, handshake, max_around, settings_hash
from cerar.comm.runtime.links import Ring, RingError
from cerar.comm.runtime.nodes import Nodes
from cerar.comm.runtime.stats import CommStats

__all__ = ["hierarchical_call"]

#: Point-to-point tag of the failure path's non-finite flags (the collective's use 0x0CE0..0x0CE3).
NONFINITE_TAG = 0x0CE8


# ---------------------------------------------------------------------------------------------
# One call (on the communication thread)


def hierarchical_call(request: Request, nodes: Nodes) -> None:
    """One hierarchical call of ``request`` (its route ``hier-cerar``, with CERAR's code for the
    nodes bound by the route, or ``hier-ring`` in any wire).

    1. Open it (:func:`cerar.comm.collective.call.call_context`: its number, its statistics, the
       working copy) and run the handshake over the group's ring.
    2. Reduce-scatter inside the node into this local rank's shard.
    3. All-reduce the shard across nodes (CERAR, or the ring in the request's wire, via the
       collective's own call on the ring of this local rank, with its handshake, scaling and
       fallback, a stage of this call whose figures it records).
    4. ``nonfinite="raise"``: the nodes' ranks agree whether any shard fell back; if so,
       every rank raises naming the ranks with NaN/Inf, the tensor unchanged.
    5. Divide (``avg``) and all-gather inside the node; write back.
    """
    layout, code, nonfinite, coded = nodes.layout, request.code, request.nonfinite, request.code is not None
    tensor, op, wire = request.tensor, request.op, request.wire
    # The ring between nodes falls back where a shard is not finite (the call raises after, with
    # "raise", once every node knows); the float rings leave NaN/Inf where they are.
    policy = "ignore" if nonfinite == "ignore" else "exact"
    if not coded and not wire.quantized:
        policy = "ignore"
    with call_context(tensor, nodes.flat, request.stats) as (flat, call, counter):
        fingerprint = code.fingerprint if code is not None else None
        identity = (request.route, layout.ranks_per_node, fingerprint, str(tensor.dtype), flat.numel(), op)
        identity += (nonfinite, repr(wire), repr(request.max_error), *items(request.context))
        summary: Summary = (
            f"{request.route}, ranks_per_node {layout.ranks_per_node}, {code!r}, values {tensor.dtype}, "
            f"size {flat.numel()}, op {op}, nonfinite={nonfinite!r}, wire {wire.name}"
        )
        if request.context is not None:
            summary = {**request.context, "method": f"{request.route}, {code!r}", "wire": wire.name}
        handshake(nodes.flat, settings_hash(identity), counter, summary, device=flat.device, stats=call)
        if layout.world_size == 1:
            return
        d = flat.numel()
        shard_size = math.ceil(d / layout.ranks_per_node)
        padded = WORKSPACE.padded("hier_padded", flat, shard_size * layout.ranks_per_node)
        shard = padded
        if nodes.node_group is not None:
            shard = WORKSPACE.get("hier_shard", (shard_size,), flat.dtype, flat.device)
            _in_node(nodes, "reduce-scatter", dist.reduce_scatter_tensor, shard, padded)
        if nodes.cross is not None:  # a stage of this call: its figures are this call's
            stage = dataclasses.replace(request, tensor=shard, op="sum", nonfinite=policy, stats=None, context=None)
            (cerar_call if coded else ring_call)(stage, nodes.cross, within=call)
        if nonfinite == "raise" and policy == "exact":
            _raise_if_nonfinite(nodes, call, flat)
        if op == "avg":
            shard.div_(layout.world_size)
        if nodes.node_group is not None:
            _in_node(nodes, "all-gather", dist.all_gather_into_tensor, padded, shard)
        if padded is not flat:
            flat.copy_(padded[:d])


def _in_node(nodes: Nodes, what: str, collective: Callable[..., Any], *args: Any) -> None:
    """Run ``collective(*args, group=node group)``; its failure becomes :class:`RingError`."""
    try:
        collective(*args, group=nodes.node_group)
    except RuntimeError as exc:
        layout = nodes.layout
        raise RingError(
            f"cerar: the node group's {what} failed on group rank {layout.rank} (node {layout.node}, local rank "
            f"{layout.local_rank}): a peer died or stalled past the process group's timeout. Cause: {exc}"
        ) from exc


def _raise_if_nonfinite(nodes: Nodes, call: CommStats, flat: torch.Tensor) -> None:
    """Raise :class:`NonFiniteError` on every rank if any shard's ring fell back to the exact
    ring (NaN/Inf there). The ranks of one ring decide alike and every node holds one rank of
    each ring, so one maximum over the node tells every rank of the group the same."""
    fell_back = torch.tensor([1.0 if call.fallbacks else 0.0], device=flat.device)
    if nodes.node_group is not None:
        _in_node(nodes, "non-finite flag", dist.all_reduce, fell_back, dist.ReduceOp.MAX)
    if not float(fell_back.item()):
        return
    call.nonfinite_events += 1
    call.fallbacks = 0  # the exact ring only found it: the call raises
    flagged = _flagged_ranks(nodes.flat, bool(torch.isfinite(flat).all()), flat.device)
    raise NonFiniteError(
        f"cerar.hierarchical_all_reduce: NaN or Inf in the input of rank(s) {flagged} (group ranks); "
        f"the mixing or the blocks between nodes would spread it on every node. "
        f"Pass nonfinite='exact' to send the shards that hold it through the exact ring instead."
    )


def _flagged_ranks(ring: Ring, finite: bool, device: torch.device) -> list[int]:
    """The group ranks whose input is not finite, on every rank: the handshake's element-wise
    maximum over the group's ring (the failure path only)."""
    own = torch.zeros(ring.size, dtype=torch.float64, device=device)
    own[ring.rank] = 0.0 if finite else 1.0
    total = max_around(ring, own, NONFINITE_TAG)
    return [r for r in range(ring.size) if total[r] > 0]
