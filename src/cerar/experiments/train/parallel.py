"""Training through cerar's process group instead of a DDP hook (``cerar.group``):

* ``group:<method>``: DDP over a :class:`cerar.group.CerarProcessGroup` that runs the method (no
  hook: DDP's buckets reach the group's ``allreduce``);
* ``hsdp:<method>``: FSDP2's hybrid sharding on the launcher's emulated nodes (``--nodes M
  --ranks-per-node G``): each transformer layer and the model sharded over the node's ranks, the
  shards all-reduced across the nodes by cerar's group (the mesh's replicate dimension).

The method runs in the group: ``allreduce`` (every all-reduce handed to the exact group: the
baseline through the same wrapper), ``ring``, ``fp16`` (the 16-bit ring on cerar's transport),
``int8`` and ``fp8`` (the 8-bit rings), ``int4`` (the 4-bit ring),
``cerar[:c|:kN][:fp16]`` (``N`` the nodes under ``hsdp``) and ``auto[:budget]``. Exposed
communication: under ``group``, from the end of backward's compute to the group's last
all-reduce; under ``hsdp``, whose all-reduce across nodes blocks inside backward, the seconds the
step spent in it. Bytes: what this rank sent across the group (the coded calls' measured at the
transport, the exact ones' by the ring's ``2(n-1)/n``). Torch loads only when a run is built.
"""

from __future__ import annotations

import inspect
import os
from typing import TYPE_CHECKING, Any

from cerar.experiments.train.installed import BLOCK_METHODS, COUNTERS, HookSettings, InstalledHook, cerar_code
from cerar.experiments.train.timeline import Timeline

if TYPE_CHECKING:
    from torch import nn

__all__ = ["GROUP_METHODS", "PARALLELS", "build_parallel", "check_parallel", "no_buffer_sync"]

#: The process-group ways of a run (``"ddp"``, the hook, is the default) and the methods they run.
PARALLELS = ("group", "hsdp")
GROUP_METHODS = ("allreduce", "ring", "fp16", "cerar", "auto", *BLOCK_METHODS)
_NEVER = 2**62  # a min_bytes no tensor reaches: every all-reduce to the exact group


def check_parallel(config: Any) -> None:
    """Raise ``ValueError`` naming the argument and the value where ``parallel`` does not fit."""
    if config.parallel == "ddp":
        return
    if config.parallel not in PARALLELS:
        raise ValueError(f"Argument 'parallel' must be one of 'ddp', 'group', 'hsdp', not {config.parallel!r}.")
    if config.method not in GROUP_METHODS:
        raise ValueError(
            f"Argument 'method' of {config.parallel} must be one of {', '.join(GROUP_METHODS)}, not {config.method!r}."
        )
    if config.schedule is not None:
        raise ValueError(f"Argument 'schedule' does not apply to {config.parallel}, not {config.schedule!r}.")
    if getattr(config, "error_feedback", False):
        raise ValueError(
            f"Argument 'error_feedback' (+ef) is not offered under {config.parallel}: cerar's process group has no "
            f"error feedback (its effect on the loss stayed inside allreduce's seed spread, docs/results.md), "
            f"not {config.method}+ef."
        )


def no_buffer_sync() -> dict[str, bool]:
    """DDP's option not to broadcast buffers every forward (the model's only buffers are rotary
    constants, equal on every rank); torch 2.13 renamed it."""
    from torch.nn.parallel import DistributedDataParallel

    named = "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if named else {"broadcast_buffers": False}


def group_settings(config: HookSettings, ranks: int) -> dict[str, Any]:
    """``cerar.group.new_group``'s keywords for ``config.method`` over ``ranks`` ranks."""
    min_bytes = round(config.min_bucket_mb * 2**20)
    common = {"min_bytes": min_bytes, "nonfinite": config.nonfinite}
    if config.method == "allreduce":
        return {"min_bytes": _NEVER}
    if config.method in ("ring", "fp16", "int8", "fp8", "int4", "int3", "int2"):
        # No error budget: training measures its quality by the loss (the 4-bit ring predicts 0.19).
        row = "ring" if config.method == "ring" else f"ring-{config.method}"
        return {**common, "method": row, "max_error": None}
    if config.method.startswith("direct-"):
        return {**common, "method": config.method, "max_error": None}
    if config.method == "auto":
        return {**common, "method": "auto", **({} if config.max_error is None else {"max_error": config.max_error})}
    precision = config.packet or "fp32"
    components = config.components if config.components is not None else 2 * ranks
    row = "cerar" if precision == "fp32" else f"cerar-{precision}"  # cerar: the data's own (float32)
    return {**common, "method": row, "code": cerar_code(ranks, components, precision)}


