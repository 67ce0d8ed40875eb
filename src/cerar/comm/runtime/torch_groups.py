"""torch.distributed's own all-reduce, as cerar's layers use it, and the groups cerar makes.

* :func:`torch_all_reduce`: the exact sum or average on a group, in place, any layout: what the
  DDP hooks send small, sparse and warm-up buckets through (bitwise DDP's default hook for an
  average), what ``method="auto"`` runs as its exact candidate and its fall-back, and what a
  process group hands the calls it does not code to.
* :func:`new_group_like`: a new group over another group's ranks, with its timeout: the DDP
  hooks' own group (cerar's ring never shares a communicator with the caller's collectives) and
  auto's side group for its agreements.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from cerar.comm.runtime.links import group_timeout

__all__ = ["new_group_like", "torch_all_reduce"]


def torch_all_reduce(
    tensor: torch.Tensor, group: dist.ProcessGroup | None, *, average: bool = False, async_op: bool = False
) -> torch.futures.Future[list[torch.Tensor]] | None:
    """Sum ``tensor`` over ``group`` in place with ``torch.distributed.all_reduce``; ``average``
    divides it by the group's size first, as ``default_hooks.allreduce_hook`` does (so a DDP
    bucket averaged here is bitwise DDP's default). A non-contiguous tensor is reduced through a
    contiguous copy. Returns a future of ``[tensor]`` with ``async_op``, else None (done)."""
    group = dist.group.WORLD if group is None else group
    if average:
        tensor.div_(dist.get_world_size(group))
    work_on = tensor if tensor.layout != torch.strided or tensor.is_contiguous() else tensor.contiguous()
    work = dist.all_reduce(work_on, group=group, async_op=True)
    if work_on is tensor:
        future = work.get_future()
        if not async_op:
            future.wait()
            return None
        return future

    def copy_back(done: torch.futures.Future[Any]) -> list[torch.Tensor]:
        done.value()
        tensor.copy_(work_on)
        return [tensor]

    chained = work.get_future().then(copy_back)
    if not async_op:
        chained.wait()
        return None
    return chained


def new_group_like(process_group: dist.ProcessGroup | None, backend: str | None = None) -> dist.ProcessGroup:
    """A new group over ``process_group``'s ranks (every member must call it at the same point),
    with its timeout (``dist.new_group``'s own default is 30 minutes, and a dead peer would be
    noticed only then) and ``backend`` (default: the default group's). A group smaller than the
    world is created by its members only (``use_local_synchronization``), since the other ranks
    never get here."""
    ranks = sorted(dist.get_process_group_ranks(process_group or dist.group.WORLD))
    options: dict[str, Any] = {"ranks": ranks, "timeout": group_timeout(process_group)}
    if backend is not None:
        options["backend"] = backend
    if len(ranks) != dist.get_world_size():
        # Its name hashes the ranks and the number of groups each member knows, equal on members
        # that made the same groups.
        options["use_local_synchronization"] = True
    return dist.new_group(**options)
