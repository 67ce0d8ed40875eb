"""The node groups and rings of a hierarchical ``(group, ranks_per_node)``, created once.

The node groups (``dist.new_group``, a collective) are created once per ``(group, ranks_per_node)``
on the caller's thread, in the same order on every rank, and cached in the group's
:class:`cerar.comm.runtime.groups.GroupState`; for the default group every rank creates every node's
group, for a subgroup each member creates its own node's (``use_local_synchronization``). The
rings between nodes need no group of their own: they are point-to-point on the parent group
between the ranks of equal local rank. The first call of a ``(group, ranks_per_node)`` agrees on
the layout over the whole group's ring before any node group is made, so ranks that disagree on
``ranks_per_node`` raise instead of hanging in ``dist.new_group``.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cerar.comm.runtime.groups import count_call, group_state, ring_of
from cerar.comm.runtime.handshake import handshake, settings_hash
from cerar.comm.runtime.layout import NodeLayout, node_layout
from cerar.comm.runtime.links import Ring, group_timeout
from cerar.comm.runtime.thread import COMM

__all__ = ["Nodes", "prepare_nodes"]


@dataclass(frozen=True)
class Nodes:
    """One rank's groups and rings for a hierarchical ``(group, ranks_per_node)``."""

    group: dist.ProcessGroup | None
    layout: NodeLayout
    flat: Ring  # the whole group's ring: the handshake and the failure path's flags
    node_group: dist.ProcessGroup | None  # this rank's node (None when G == 1)
    cross: Ring | None  # the ring of this local rank across nodes (None when M == 1)


_NODES_LOCK = threading.Lock()  # the node groups live in the group's GroupState


def prepare_nodes(group: dist.ProcessGroup | None, ranks_per_node: int | None, device: torch.device) -> Nodes | None:
    """This rank's :class:`Nodes` for ``group``, set up at the first call of the pair.

    1. Resolve the layout (``ranks_per_node`` or torchrun's variables); non-members get None.
    2. At the first call for ``(group, G)``: agree on ``G`` over the group's ring, on the
       communication thread behind the calls already queued (a mismatch raises
       :class:`SettingsMismatchError` on every rank before any group is made).
    3. Create the node groups on this thread, in node order, and cache them.
    """
    flat = ring_of(group)
    if flat is None:
        return None
    layout = node_layout(group, ranks_per_node)
    assert layout is not None
    cache = group_state(group).nodes
    with _NODES_LOCK:
        cached = cache.get(layout.ranks_per_node)
    if cached is not None:
        return cached
    COMM.submit(functools.partial(_agree_layout, flat, layout, device), torch.empty(0), False, group)
    node_group = _node_groups(group, layout)
    cross = _cross_ring(group, layout) if layout.nodes > 1 else None
    nodes = Nodes(group, layout, flat, node_group, cross)
    with _NODES_LOCK:
        cache[layout.ranks_per_node] = nodes
    return nodes


def _agree_layout(flat: Ring, layout: NodeLayout, device: torch.device) -> None:
    counter = count_call(flat.group)
    summary = f"hierarchical layout, {layout.nodes} nodes x {layout.ranks_per_node} ranks_per_node"
    handshake(
        flat,
        settings_hash(("hierarchical-layout", layout.world_size, layout.ranks_per_node)),
        counter,
        summary,
        device=device,
    )


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _node_groups(group: dist.ProcessGroup | None, layout: NodeLayout) -> dist.ProcessGroup | None:
    if layout.ranks_per_node == 1:
        return None
    timeout = group_timeout(group)
    members = [[_global(group, r) for r in layout.node_ranks(k)] for k in range(layout.nodes)]
    if layout.world_size == dist.get_world_size():  # every rank of the job takes part: make all, in order
        made = [dist.new_group(ranks=ranks, timeout=timeout) for ranks in members]
        return made[layout.node]
    return dist.new_group(ranks=members[layout.node], timeout=timeout, use_local_synchronization=True)


def _cross_ring(group: dist.ProcessGroup | None, layout: NodeLayout) -> Ring:
    """The ring of this local rank across nodes, point to point on the parent group."""
    ranks = layout.cross_ranks(layout.local_rank)
    m, k = layout.nodes, layout.node
    # Its peers too: the handshake's hops need them.
    return Ring(group, k, m, ranks[(k + 1) % m], ranks[(k - 1) % m], tuple(ranks))