class GroupInstalled(InstalledHook):
    """A method run through a cerar group: its counters from the group's routes and the
    transport's statistics (see the module doc)."""

    def __init__(self, name: str, description: str, group: Any, ranks: int) -> None:
        super().__init__(name, True, description)
        self.group, self.ranks = group, ranks

    def counters(self) -> dict[str, float]:
        from cerar.comm.collective.api import get_stats

        routes, wire = self.group.stats.as_dict(), get_stats(self.group.transport)
        coded = sum(v["calls"] for v in routes.get("cerar", {}).values())
        exact_reduced = sum(v["bytes"] for op, v in routes.get("exact", {}).items() if op in ("sum", "avg"))
        exact_calls = sum(v["calls"] for op, v in routes.get("exact", {}).items() if op in ("sum", "avg"))
        ring = 2 * (self.ranks - 1) / self.ranks if self.ranks > 1 else 0.0
        figures = dict.fromkeys(COUNTERS, 0.0)
        figures.update(
            bytes_sent=float(wire.bytes_sent) + ring * exact_reduced,
            collectives=float(coded + exact_calls),
            encode_s=wire.encode_s,
            decode_s=wire.decode_s,
            collective_wall_s=sum(v["seconds"] for ops in routes.values() for v in ops.values()),
            fallbacks=float(wire.fallbacks),
            nonfinite_events=float(wire.nonfinite_events),
            exact_buckets=float(exact_calls),
            rescales=float(wire.rescales),
            syncs=float(self.syncs),
        )
        return figures


class GroupTimeline(Timeline):
    """The step's exposed communication through a group (see the module doc): ``blocking``
    (HSDP) counts the seconds in the group's all-reduces, otherwise from the end of backward's
    compute to the group's last all-reduce's completion."""

    def __init__(self, module: nn.Module, group: Any, blocking: bool) -> None:
        super().__init__(module)
        self.group, self.blocking = group, blocking
        self._seconds = self._calls = 0.0

    def _totals(self) -> tuple[float, float]:
        routes = self.group.stats.as_dict()
        values = [v for ops in routes.values() for op, v in ops.items() if op in ("sum", "avg")]
        return sum(v["seconds"] for v in values), sum(v["calls"] for v in values)

    def begin(self) -> None:
        super().begin()
        self._seconds, self._calls = self._totals()

    def exposed(self) -> float:
        seconds, calls = self._totals()
        self.buckets = int(calls - self._calls)
        if self.blocking:
            return seconds - self._seconds
        last = self.group.stats.last_done
        return max(0.0, last - self.compute_end) if self.compute_end and self.buckets else 0.0


def build_parallel(config: Any, module: nn.Module, world_size: int) -> tuple[Any, InstalledHook, Timeline, Any]:
    """``(model to step, installed method, timeline, replicas' group)`` of a ``group`` or
    ``hsdp`` run; the replicas' group is what :func:`cerar.ddp.replica_divergence` compares over
    (None: the world)."""
    from torch.nn.parallel import DistributedDataParallel

    from cerar.comm.group.create import new_group
    from cerar.comm.group.hsdp import hsdp_groups

    if config.parallel == "group":
        group = new_group(**group_settings(config, world_size))
        cap = config.bucket_cap_mb
        model = DistributedDataParallel(module, process_group=group, bucket_cap_mb=cap, **no_buffer_sync())
        description = f"DDP over cerar's group ({group.settings.method})"
        installed = GroupInstalled(config.method, description, group, world_size)
        return model, installed, GroupTimeline(module, group, blocking=False), None
    from torch.distributed.fsdp import fully_shard

    per_node = int(os.environ.get("CERAR_RANKS_PER_NODE") or os.environ.get("LOCAL_WORLD_SIZE") or "1")
    nodes = world_size // per_node
    groups = hsdp_groups(per_node, **group_settings(config, nodes))
    for layer in module.gpt_neox.layers:
        fully_shard(layer, mesh=groups.mesh)
    fully_shard(module, mesh=groups.mesh)
    description = f"FSDP2 HSDP, {nodes} nodes x {per_node}, cerar's group ({groups.replicate.settings.method}) between"
    installed = GroupInstalled(config.method, description, groups.replicate, nodes)
    return module, installed, GroupTimeline(module, groups.replicate, blocking=True), groups.replicate
