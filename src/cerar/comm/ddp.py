"""DDP communication hooks that average gradients with CERAR or with the exact ring.

Register one on a :class:`torch.nn.parallel.DistributedDataParallel` model::

    >>> state = cerar.comm.ddp.CerarState(code=cerar.coding.codes.perturbed(4, 8), resync_every=100)
    >>> ddp_model.register_comm_hook(state, cerar.comm.ddp.cerar_hook)
    >>> state.attach(ddp_model, optimizer)  # optional: automatic re-synchronisation

:func:`cerar_hook` hands every gradient bucket to :func:`cerar.all_reduce` with ``async_op=True``
and returns at once: the collective's single communication thread runs the buckets in the
order DDP launches them, which is the same on every rank, while the autograd thread carries on
with the rest of backward. DDP waits for the bucket futures only when backward's computation
is done, so communication overlaps computation as with DDP's own all-reduce.

Results are **not bitwise identical across ranks**. CERAR's ranks decode slightly different
approximations of the sum (within the code's error bound, see :attr:`cerar.Code.error_bound`),
so the model replicas drift apart slowly. :func:`replica_divergence` measures the drift from a
shared random sketch, and :class:`CerarState` re-synchronises the parameters (a broadcast from
the group's rank 0) every ``resync_every`` steps or whenever the divergence exceeds
``divergence_tol``.

:func:`ring_hook` is the exact ring on the same transport, for comparison: the same thread, the
same point-to-point ops, ``2(N-1)/N`` values sent per value instead of CERAR's ``1 + (N-2)/c``.
"""

# No ``from __future__ import annotations`` here: DDP's register_comm_hook inspects the hooks'
# annotations and accepts only the real ``dist.GradBucket`` / ``Future[Tensor]`` objects.
import logging
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cerar._checks import check_choice, check_float, check_int
from cerar.coding.code import Code
from cerar.comm.policies import NONFINITE_POLICIES
from cerar.comm.replicas import SKETCH_SIZE, replica_divergence, resync
from cerar.comm.stats import CommStats

__all__ = [
    "NONFINITE_POLICIES",
    "SKETCH_SIZE",
    "CerarState",
    "cerar_hook",
    "replica_divergence",
    "resync",
    "ring_hook",
]

logger = logging.getLogger(__name__)


