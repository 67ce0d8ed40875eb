"""FSDP2's hybrid sharding (HSDP) with CERAR between nodes: shard inside each node, all-reduce the
shards across nodes through cerar.

:func:`hsdp_groups` makes, for ``nodes x ranks_per_node`` ranks numbered node by node (as
torchrun numbers them), each node's exact group (``shard``) and, per local rank, a
:class:`~cerar.comm.group.process_group.CerarProcessGroup` over the ranks of that local rank on
every node (``replicate``), and the meshes FSDP2 takes. Two routes, the same traffic:

(a) ``fully_shard(module, mesh=groups.mesh)``: FSDP2's native HSDP over the 2-D mesh whose
    replicate dimension is cerar's group. Each backward, per parameter group: a reduce-scatter
    inside the node (AVG), then FSDP's all-reduce of its shard over the replicate group (AVG,
    or SUM with a divide after it), which cerar runs. ``set_requires_all_reduce(False)`` on
    every micro-batch but the last reduce-scatters each and all-reduces once (FSDP sums the
    shards itself); ``set_requires_gradient_sync(False)`` communicates only at the last.
(b) ``fully_shard(module, mesh=groups.shard_mesh)`` on each node plus :func:`set_all_reduce_hook`
    (``FSDPModule.set_all_reduce_hook``, the route torchtitan's fault-tolerant training takes):
    the hook gets each parameter group's reduce-scatter output, already averaged over the node,
    and averages it across nodes in place, through cerar's group. ``set_requires_all_reduce``
    does nothing here (the hook runs every micro-batch: right, at a cross-node reduction per
    micro-batch); ``set_requires_gradient_sync(False)`` skips the reduce-scatter and the hook.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cerar._checks import check_int
from cerar.comm.group.create import check_timeout, new_group
from cerar.comm.runtime.groups import require_initialised

__all__ = ["HSDPGroups", "all_reduce_hook", "hsdp_groups", "set_all_reduce_hook"]


@dataclass(frozen=True)
class HSDPGroups:
    """This rank's groups and meshes for HSDP over ``nodes x ranks_per_node`` ranks.

    Attributes:
        replicate: cerar's group of this local rank across the nodes (the mesh's ``replicate``).
        shard: this node's exact group (the mesh's ``shard``).
        mesh: the 2-D ``DeviceMesh`` (``("replicate", "shard")``) for route (a).
        shard_mesh: the 1-D mesh of ``shard`` for route (b).
    """

    replicate: Any
    shard: dist.ProcessGroup
    mesh: Any
    shard_mesh: Any
    nodes: int
    ranks_per_node: int


def hsdp_groups(
    ranks_per_node: int | None = None, *, device_type: str = "cpu", timeout: datetime.timedelta | None = None,
    **settings: Any,
) -> HSDPGroups:  # fmt: skip
    """The groups and meshes of HSDP with CERAR between nodes (see the module doc), over the whole
    world. ``ranks_per_node``: default torchrun's ``LOCAL_WORLD_SIZE``. ``timeout``: how long the
    shard and replicate groups wait for a peer (None: the default group's timeout, not
    ``dist.new_group``'s 30 minutes, so that a stopped rank's node-mates raise when the others
    do). ``settings``: the replicate groups' (:func:`cerar.comm.group.create.new_group`'s
    keywords: ``method``, ``packet_dtype``, ``min_bytes``...). Every rank calls it, at the same point."""
    require_initialised()
    world, rank = dist.get_world_size(), dist.get_rank()
    if ranks_per_node is None:
        text = os.environ.get("LOCAL_WORLD_SIZE")
        if text is None:
            raise ValueError("Argument 'ranks_per_node' must be given without torchrun's LOCAL_WORLD_SIZE, not None.")
        ranks_per_node = int(text)
    g = check_int("ranks_per_node", ranks_per_node, minimum=1)
    if world % g:
        raise ValueError(f"Argument 'ranks_per_node' must divide the world's {world} ranks, not {g}.")
    m = world // g
    timeout = check_timeout(timeout)
    shards = [dist.new_group([k * g + local for local in range(g)], timeout=timeout) for k in range(m)]  # every rank
    replicas = [new_group([k * g + local for k in range(m)], timeout=timeout, **settings) for local in range(g)]
    shard, replicate = shards[rank // g], replicas[rank % g]
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group(
        [replicate, shard], device_type, mesh=torch.arange(world).view(m, g), mesh_dim_names=("replicate", "shard")
    )
    shard_mesh = DeviceMesh.from_group(shard, device_type)
    return HSDPGroups(replicate, shard, mesh, shard_mesh, m, g)


def all_reduce_hook(group: Any) -> Callable[[torch.Tensor], None]:
    """An ``FSDPModule.set_all_reduce_hook`` hook: the average over ``group`` (cerar's group of
    this local rank across nodes), in place, as the hook must leave it."""

    def hook(output: torch.Tensor) -> None:
        dist.all_reduce(output, op=dist.ReduceOp.AVG, group=group)

    return hook


def set_all_reduce_hook(model: nn.Module, group: Any) -> int:
    """Set :func:`all_reduce_hook` on every module ``fully_shard`` made FSDP in ``model`` (the
    hook is per module, not inherited); returns how many."""
    from torch.distributed.fsdp import FSDPModule

    hook, count = all_reduce_hook(group), 0
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(hook)
            count += 1
    return count
