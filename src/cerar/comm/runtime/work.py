"""The one handle cerar gives back for a call in flight: :class:`Work`, a ``torch.distributed.Work``.

Every way in hands back this class: ``cerar.all_reduce(..., async_op=True)``, the ring and the
hierarchical collectives, ``method="auto"``, and cerar's process group (``dist.all_reduce`` on it,
DDP's buckets, FSDP2's all-reduces). Its future's value is the list of reduced tensors, as torch's.

A call's error reaches ``wait()``, ``result()`` and ``exception()`` with its own type and message
(``cerar.NonFiniteError``, ``cerar.SettingsMismatchError``, ``cerar.transport.RingError``...):
cerar's own futures are completed with the exception object itself, and the ones derived from
them inside cerar by :func:`chain` or :func:`forward`, never by ``Future.then``, which wraps a
callback's error in a ``RuntimeError`` ("Got the following error when running the callback").

``get_future()`` is the exception: the future it returns may be read by torch's C++ (DDP's
reducer reads the group's futures and its hooks'), and a Python exception object stored in a
future that C++ reads crashes the process (torch 2.13: a segmentation fault in backward). So it
and the DDP hooks' futures carry the error as a ``RuntimeError`` whose text begins with the
original's type and message (:func:`for_torch`).
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["WaitTimeoutError", "Work", "chain", "for_torch", "forward", "seconds_of"]


class WaitTimeoutError(RuntimeError):
    """``Work.wait(timeout=...)`` returned before the call completed (it goes on running)."""


def seconds_of(timeout: Any) -> float | None:
    """``timeout`` as seconds: a ``timedelta`` or a number; ``None`` and zero (torch's "no
    timeout") give None."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
        raise ValueError(f"Argument 'timeout' must be a non-negative timedelta or number of seconds, not {timeout!r}.")
    return float(seconds) or None


def chain(
    source: torch.futures.Future[Any],
    finish: Callable[[torch.futures.Future[Any]], Any],
    devices: Sequence[torch.device] | None = None,
) -> torch.futures.Future[Any]:
    """A future completed with ``finish(source)`` once ``source`` completes, or with the exception
    object ``finish`` raised (``source.wait()`` there re-raises the call's own, with its type).
    ``finish`` runs before the new future completes, so bookkeeping done there is seen by
    whoever waits on it. On an accelerator, ``source.wait()`` orders the completing thread's
    stream after the call, so the new future's events follow the result.

    ``finish`` is let go before the new future completes, so what it holds (a hook's state, a
    process group) never outlives the waiter's own references on the completing thread, which
    may be one cerar does not own: a Gloo worker, for a call handed to an exact group. A group
    freed last there has its Gloo backend join the thread it runs on, and the process aborts
    ("Resource deadlock avoided"; see also ``cerar.comm.group.create._adopt_backends``)."""
    out: torch.futures.Future[Any] = torch.futures.Future(devices=list(devices) if devices else None)
    held = [finish]

    def complete(done: torch.futures.Future[Any]) -> None:
        run = held.pop()
        try:
            value = run(done)
        except BaseException as exc:  # handed on with its own type
            del run
            out.set_exception(exc)
        else:
            del run
            out.set_result(value)

    source.add_done_callback(complete)
    return out


def forward(
    source: torch.futures.Future[Any],
    transform: Callable[[Any], Any] = lambda value: value,
    devices: Sequence[torch.device] | None = None,
) -> torch.futures.Future[Any]:
    """:func:`chain` of ``transform(source's value)``: ``source``'s error handed on as it is."""
    return chain(source, lambda done: transform(done.wait()), devices)


def _value(done: torch.futures.Future[Any]) -> Any:
    return done.value()


def for_torch(source: torch.futures.Future[Any]) -> torch.futures.Future[Any]:
    """``source`` as a future torch's C++ may read: its error, if any, becomes a ``RuntimeError``
    naming the original's type and message (see the module doc)."""
    return source.then(_value)


class Work(dist.Work):
    """The handle of one cerar call (or of several, :meth:`gather`), shaped as torch's.

    ``wait(timeout)`` raises :class:`WaitTimeoutError` once ``timeout`` (seconds or a
    ``timedelta``) has passed without the call completing, and the call's own error once it
    failed; on an accelerator it orders the caller's current stream after the call.
    ``get_future()`` (value: the tensors; its error as :func:`for_torch` makes it),
    ``is_completed()``, ``is_success()``, ``exception()`` (the error, or None) and ``result()``
    (the tensors) answer as torch's do. :attr:`future` is the call's own future, for cerar's
    layers to :func:`chain` on.
    """

    def __init__(self, future: torch.futures.Future[list[torch.Tensor]]) -> None:
        super().__init__()
        self._future = future
        self._for_torch: torch.futures.Future[list[torch.Tensor]] | None = None
        self._done = threading.Event()
        future.add_done_callback(lambda _: self._done.set())

    @classmethod
    def gather(cls, works: Sequence[Work], tensors: list[torch.Tensor]) -> Work:
        """One work over several: done when all are, its value ``tensors``, its error the first
        failed one's (in order)."""
        if len(works) == 1:
            return works[0]
        futures = [w.future for w in works]
        devices = sorted({t.device for t in tensors if t.device.type != "cpu"}, key=str)
        out: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future(devices=devices or None)
        left = [len(futures)]
        lock = threading.Lock()

        def one_done(_: torch.futures.Future[Any]) -> None:
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            try:
                for future in futures:
                    future.wait()  # the first error, with its own type
            except BaseException as exc:
                out.set_exception(exc)
            else:
                out.set_result(tensors)

        for future in futures:
            future.add_done_callback(one_done)
        if not futures:
            out.set_result(tensors)
        return cls(out)

    def wait(self, timeout: Any = None) -> bool:
        seconds = seconds_of(timeout)
        if seconds is not None and not self._done.wait(seconds):
            raise WaitTimeoutError(
                f"cerar: the call did not complete within wait()'s timeout of {seconds:g} s (it goes on; a peer may "
                "have died or stalled, which its ring raises within the process group's timeout)."
            )
        self._future.wait()  # re-raises the call's own error
        return True

    @property
    def future(self) -> torch.futures.Future[list[torch.Tensor]]:
        """The call's own future: its error the exception object itself (never hand it to torch)."""
        return self._future

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        if self._for_torch is None:
            self._for_torch = for_torch(self._future)
        return self._for_torch

    def is_completed(self) -> bool:
        return self._future.done()

    def exception(self) -> BaseException | None:  # type: ignore[override]
        if not self._future.done():
            return None
        try:
            self._future.value()
        except BaseException as exc:
            return exc
        return None

    def is_success(self) -> bool:
        return self._future.done() and self.exception() is None

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._future.value()

    def synchronize(self) -> None:
        self.wait()