class CerarState:
    r"""Settings, per-bucket buffers and statistics of :func:`cerar_hook` / :func:`ring_hook`.

    Build one per DDP model on every rank of ``process_group``, at the same point of the
    program (the constructor creates a dedicated process group, a collective call), and
    register it with ``ddp_model.register_comm_hook(state, cerar_hook)``.

    The dedicated group (``dist.new_group`` over the same ranks) carries only the hook's ring
    traffic, so its point-to-point messages can never interleave with DDP's own collectives on
    ``process_group`` (the initial broadcast, bucket rebuilds, :func:`replica_divergence`).

    Args:
        process_group: the group DDP averages over (``None``: the default group).
        code: the :class:`cerar.Code`; its ``world_size`` must equal the group's size. ``None``
            uses :func:`cerar.comm.collective.default_code` for the group's size. Ignored by
            :func:`ring_hook`.
        nonfinite: what a bucket holding NaN or Inf on some rank does. ``"exact"`` (default):
            that bucket goes through the exact ring instead (CERAR's mixing would spread one NaN
            across the ``c`` components of its column on every rank; the ring keeps it where it
            was, as DDP's default would) and ``stats.fallbacks`` counts it. ``"raise"``: backward raises
            :class:`cerar.comm.collective.NonFiniteError` on every rank. ``"ignore"``: no check.
        resync_every: re-synchronise the replicas every this many optimizer steps (``None``:
            never on a schedule). Each re-sync broadcasts all parameters from the group's rank 0:
            ``4 x parameters`` bytes leave rank 0, about the time of one exact all-reduce.
        divergence_tol: re-synchronise whenever :func:`replica_divergence` exceeds this
            (``None``: never measured by the state). The check runs after every optimizer step
            and costs one pass over the parameters and an all-gather of ``SKETCH_SIZE + 1``
            float64 values per rank (8 KiB), negligible next to a gradient all-reduce.

    Re-synchronisation needs the model, so it happens in :meth:`maybe_resync` (call it after
    ``optimizer.step()``) or automatically once :meth:`attach` has registered it as an optimizer
    step hook.

    Attributes (settings):
        process_group, code, nonfinite, resync_every, divergence_tol: as given (``code``
        resolved to the concrete default).
        world_size: the group's size.

    Attributes (internal buffers, keyed by bucket index):
        bucket_numel: the last size seen for each bucket; a change (DDP rebuilds its buckets
            after the first iteration) resets that bucket's statistics.
        bucket_stats: a :class:`cerar.comm.stats.CommStats` per bucket.

    Attributes (statistics):
        stats: totals over all buckets (measured bytes, rounds, encode/decode seconds, wall
            seconds inside the collective, fallbacks, non-finite events).
        iteration: backward passes seen (counted at each step's last bucket).
        steps: optimizer steps seen by :meth:`maybe_resync`.
        resyncs: re-synchronisations done.
        resync_s: seconds spent in them (broadcasts included).
        last_divergence: the latest divergence measured by the state (``None`` if never).
        max_divergence: the largest one measured.

    The state pickles without its process groups (for checkpoints), like
    ``PowerSGDState``: unpickling sets ``process_group`` to the default group and creates the
    dedicated group on the first bucket, on every rank.

    The attributes are ``__slots__``, as ``PowerSGDState``'s: a misspelt setting
    (``state.resync_evry = 10``) raises AttributeError instead of being silently ignored.
    """

    __slots__ = (
        "_comm_group",
        "bucket_numel",
        "bucket_stats",
        "code",
        "divergence_tol",
        "iteration",
        "last_divergence",
        "max_divergence",
        "nonfinite",
        "process_group",
        "resync_every",
        "resync_s",
        "resyncs",
        "stats",
        "steps",
        "world_size",
    )
    _NOT_PICKLED = ("process_group", "_comm_group")

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        code: Code | None = None,
        *,
        nonfinite: str = "exact",
        resync_every: int | None = None,
        divergence_tol: float | None = None,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("CerarState needs torch.distributed initialised; call init_process_group first.")
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                f"Argument 'process_group' must be a ProcessGroup or None, not {type(process_group).__name__}."
            )
        world_size = dist.get_world_size(process_group)
        if code is None:
            from cerar.comm.collective import default_code

            code = default_code(world_size)
        elif not isinstance(code, Code):
            raise TypeError(f"Argument 'code' must be a cerar.Code or None, not {type(code).__name__}.")
        if code.world_size != world_size:
            raise ValueError(
                f"Argument 'code' must be for the group's {world_size} ranks, not world_size={code.world_size}."
            )
        # Settings.
        self.process_group: dist.ProcessGroup | None = process_group
        self.code: Code = code
        self.world_size: int = world_size
        self.nonfinite: str = check_choice("nonfinite", nonfinite, NONFINITE_POLICIES)
        self.resync_every: int | None = (
            None if resync_every is None else check_int("resync_every", resync_every, minimum=1)
        )
        self.divergence_tol: float | None = (
            None if divergence_tol is None else check_float("divergence_tol", divergence_tol, positive=True)
        )
        # Internal buffers, keyed by bucket index.
        self.bucket_numel: dict[int, int] = {}
        self.bucket_stats: dict[int, CommStats] = {}
        # Statistics.
        self.stats = CommStats()
        self.iteration = 0
        self.steps = 0
        self.resyncs = 0
        self.resync_s = 0.0
        self.last_divergence: float | None = None
        self.max_divergence: float | None = None
        # The ring's own group, created now while every rank is at the same point of the program.
        self._comm_group: dist.ProcessGroup | None = _new_comm_group(process_group)

    # ----------------------------------------------------------------------------------------
    # Pickling (checkpoints)
    def __getstate__(self) -> dict[str, Any]:
        """Everything but the process groups, which cannot be pickled."""
        logger.warning("NOTE: process groups are not serialisable and are left out of the saved CerarState.")
        return {k: getattr(self, k) for k in self.__slots__ if k not in self._NOT_PICKLED}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore settings and statistics; the process group becomes the default group."""
        for key, value in state.items():
            setattr(self, key, value)
        self.process_group = None
        self._comm_group = None  # created on the first bucket (every rank runs it at the same point)
        logger.warning(
            "NOTE: CerarState's process group is set to the default group; set "
            "`state.process_group` (before the first bucket) if another group is desired."
        )

    # ----------------------------------------------------------------------------------------
    # Re-synchronisation
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
        return True

    def record_divergence(self, model: nn.Module) -> float:
        """Measure :func:`replica_divergence` on the state's group and keep it in the statistics."""
        divergence = replica_divergence(model, self.process_group)
        self.last_divergence = divergence
        self.max_divergence = divergence if self.max_divergence is None else max(self.max_divergence, divergence)
        return divergence

    # ----------------------------------------------------------------------------------------
    # Used by the hooks
    def _group(self) -> dist.ProcessGroup:
        if self._comm_group is None:
            self._comm_group = _new_comm_group(self.process_group)
        return self._comm_group

    def _note_bucket(self, index: int, numel: int) -> CommStats:
        # DDP rebuilds its buckets after the first iteration: an index may now hold other
        # parameters, so figures kept under it start again.
        if self.bucket_numel.get(index) != numel:
            self.bucket_numel[index] = numel
            self.bucket_stats[index] = CommStats()
        return self.bucket_stats[index]

    def __repr__(self) -> str:
        return (
            f"CerarState({self.code!r}, nonfinite={self.nonfinite!r}, resync_every={self.resync_every}, "
            f"divergence_tol={self.divergence_tol}, iteration={self.iteration}, resyncs={self.resyncs})"
        )


