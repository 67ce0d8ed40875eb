"""One key per process group: ``None`` and ``WORLD`` are one group, and groups destroyed and
created again never inherit each other's call counters, statistics or scales."""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist

import cerar
from cerar.coding import codes
from cerar.comm.collective import api as collective
from cerar.comm.runtime.groups import group_state
from multirank import check, run_ranks


def _world_worker(rank: int, world: int) -> tuple[bool, int, int, bool]:
    collective.reset_stats()
    cerar.all_reduce(torch.randn(100), code=codes.exact(world))
    cerar.all_reduce(torch.randn(100), group=dist.group.WORLD, code=codes.exact(world))
    same = collective.get_stats() is collective.get_stats(dist.group.WORLD)
    one_state = group_state(None) is group_state(dist.group.WORLD)
    return same, collective.get_stats().calls, group_state(None).calls, one_state


def test_none_and_world_are_one_group() -> None:
    for same, calls, counted, one_state in check(run_ranks(_world_worker, 3, timeout=60)):
        assert same and one_state
        assert calls == 2 and counted == 2


def _recreated_groups_worker(rank: int, world: int) -> list[tuple[int, float]]:
    found = []
    for generation in range(6):
        # Subgroups whose call counts differ from rank to rank, then destroyed: on some ranks and
        # not others the allocator hands their addresses to the next groups.
        pair = dist.new_group([0, 1])
        if rank in (0, 1):
            for _ in range(generation % 3 + 1):
                cerar.all_reduce(torch.randn(64), group=pair, code=codes.exact(2))
        dist.destroy_process_group(pair)
        del pair
        gc.collect()
        group = dist.new_group(list(range(world)))
        x = torch.full((300,), float(rank + 1))
        cerar.all_reduce(x, group=group, code=codes.perturbed(world, 2 * world))
        found.append((collective.get_stats(group).calls, float(x.mean())))
        dist.destroy_process_group(group)
        del group
        gc.collect()
    return found


def test_groups_destroyed_and_created_again_start_afresh() -> None:
    expected = sum(range(1, 4 + 1))
    for found in check(run_ranks(_recreated_groups_worker, 4, timeout=120)):
        for calls, mean in found:
            assert calls == 1  # a new group's own statistics, not an old one's
            assert abs(mean - expected) < 1e-3 * expected
