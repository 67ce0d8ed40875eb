"""Where a rank sits in a group of nodes: :class:`NodeLayout`, from ``ranks_per_node`` or torchrun's
environment variables (:func:`node_layout`).

A group of ``N = M x G`` ranks on ``M`` nodes of ``G`` ranks each holds group ranks
``k*G .. k*G + G - 1`` on node ``k``, as torchrun numbers them. The hierarchical collectives
(:mod:`cerar.comm.collective.hierarchical`) and their DDP state read the layout from here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist

from cerar._checks import check_int
from cerar.comm.runtime.groups import require_initialised

__all__ = ["NodeLayout", "node_layout"]


@dataclass(frozen=True)
class NodeLayout:
    """This rank's place in a group of ``nodes x ranks_per_node`` ranks (group numbering).

    Attributes:
        world_size: ranks in the group (``N = nodes * ranks_per_node``).
        ranks_per_node: ``G``, ranks on each node.
        nodes: ``M``, nodes in the group.
        rank: this rank's group rank, ``node * G + local_rank``.
        node: this rank's node, ``0 .. M - 1``.
        local_rank: this rank's place on its node, ``0 .. G - 1``.
    """

    world_size: int
    ranks_per_node: int
    nodes: int
    rank: int
    node: int
    local_rank: int

    def node_ranks(self, node: int) -> list[int]:
        """The group ranks of ``node``."""
        return list(range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node))

    def cross_ranks(self, local_rank: int) -> list[int]:
        """The group ranks of local rank ``local_rank`` on every node (one ring between nodes)."""
        return [k * self.ranks_per_node + local_rank for k in range(self.nodes)]


def node_layout(group: dist.ProcessGroup | None = None, ranks_per_node: int | None = None) -> NodeLayout | None:
    """The :class:`NodeLayout` of the calling rank in ``group`` (None for a non-member).

    1. ``ranks_per_node`` given: it must be a positive integer dividing the group's size.
    2. Otherwise (default group only) torchrun's ``LOCAL_WORLD_SIZE``; ``LOCAL_RANK`` and
       ``GROUP_RANK``, where set, must agree with ranks being numbered node by node
       (``rank = GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK``), as torchrun numbers them.
    """
    require_initialised()
    rank = dist.get_rank(group)
    if rank < 0:
        return None
    size = dist.get_world_size(group)
    g = _ranks_per_node(group, rank, size, ranks_per_node)
    return NodeLayout(size, g, size // g, rank, rank // g, rank % g)


def _ranks_per_node(group: dist.ProcessGroup | None, rank: int, size: int, ranks_per_node: int | None) -> int:
    if ranks_per_node is None:
        if group is not None and group is not dist.group.WORLD and dist.get_world_size(group) != dist.get_world_size():
            raise ValueError("Argument 'ranks_per_node' must be given for a subgroup, not None.")
        g, source = _local_world_size(rank), "LOCAL_WORLD_SIZE"
    else:
        g, source = check_int("ranks_per_node", ranks_per_node, minimum=1), "ranks_per_node"
    if g < 1 or size % g:
        raise ValueError(f"Argument '{source}' must divide the group's size {size}, not {g}.")
    return g


def _local_world_size(rank: int) -> int:
    """torchrun's ``LOCAL_WORLD_SIZE``, checked against ``LOCAL_RANK`` and ``GROUP_RANK`` where set."""
    text = os.environ.get("LOCAL_WORLD_SIZE")
    if text is None:
        raise ValueError(
            "Argument 'ranks_per_node' must be given when LOCAL_WORLD_SIZE is not set (torchrun sets it), not None."
        )
    try:
        g = int(text)
    except ValueError:
        raise ValueError(f"Environment variable LOCAL_WORLD_SIZE must be an integer, not {text!r}.") from None
    for name, expected in (("LOCAL_RANK", rank % max(g, 1)), ("GROUP_RANK", rank // max(g, 1))):
        value = os.environ.get(name)
        if value is not None and g > 0 and value != str(expected):
            raise ValueError(
                f"Environment variable {name}={value} does not match rank {rank} with LOCAL_WORLD_SIZE={g} "
                f"(expected {expected}): ranks must be numbered node by node; pass ranks_per_node."
            )
    return g
