"""Each method's DDP communication hook and how its bytes are counted.

=============  ==========================================================  ==================
method         hook                                                        bytes
=============  ==========================================================  ==================
``allreduce``  torch's ``allreduce_hook`` (same result as DDP without a     computed
               hook; wrapped only to time it)
``fp16``       torch's ``fp16_compress_hook``                              computed
``bf16``       torch's ``bf16_compress_hook`` (Gloo supports bfloat16)     computed
``powersgd``   torch's ``powerSGD_hook``: rank ``r``, error feedback,      computed
               warm start, exact all-reduce for the first
               :data:`POWERSGD_START` steps; one bucket at a time on
               one thread (see :class:`_SerialHook`)
``ring``       :func:`cerar.comm.ddp.ring_hook` (exact ring, cerar transport)    measured
``cerar``      :func:`cerar.comm.ddp.cerar_hook` with ``perturbed(N, c)``        measured
=============  ==========================================================  ==================

"Measured" bytes are those handed to point-to-point sends (:class:`cerar.comm.stats.CommStats`).
Gloo's built-in collectives cannot be observed at that level, so their bytes are **computed**
from the bucket sizes with the ring formula, ``2(N-1)/N x elements x bytes per element`` per
all-reduce (PowerSGD: of the uncompressed tensors and its P and Q factors); reports label them.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from cerar.coding import codes
from cerar.comm.ddp import CerarState, cerar_hook, ring_hook
from cerar.experiments.train.config import TrainConfig
from cerar.experiments.train.timeline import TimedState, Timeline, timed_hook

__all__ = ["POWERSGD_START", "Method", "install"]

POWERSGD_START = 10  # PowerSGD's exact warm-up steps (torch's default, 1000, is for long runs)


@dataclass
class Method:
    """A method installed on one DDP model: cumulative counters and the per-step duty."""

    name: str
    measured_bytes: bool
    description: str
    state: Any = None
    bytes_computed: int = 0
    collectives: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def counters(self) -> dict[str, float]:
        """Cumulative figures of this rank: bytes sent, collectives, encode/decode seconds,
        fallbacks, non-finite events, resyncs."""
        if isinstance(self.state, CerarState):
            stats = self.state.stats
            return {
                "bytes_sent": float(stats.bytes_sent),
                "collectives": float(self.collectives),
                "encode_s": stats.encode_s,
                "decode_s": stats.decode_s,
                "collective_wall_s": stats.wall_s,
                "fallbacks": float(stats.fallbacks),
                "nonfinite_events": float(stats.nonfinite_events),
                "resyncs": float(self.state.resyncs),
                "resync_s": self.state.resync_s,
            }
        return {
            "bytes_sent": float(self.bytes_computed),
            "collectives": float(self.collectives),
            "encode_s": 0.0,
            "decode_s": 0.0,
            "collective_wall_s": 0.0,
            "fallbacks": 0.0,
            "nonfinite_events": 0.0,
            "resyncs": 0.0,
            "resync_s": 0.0,
        }

    def after_step(self, model: nn.Module) -> bool:
        """Run after every optimizer step on every rank: CERAR's scheduled or threshold re-sync."""
        if isinstance(self.state, CerarState):
            return self.state.maybe_resync(model)
        return False


