"""Replica consistency of data-parallel models: how far the ranks' parameters have drifted
(:func:`replica_divergence`) and how to make them equal again (:func:`resync`).

CERAR's ranks decode slightly different approximations of the gradient sum, so replicas that
start equal drift apart slowly; :class:`ReplicaSync`, the part of
:class:`cerar.comm.ddp.hooks.CerarState` that holds the model-side schedule, uses these two to measure
the drift and re-synchronise on a schedule or a threshold. Both are collectives on ``group``.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cerar._checks import check_float, check_int

__all__ = ["SKETCH_SIZE", "ReplicaSync", "Replicas", "replica_divergence", "resync"]

SKETCH_SIZE = 1024  # CountSketch buckets: the norm estimate's relative spread is about sqrt(2/k)
_SKETCH_SEED = 0x5EED


def replica_divergence(model: nn.Module, group: dist.ProcessGroup | None = None) -> float:
    r"""``max_j ||theta_j - theta_0|| / ||theta_0||`` over the ranks of ``group``, estimated cheaply.

    Each rank compresses its parameters (in ``model.parameters()`` order, as float64) into a
    CountSketch of :data:`SKETCH_SIZE` values: every coordinate is added, with a random sign, to
    one random bucket, the same hash on every rank. The sketch is linear and preserves squared
    norms in expectation, so ``||S theta_j - S theta_0||`` estimates ``||theta_j - theta_0||``
    (relative spread about ``sqrt(2 / SKETCH_SIZE)``, 4%), and it is exactly 0 when the replicas are
    bitwise identical. ``||theta_0||`` is computed exactly on rank 0.

    Cost: one pass over the parameters and an all-gather of ``SKETCH_SIZE + 1`` float64 values
    per rank. A collective on ``group``: call on every rank, outside backward. Returns the same
    value on every rank.
    """
    params = _parameters(model)
    if not params:
        raise ValueError("Argument 'model' must have parameters, not none.")
    flat = torch.cat([_local(p).detach().reshape(-1).to(torch.float64) for p in params])
    index, sign = _sketch_hash(flat.numel())
    local = torch.zeros(SKETCH_SIZE + 1, dtype=torch.float64)
    local[:SKETCH_SIZE].index_add_(0, index, flat * sign)
    local[SKETCH_SIZE] = torch.linalg.vector_norm(flat)
    size = dist.get_world_size(group)
    gathered = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(gathered, local, group=group)
    reference = gathered[0]
    norm0 = float(reference[SKETCH_SIZE])
    worst = max(float(torch.linalg.vector_norm(g[:SKETCH_SIZE] - reference[:SKETCH_SIZE])) for g in gathered)
    if worst == 0.0:
        return 0.0
    return worst / norm0 if norm0 > 0 else math.inf


def resync(
    model: nn.Module,
    group: dist.ProcessGroup | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
) -> None:
    """Make every rank's parameters and buffers (and ``optimizer``'s state tensors) equal to
    the group's rank 0's, by one coalesced broadcast per dtype. A collective: call on every rank."""
    tensors: list[torch.Tensor] = [_local(p.data) for p in _parameters(model)]
    tensors += [_local(b) for b in model.buffers()]
    if optimizer is not None:
        for param_state in optimizer.state.values():
            tensors += [_local(v) for v in param_state.values() if isinstance(v, torch.Tensor) and v.numel() > 0]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for same in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in same])
        dist.broadcast(flat, group=group, group_src=0)
        offset = 0
        for tensor in same:
            tensor.detach().copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()


class ReplicaSync:
    """Re-synchronisation on a schedule or a divergence threshold: the part of
    :class:`cerar.comm.ddp.hooks.CerarState` that needs the model (a mixin, without slots of its own).

    It reads ``process_group``, ``resync_every`` and ``divergence_tol``, and keeps ``steps``,
    ``resyncs``, ``resync_s``, ``last_divergence`` and ``max_divergence``.
    """

    __slots__ = ()
    process_group: dist.ProcessGroup | None
    resync_every: int | None
    divergence_tol: float | None
    steps: int
    resyncs: int
    resync_s: float
    last_divergence: float | None
    max_divergence: float | None

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Call :meth:`maybe_resync` after every ``optimizer.step()`` (an optimizer post-step hook).

        The hook passes ``optimizer`` on, so each re-synchronisation broadcasts its state too
        (e.g. AdamW's moments). Without ``optimizer``, nothing is registered: call
        :meth:`maybe_resync` yourself.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"Argument 'model' must be a torch.nn.Module, not {type(model).__name__}.")
        if optimizer is None:
            return
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"Argument 'optimizer' must be a torch.optim.Optimizer, not {type(optimizer).__name__}.")

        def resync_after_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            self.maybe_resync(model, opt)

        optimizer.register_step_post_hook(resync_after_step)

    def maybe_resync(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """Count one optimizer step and re-synchronise if one is due. Returns True if it did.

        Call on every rank after ``optimizer.step()``. The decision is the same on every rank:
        the schedule depends only on the step count and the divergence is computed from the same
        gathered values everywhere. With ``optimizer``, its state tensors (e.g. AdamW's moments,
        which also differ slightly between ranks) are broadcast too, at 2x the parameters' cost
        for AdamW.
        """
        self.steps += 1
        due = self.resync_every is not None and self.steps % self.resync_every == 0
        if not due and self.divergence_tol is not None:
            divergence = self.record_divergence(model)
            due = divergence > self.divergence_tol
        if not due:
            return False
        started = time.perf_counter()
        resync(model, self.process_group, optimizer=optimizer)
        self.resync_s += time.perf_counter() - started
        self.resyncs += 1
        self.after_resync()
        return True

    def after_resync(self) -> None:
        """What a subclass drops once the replicas are equal again (the DDP state's residuals)."""

    def record_divergence(self, model: nn.Module) -> float:
        """Measure :func:`replica_divergence` on the state's group and keep it in the statistics."""
        divergence = replica_divergence(model, self.process_group)
        self.last_divergence = divergence
        self.max_divergence = divergence if self.max_divergence is None else max(self.max_divergence, divergence)
        return divergence


class Replicas(ReplicaSync):
    """:class:`ReplicaSync` on its own, for training code that reduces its gradients through a
    process group rather than a DDP hook (``cerar.new_group``: DDP with the group, FSDP2's
    replicate dimension, a loop's own ``dist.all_reduce``)::

        replicas = cerar.ddp.Replicas(group, resync_every=100, divergence_tol=1e-3)
        replicas.attach(model, optimizer)  # after every optimizer.step()

    With FSDP2 each rank's shards are compared and re-synchronised with the shards of the same
    place on the other ranks of ``group`` (the replicate dimension's group)."""

    __slots__ = (
        "divergence_tol", "last_divergence", "max_divergence", "process_group", "resync_every", "resync_s", "resyncs",
        "steps",
    )  # fmt: skip

    def __init__(
        self, group: dist.ProcessGroup | None = None, *, resync_every: int | None = None,
        divergence_tol: float | None = None,
    ) -> None:  # fmt: skip
        self.process_group = group
        self.resync_every = check_int("resync_every", resync_every, minimum=1, optional=True)
        self.divergence_tol = check_float("divergence_tol", divergence_tol, positive=True, optional=True)
        self.steps = self.resyncs = 0
        self.resync_s = 0.0
        self.last_divergence = self.max_divergence = None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's parameters), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _parameters(model: nn.Module) -> list[torch.Tensor]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"Argument 'model' must be a torch.nn.Module, not {type(model).__name__}.")
    return list(model.parameters())


_SKETCH_CACHE: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def _sketch_hash(numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The CountSketch's bucket and sign for ``numel`` coordinates, identical on every rank
    (a fixed seed on a private generator), cached because drawing them costs more than using them."""
    if numel not in _SKETCH_CACHE:
        generator = torch.Generator().manual_seed(_SKETCH_SEED)
        index = torch.randint(0, SKETCH_SIZE, (numel,), generator=generator)
        sign = torch.randint(0, 2, (numel,), generator=generator).to(torch.float64).mul_(2).sub_(1)
        _SKETCH_CACHE.clear()  # one model per process in practice: keep memory flat
        _SKETCH_CACHE[numel] = (index, sign)
    return _SKETCH_CACHE[numel]
