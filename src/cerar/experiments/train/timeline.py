"""Per-step timestamps, from which exposed communication is measured rather than summed.

Two instants per step, both ``time.perf_counter()`` on the rank:

* ``compute_end``: the last parameter gradient accumulated by backward (a post-accumulate-grad
  hook on every parameter): the end of the step's gradient computation.
* ``sync_end``: the last bucket's future completed (a ``.then`` callback chained after each
  method's hook by :func:`timed_hook`): the moment the step's gradients are synchronised.

``exposed = max(0, sync_end - compute_end)`` is the communication left on the critical path
after overlap with backward; transfers that finished while backward was still computing cost
nothing there, however long they took.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations as objects.
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["TimedState", "Timeline", "timed_hook"]


class Timeline:
    """Timestamps of the current step; :meth:`begin` starts a step, :meth:`exposed` reads it."""

    def __init__(self, module: nn.Module) -> None:
        self.compute_end = 0.0
        self.sync_end = 0.0
        self.buckets = 0
        self._lock = threading.Lock()  # bucket callbacks run on communication threads
        for param in module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._gradient_ready)

    def begin(self) -> None:
        with self._lock:
            self.compute_end = 0.0
            self.sync_end = 0.0
            self.buckets = 0

    def _gradient_ready(self, param: torch.Tensor) -> None:
        # Runs on the autograd thread, in order: the last call is the end of backward's compute.
        self.compute_end = time.perf_counter()

    def bucket_synchronised(self) -> None:
        now = time.perf_counter()
        with self._lock:
            self.sync_end = max(self.sync_end, now)
            self.buckets += 1

    def exposed(self) -> float:
        """Seconds from the end of gradient computation to the last bucket's synchronisation."""
        with self._lock:
            if self.compute_end == 0.0 or self.sync_end == 0.0:
                return 0.0
            return max(0.0, self.sync_end - self.compute_end)


@dataclass
class TimedState:
    """What :func:`timed_hook` wraps: a method's hook and state, the timeline, and a callback
    that sees every bucket before the hook does (byte accounting)."""

    hook: Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]
    state: Any
    timeline: Timeline
    before: Callable[[dist.GradBucket], None]


def timed_hook(state: TimedState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Run ``state.hook`` on ``bucket`` and note when its result is ready. The same wrapper
    around every method, so every method's timeline is measured the same way."""
    state.before(bucket)
    future = state.hook(state.state, bucket)

    def mark_synchronised(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        state.timeline.bucket_synchronised()
        return fut.value()

    return future.then(mark_synchronised)