def cerar_hook(state: CerarState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` over the state's group with CERAR, asynchronously; see the module doc.

    Returns at once with a future that completes with the averaged bucket (decoded by this rank,
    within the code's error bound of the exact mean). A bucket with NaN/Inf on some rank goes
    through the exact ring under ``nonfinite="exact"`` (the default) instead of failing.
    """
    from cerar.comm.collective import all_reduce

    return _launch(
        state,
        bucket,
        lambda buffer, group, call: all_reduce(
            buffer, "avg", group, True, code=state.code, nonfinite=state.nonfinite, stats=call
        ),
    )


def ring_hook(state: CerarState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket`` with the exact ring on cerar's transport (the comparison baseline).

    Same thread, same point-to-point ops and statistics as :func:`cerar_hook`; the result is the
    same on every rank. ``state.code`` and ``state.nonfinite`` are not used (the ring, like DDP's
    default, leaves non-finite values where they are).
    """
    from cerar.comm.collective import ring_all_reduce

    return _launch(
        state,
        bucket,
        lambda buffer, group, call: ring_all_reduce(buffer, "avg", group, True, stats=call),
    )


def _launch(state: CerarState, bucket: dist.GradBucket, start: Any) -> torch.futures.Future[torch.Tensor]:
    """Submit one bucket to the communication thread and chain the bookkeeping after it."""
    if not isinstance(state, CerarState):
        raise TypeError(f"Argument 'state' must be a CerarState, not {type(state).__name__}.")
    buffer = bucket.buffer()
    index = bucket.index()
    bucket_stats = state._note_bucket(index, buffer.numel())
    call = CommStats()
    if bucket.is_last():
        state.iteration += 1
    work = start(buffer, state._group(), call)

    def record_stats(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        # Runs on the communication thread once the bucket is averaged; value() re-raises a
        # failure (e.g. NonFiniteError under nonfinite="raise"), which DDP then raises in backward.
        averaged = fut.value()[0]
        state.stats.add(call)
        bucket_stats.add(call)
        return averaged

    return work.get_future().then(record_stats)


def _new_comm_group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    ranks: Iterable[int] = dist.get_process_group_ranks(process_group or dist.group.WORLD)
    return dist.new_group(ranks=sorted(ranks))
