"""What a training method leaves on a rank once installed (:class:`InstalledHook`: its counters
and its per-step duty), what it reads of the config (:class:`HookSettings`), and the byte
formula and codes the methods share. Torch loads only when a counter is read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "BLOCK_METHODS", "COUNTERS", "ROWS", "Build", "Count", "HookSettings", "InstalledHook", "cerar_code", "ring_bytes",
]  # fmt: skip

#: The route table's row (:mod:`cerar.comm.collective.routes`) each training method's all-reduce
#: runs, where one does (``cerar`` with 16-bit packets: ``cerar-fp16``...; PowerSGD and auto
#: have their own hooks): the DDP hooks, the schedules' averages and the process groups.
ROWS = {
    "allreduce": "exact", "fp16": "torch-fp16", "bf16": "torch-bf16", "ring": "ring", "int8": "ring-int8",
    "fp8": "ring-fp8", "int4": "ring-int4", "int3": "ring-int3", "int2": "ring-int2", "cerar": "cerar",
    **{f"direct-{wire}": f"direct-{wire}" for wire in ("int8", "int4", "int3", "int2")},
}  # fmt: skip
#: The methods whose all-reduce quantizes in blocks: they take error feedback (``+ef``).
BLOCK_METHODS = ("int8", "fp8", "int4", "int3", "int2", "direct-int8", "direct-int4", "direct-int3", "direct-int2")

#: What :meth:`InstalledHook.counters` returns, in order.
COUNTERS = (
    "bytes_sent", "collectives", "encode_s", "decode_s", "collective_wall_s", "fallbacks", "nonfinite_events",
    "resyncs", "resync_s", "exact_buckets", "rescales", "syncs", "sync_s",
)  # fmt: skip


class HookSettings(Protocol):
    """What a hook reads of a :class:`~cerar.experiments.train.config.TrainConfig` (a protocol,
    not the class: the config imports this module)."""

    method: str
    components: int | None
    packet: str | None
    powersgd_rank: int
    powersgd_start: int
    seed: int
    nonfinite: str
    resync_every: int | None
    divergence_tol: float | None
    min_bucket_mb: float
    max_error: float | None
    error_feedback: bool


@dataclass
class InstalledHook:
    """A hook installed on one DDP model: cumulative counters and the per-step duty.

    ``syncs`` counts the steps whose gradients were averaged (every step, for a DDP hook);
    ``micro_batches`` is how many backward passes a step takes (``accum:K``: ``K``).
    """

    name: str
    measured_bytes: bool
    description: str
    state: Any = None
    bytes_computed: int = 0
    collectives: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    syncs: int = 0
    micro_batches: int = 1

    def counters(self) -> dict[str, float]:
        """Cumulative figures of this rank: bytes sent, collectives, encode/decode seconds,
        fallbacks, non-finite events, resyncs."""
        from cerar.comm.ddp.hooks import CerarState

        if isinstance(self.state, CerarState):
            stats = self.state.stats
            computed = self.bytes_computed + getattr(self.state, "torch_bytes", 0)  # auto's torch buckets
            return {
                "bytes_sent": float(stats.bytes_sent + computed),  # + exact buckets' computed
                "collectives": float(self.collectives),
                "encode_s": stats.encode_s,
                "decode_s": stats.decode_s,
                "collective_wall_s": stats.wall_s,
                "fallbacks": float(stats.fallbacks),
                "nonfinite_events": float(stats.nonfinite_events),
                "resyncs": float(self.state.resyncs),
                "resync_s": self.state.resync_s,
                "exact_buckets": float(self.state.exact_buckets),
                "rescales": float(stats.rescales),
                "syncs": float(self.syncs),
                "sync_s": 0.0,  # a hook's communication is inside backward (the timeline's)
            }
        # Gloo's own collectives: only the computed bytes and the count are known.
        figures = dict.fromkeys(COUNTERS, 0.0)
        figures.update(
            bytes_sent=float(self.bytes_computed), collectives=float(self.collectives), syncs=float(self.syncs)
        )
        return figures

    def wrap_optimizer(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer the loop steps (a schedule may wrap the AdamW; a DDP hook leaves it)."""
        return optimizer

    def after_step(self, model: nn.Module) -> bool:
        """Run after every optimizer step on every rank: CERAR's scheduled or threshold re-sync."""
        from cerar.comm.ddp.hooks import CerarState

        self.syncs += 1
        if isinstance(self.state, CerarState):
            return self.state.maybe_resync(model)
        return False


#: ``bucket -> None``, called right before each bucket's hook (the byte accounting).
Count = Callable[[Any], None]
#: ``(settings, N) -> (installed, hook, hook state, count)``.
Build = Callable[[HookSettings, int], tuple[InstalledHook, Any, Any, Count]]


def ring_bytes(world_size: int, elements: int, element_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``elements`` values: ``2(N-1)/N`` of them."""
    return round(2 * (world_size - 1) / world_size * elements * element_size)


def cerar_code(world_size: int, components: int, precision: str) -> Any:
    """``cerar``'s code: ``perturbed(N, c)`` for float32 packets, ``optimized(N, c)`` designed
    for the precision of 16-bit ones (``precision``: ``"fp32"``, ``"fp16"`` or ``"bf16"``)."""
    from cerar.coding import codes

    if precision == "fp32":
        return codes.perturbed(world_size, components)
    return codes.optimized(world_size, components, precision)
