"""The communication-avoiding schedules at run time: gradient accumulation, local SGD, DiLoCo.

:func:`cerar.experiments.train.methods.install` hands a config with a ``schedule``
(:mod:`cerar.experiments.train.schedules`) to :func:`install_schedule`:

* ``accum:K``: the method's own DDP hook, installed as always; the loop runs ``K`` micro-batches
  of ``batch_size / K`` sequences (:attr:`InstalledHook.micro_batches`), the first ``K - 1``
  under ``model.no_sync()``, so one gradient sync per optimizer step and the same tokens per step.
* ``localsgd:H``:

  1. DDP: torch's ``post_localSGD_hook`` with ``start_localSGD_iter = warmup_steps`` (the
     learning-rate warm-up) and no gradient sync after it (every rank is its own node here).
  2. After every optimizer step ``t`` with ``t >= warmup_steps`` and ``(t - warmup_steps) % H == 0``
     (torch's schedule), and after the last step, the parameters are averaged: exactly, by
     torch's ``PostLocalSGDOptimizer`` around the AdamW with a ``PeriodicModelAverager(H,
     warmup_steps)`` (:class:`_CountedAverager` only counts it); through another method, by
     :class:`PeriodicSync`: ``theta <- anchor - mean(anchor - theta)``, ``anchor`` the parameters
     at the last average. In exact arithmetic that is the parameters' mean; through 16 bits or
     CERAR the error is then relative to the change since the last average, not to the weights.

* ``diloco:H``:

  1. DDP: torch's ``noop_hook``, no gradient sync; the loop's AdamW is the inner optimizer (its
     state stays local); the replicas start equal.
  2. Every ``H`` steps (and after the last): the pseudo-gradient ``anchor - theta`` averaged
     through the method, an outer SGD step (Nesterov momentum) on ``anchor`` with it as the
     gradient, then ``theta <- anchor`` on every rank.

After each average: every rank votes on the averaged values being finite (one exact one-value
all-reduce); if some rank's are not (a NaN that CERAR's ``nonfinite="exact"`` sent through the exact
ring, an fp16 overflow), every rank returns to ``anchor`` and the outer state is kept, so the
replicas stay together and one bad round costs its ``H`` local steps. Then
:func:`cerar.comm.ddp.hooks.replica_divergence` is measured (a collective; CERAR's ranks decode
slightly different averages) and logged per sync (``hook.extra["syncs"]``); with
``divergence_tol``, a divergence above it re-syncs rank 0's parameters and outer state. The
measurement (an all-gather of a 1025-value sketch) is in the step's time, not in ``sync_s``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.debugging_hooks import noop_hook
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.distributed.algorithms.model_averaging import utils as averaging_utils
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.nn.parallel import DistributedDataParallel

from cerar.comm.ddp.hooks import replica_divergence, resync
from cerar.experiments.train.averaging import FlatAverager
from cerar.experiments.train.installed import InstalledHook, ring_bytes
from cerar.experiments.train.methods import install
from cerar.experiments.train.timeline import TimedState, Timeline, timed_hook

__all__ = ["PeriodicHook", "PeriodicSync", "install_schedule"]


def install_schedule(config: Any, model: DistributedDataParallel, timeline: Timeline) -> InstalledHook:
    """Install ``config``'s schedule (a :class:`~cerar.experiments.train.config.TrainConfig` with
    ``schedule`` set) on ``model``; see the module doc."""
    world_size = dist.get_world_size()
    inner = dataclasses.replace(config, schedule=None, period=None)
    if config.schedule == "accum":
        installed = install(inner, model, timeline)  # the method's hook, as without a schedule
        micro = config.batch_size // config.period
        installed.name = "accum"
        installed.micro_batches = config.period
        installed.description = (
            f"accum over {config.period} micro-batches of {micro} sequences (no_sync for the first "
            f"{config.period - 1}), then {installed.description}"
        )
        installed.extra = {
            **installed.extra, "schedule": "accum", "period": config.period, "micro_batch": micro,
            "method": inner.name,
        }  # fmt: skip
        return installed
    sync = PeriodicSync(config, world_size)
    if config.schedule == "localsgd":
        state: Any = PostLocalSGDState(
            process_group=None, subgroup=None, start_localSGD_iter=config.warmup_steps,
            post_local_gradient_allreduce=False,
        )  # fmt: skip
        hook: Any = post_localSGD_hook
        head = f"localsgd every {config.period} steps after {config.warmup_steps} warm-up steps of DDP's all-reduce"
    else:
        state, hook = None, noop_hook
        head = (
            f"diloco every {config.period} steps, outer SGD lr {config.outer_lr:g}, Nesterov momentum "
            f"{config.outer_momentum:g}"
        )
    installed = PeriodicHook(config.schedule, sync.measured, f"{head}; averaging: {sync.description}", state=state)
    installed.sync = sync
    installed.extra = {
        "schedule": config.schedule, "period": config.period, "method": inner.name, "averaging": sync.description,
        "outer_lr": config.outer_lr, "outer_momentum": config.outer_momentum, "syncs": sync.log,
    }  # fmt: skip

    def count(bucket: dist.GradBucket) -> None:
        # The warm-up's all-reduces (asked before the hook advances its iteration); none after.
        if state is not None and state.iter < state.start_localSGD_iter:
            buffer = bucket.buffer()
            installed.bytes_computed += ring_bytes(world_size, buffer.numel(), buffer.element_size())
            installed.collectives += 1

    model.register_comm_hook(TimedState(hook, state, timeline, count), timed_hook)
    return installed


@dataclass
class PeriodicHook(InstalledHook):
    """``localsgd``/``diloco``: the DDP hook's counters (the warm-up's all-reduces) plus the
    averaging's, and the averaging after every optimizer step (:class:`PeriodicSync`)."""

    sync: Any = None  # PeriodicSync

    def counters(self) -> dict[str, float]:
        figures = super().counters()
        sync: PeriodicSync = self.sync
        figures["bytes_sent"] += float(sync.bytes_sent)
        figures["collectives"] += float(sync.calls)
        figures.update(
            syncs=float(sync.gradient_syncs + len(sync.log)),
            sync_s=sync.sync_s,
            resyncs=float(sync.resyncs),
            resync_s=sync.resync_s,
        )
        if sync.averager is not None:
            stats = sync.averager.stats
            figures.update(
                encode_s=stats.encode_s, decode_s=stats.decode_s, collective_wall_s=stats.wall_s,
                fallbacks=float(stats.fallbacks), nonfinite_events=float(stats.nonfinite_events),
                rescales=float(stats.rescales),
            )  # fmt: skip
        return figures

    def wrap_optimizer(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return self.sync.wrap(module, optimizer)

    def after_step(self, model: nn.Module) -> bool:
        return self.sync.after_step(model)


class PeriodicSync:
    """The averaging of ``localsgd``/``diloco``, run after every optimizer step on every rank.

    Attributes:
        log: one entry per average: ``step`` (steps done), ``divergence`` (right after it),
            ``finite``, ``sync_s``, ``resynced``.
        gradient_syncs: steps whose gradients DDP averaged (``localsgd``'s warm-up).
        anchor: the parameters after the last average, flat (``None`` with torch's averager);
            ``diloco``'s outer SGD optimises it.
    """

    __slots__ = (
        "anchor", "averager", "description", "divergence_tol", "gradient_syncs", "last_step", "log", "measured",
        "module", "outer", "outer_lr", "outer_momentum", "own_sync_s", "period", "resync_s", "resyncs", "schedule",
        "steps", "torch_averager", "warmup",
    )  # fmt: skip

    def __init__(self, config: Any, world_size: int) -> None:
        self.schedule: str = config.schedule
        self.period: int = config.period
        self.warmup: int = config.warmup_steps if self.schedule == "localsgd" else 0
        self.last_step: int = config.steps - 1
        self.divergence_tol: float | None = config.divergence_tol
        self.outer_lr: float = config.outer_lr
        self.outer_momentum: float = config.outer_momentum
        self.steps = self.gradient_syncs = self.resyncs = 0
        self.own_sync_s = self.resync_s = 0.0
        self.log: list[dict[str, Any]] = []
        self.module: nn.Module | None = None
        self.anchor: torch.Tensor | None = None
        self.outer: torch.optim.Optimizer | None = None
        self.averager: FlatAverager | None = None
        self.torch_averager: _CountedAverager | None = None
        if self.schedule == "localsgd" and config.method == "allreduce":
            self.torch_averager = _CountedAverager(self.period, self.warmup, world_size)
            self.description, self.measured = "torch's PeriodicModelAverager (dist.all_reduce, exact)", False
        else:
            self.averager = FlatAverager(config, world_size)
            self.description, self.measured = self.averager.description, self.averager.measured

    @property
    def bytes_sent(self) -> int:
        averager = self.averager if self.averager is not None else self.torch_averager
        return averager.bytes_sent if averager is not None else 0

    @property
    def calls(self) -> int:
        averager = self.averager if self.averager is not None else self.torch_averager
        return averager.calls if averager is not None else 0

    @property
    def sync_s(self) -> float:
        """Seconds spent averaging (blocking: exposed communication, outside backward)."""
        return self.own_sync_s + (self.torch_averager.seconds if self.torch_averager is not None else 0.0)

    def wrap(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Take the model (its replicas equal now) and the AdamW: torch's averager wraps it in a
        ``PostLocalSGDOptimizer``; :class:`PeriodicSync`'s own takes the anchor (and ``diloco``
        makes its outer SGD)."""
        self.module = module
        if self.torch_averager is not None:
            # Imported here: torch.distributed.optim imports FSDP and DTensor (seconds per rank).
            from torch.distributed.optim import PostLocalSGDOptimizer

            return PostLocalSGDOptimizer(optimizer, self.torch_averager)
        self.anchor = _flatten(module.parameters())
        if self.schedule == "diloco":
            momentum = self.outer_momentum
            self.outer = torch.optim.SGD([self.anchor], lr=self.outer_lr, momentum=momentum, nesterov=momentum > 0)
        return optimizer

    def after_step(self, module: nn.Module) -> bool:
        """Average if step ``t`` (this call's) is due; return whether the replicas were re-synced."""
        step = self.steps
        self.steps += 1
        if self.torch_averager is not None:
            self._keep_torch_averager_in_step(step, module)
        if step < self.warmup:  # DDP averaged this step's gradients
            self.gradient_syncs += 1
            if step + 1 == self.warmup and self.torch_averager is None:
                self.anchor = _flatten(module.parameters())  # the last step with equal replicas
            return False
        final = step == self.last_step
        if self.torch_averager is not None:
            if final and self.torch_averager.last_sync != step:
                self.torch_averager.average_now(list(module.parameters()), step)
            if self.torch_averager.last_sync != step:
                return False
            finite = all(bool(torch.isfinite(p).all()) for p in module.parameters())
            sync_s = self.torch_averager.last_seconds
        elif self._due(step) or final:
            started = time.perf_counter()
            finite = self._average(list(module.parameters()))
            sync_s = time.perf_counter() - started
            self.own_sync_s += sync_s
        else:
            return False
        divergence = replica_divergence(module)
        resynced = self.divergence_tol is not None and divergence > self.divergence_tol
        if resynced:
            self._resync(module)
        self.log.append(
            {"step": step + 1, "divergence": divergence, "finite": finite, "sync_s": sync_s, "resynced": resynced}
        )
        return resynced

    def _due(self, step: int) -> bool:
        if self.schedule == "diloco":
            return (step + 1) % self.period == 0
        return step >= self.warmup and (step - self.warmup) % self.period == 0

    def _average(self, params: list[nn.Parameter]) -> bool:
        """One average through the method; return whether it was finite on every rank.

        1. ``delta = anchor - theta``: this rank's change since the last average (DiLoCo's
           pseudo-gradient).
        2. ``delta`` averaged over the ranks (:class:`~cerar.experiments.train.averaging.FlatAverager`).
        3. A vote on its being finite on every rank; if not, skip 4.
        4. ``diloco``: an outer SGD step on ``anchor`` with gradient ``delta``; ``localsgd``:
           ``anchor -= delta`` (the mean of the parameters, in exact arithmetic).
        5. ``theta <- anchor``.
        """
        assert self.anchor is not None and self.averager is not None
        delta = self.anchor - _flatten(params)
        self.averager(delta)
        finite = self.averager.all_finite(delta)
        if finite and self.outer is not None:
            self.anchor.grad = delta
            self.outer.step()
            self.anchor.grad = None
        elif finite:
            self.anchor.sub_(delta)
        offset = 0
        with torch.no_grad():
            for p in params:
                p.copy_(self.anchor[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        return finite

    def _keep_torch_averager_in_step(self, step: int, module: nn.Module) -> None:
        """torch's averager counts the steps it is called at: on a rank that skipped its
        optimizer step (a non-finite local gradient) it was not, so average here if it was due
        (every other rank did) and count the step, keeping the ranks' collectives in step."""
        averager = self.torch_averager
        assert averager is not None
        if averager.step == step:
            if averager.due():
                averager.average_now(list(module.parameters()), step)
            averager.step += 1

    def _resync(self, module: nn.Module) -> None:
        started = time.perf_counter()
        resync(module, optimizer=self.outer)
        if self.anchor is not None:
            self.anchor.copy_(_flatten(module.parameters()))
        self.resyncs += 1
        self.resync_s += time.perf_counter() - started


class _CountedAverager(PeriodicModelAverager):
    """torch's ``PeriodicModelAverager``, its schedule and its averaging unchanged, with its
    time, calls and (ring formula) bytes counted, and :meth:`average_now` for the averages the
    schedule adds (a skipped step's, the last step's)."""

    def __init__(self, period: int, warmup_steps: int, world_size: int) -> None:
        super().__init__(period=period, warmup_steps=warmup_steps)
        self.world_size = world_size
        self.bytes_sent = 0
        self.calls = 0
        self.seconds = 0.0
        self.last_seconds = 0.0
        self.last_sync = -1  # the step of the last average

    def due(self) -> bool:
        """Whether torch's averager averages at its current ``step``."""
        return self.step >= self.warmup_steps and (self.step - self.warmup_steps) % self.period == 0

    def average_parameters(self, params: Iterable[Any]) -> None:
        params = list(params)
        if not self.due():
            super().average_parameters(params)
            return
        started = time.perf_counter()
        numel = sum(p.numel() for p in averaging_utils.get_params_to_average(params))
        step = self.step
        super().average_parameters(params)  # averages, and advances ``step``
        self._note(numel, started, step)

    def average_now(self, params: list[nn.Parameter], step: int) -> None:
        """torch's ``average_parameters`` utility on ``params`` (all of them: their gradients
        may be cleared already), outside the schedule."""
        started = time.perf_counter()
        averaging_utils.average_parameters(iter(params), self.process_group)
        self._note(sum(p.numel() for p in params), started, step)

    def _note(self, numel: int, started: float, step: int) -> None:
        self.last_seconds = time.perf_counter() - started
        self.seconds += self.last_seconds
        self.calls += 1
        self.bytes_sent += ring_bytes(self.world_size, numel, 4)  # float32 parameters
        self.last_sync = step


def _flatten(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """The parameters as one float32 vector (a copy)."""
    return torch.cat([p.detach().reshape(-1).float() for p in params])