def install(config: TrainConfig, model: DistributedDataParallel, timeline: Timeline) -> Method:
    """Register ``config.method``'s hook (wrapped by :func:`timed_hook`) on ``model``."""
    world_size = dist.get_world_size()
    ring_factor = 2 * (world_size - 1) / world_size

    def ring_bytes(elements: int, element_size: int) -> int:
        return round(ring_factor * elements * element_size)

    if config.method in ("cerar", "ring"):
        components = config.components if config.components is not None else 2 * world_size
        code = codes.perturbed(world_size, components) if config.method == "cerar" else None
        state = CerarState(
            code=code,
            nonfinite=config.nonfinite,
            resync_every=config.resync_every,
            divergence_tol=config.divergence_tol,
        )
        description = (
            f"cerar_hook, {state.code!r}" if config.method == "cerar" else "ring_hook (exact ring, cerar transport)"
        )
        method = Method(config.method, True, description, state=state)
        hook: Any = cerar_hook if config.method == "cerar" else ring_hook

        def count(bucket: dist.GradBucket) -> None:
            method.collectives += 2  # the agreement all-reduce (a few doubles) and the ring

        if config.method == "cerar":
            method.extra = {
                "components": components,
                "code": repr(state.code),
                "comm_rate": state.code.comm_rate,
                "ring_comm_rate": state.code.ring_comm_rate,
                "predicted_worst_error": state.code.predicted_worst_error("fp32"),
            }
    elif config.method == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=config.powersgd_rank,
            start_powerSGD_iter=POWERSGD_START,
            use_error_feedback=True,
            warm_start=True,
            random_seed=config.seed,
        )
        description = (
            f"powerSGD_hook, rank {config.powersgd_rank}, error feedback, warm start, exact for the first "
            f"{POWERSGD_START} steps"
        )
        method = Method("powersgd", False, description, state=state)

        def count_powersgd(bucket: dist.GradBucket) -> None:
            buffer = bucket.buffer()
            if state.iter < state.start_powerSGD_iter:
                method.bytes_computed += ring_bytes(buffer.numel(), buffer.element_size())
                method.collectives += 1
                return
            elements = 0
            for tensor in bucket.gradients():
                n = tensor.shape[0]
                m = tensor.numel() // max(n, 1)
                rank = min(n, m, state.matrix_approximation_rank)
                compressed = (n + m) * rank
                elements += compressed if compressed * state.min_compression_rate < n * m else n * m
            method.bytes_computed += ring_bytes(elements, buffer.element_size())
            method.collectives += 3  # uncompressed tensors, then P, then Q

        method.extra = {"powersgd_rank": config.powersgd_rank, "start_iter": POWERSGD_START}
        # Bytes are counted on the serial thread, right before each bucket's hook, where
        # ``state.iter`` is current.
        hook = _SerialHook(powerSGD_hook.powerSGD_hook, count_powersgd)
        count = _nothing
    else:
        builtin = {
            "allreduce": (default_hooks.allreduce_hook, 4, "allreduce_hook (= DDP's default)"),
            "fp16": (default_hooks.fp16_compress_hook, 2, "fp16_compress_hook"),
            "bf16": (default_hooks.bf16_compress_hook, 2, "bf16_compress_hook"),
        }
        hook, wire_size, description = builtin[config.method]
        state = None  # the default process group
        method = Method(config.method, False, description, state=None)

        def count(bucket: dist.GradBucket) -> None:
            method.bytes_computed += ring_bytes(bucket.buffer().numel(), wire_size)
            method.collectives += 1

    model.register_comm_hook(TimedState(hook, state, timeline, count), timed_hook)
    return method


def _nothing(bucket: dist.GradBucket) -> None:
    return None


class _SerialHook:
    """Run a hook's whole chain for one bucket at a time, in bucket order, on one thread.

    torch's ``powerSGD_hook`` issues its second and third all-reduces from ``.then`` callbacks,
    which Gloo runs on its own threads; with several buckets in flight, ranks can then issue
    collectives on the same group in different orders. Here that crashed a run with Gloo's
    "Received data size doesn't match expected size" (a collective mismatch). One thread
    that finishes bucket ``k`` before starting bucket ``k+1`` gives every rank the same order
    and still overlaps communication with the rest of backward.
    """

    def __init__(
        self,
        hook: Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]],
        before: Callable[[dist.GradBucket], None],
    ) -> None:
        self._hook = hook
        self._before = before
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cerar-serial-hook")

    def __call__(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        result: torch.futures.Future[torch.Tensor] = torch.futures.Future()

        def run_bucket() -> None:
            try:
                self._before(bucket)
                result.set_result(self._hook(state, bucket).wait())
            except BaseException as exc:  # surfaced to DDP through the future
                result.set_exception(exc)

        self._executor.submit(run_bucket)
        return result
