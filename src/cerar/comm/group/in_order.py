"""The calls cerar's process group hands to its exact group, issued in order with cerar's own.

Gloo pairs a group's collectives by their order, and cerar's calls run on its communication
thread (:mod:`cerar.comm.runtime.thread`): a call handed over from the caller's thread could overtake,
on one rank and not on another, a cerar call queued before it. So the group issues what it hands
over on the communication thread too, behind everything queued before it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from cerar.comm.runtime.thread import COMM

__all__ = ["future_of", "issue_in_order"]


def issue_in_order(
    issue: Callable[[], dist.Work],
    tensors: list[torch.Tensor],
    group: dist.ProcessGroup,
    agree: Callable[[], None] | None = None,
) -> torch.futures.Future[Any]:
    """A call of the exact group, issued on the communication thread of ``group`` (the cerar
    group's transport) after every cerar call queued before it (and ``agree``, its settings'
    agreement, if any), and its completion.

    Issued there, not on the caller's thread: the ranks' exact-group calls and cerar's calls then
    keep one order, the order they were made in, on every rank (Gloo pairs a group's calls by
    their order), and the caller is not held while an agreement waits on a peer, so a
    ``wait(timeout=)`` on the handle is honoured. The communication thread only issues the call:
    it never waits for the exact group, whose calls may need the peers' later ones (send/recv).
    """
    issued: list[torch.futures.Future[Any]] = []

    def run() -> None:
        if agree is not None:
            agree()
        issued.append(future_of(issue(), tensors))

    queued = COMM.submit(run, tensors[0] if tensors else torch.empty(0), True, group)
    assert queued is not None
    devices = sorted({t.device for t in tensors if t.is_cuda}, key=str)
    out: torch.futures.Future[Any] = torch.futures.Future(devices=devices or None)

    def finished(done: torch.futures.Future[Any]) -> None:
        try:
            out.set_result(done.wait())
        except BaseException as exc:  # the exact group's error, as it raised it
            out.set_exception(exc)

    def ran(done: torch.futures.Future[Any]) -> None:
        try:
            done.wait()  # the agreement's error (a mismatch, a dead peer), with its own type
        except BaseException as exc:
            out.set_exception(exc)
        else:
            issued[0].add_done_callback(finished)

    queued.future.add_done_callback(ran)
    return out


def future_of(work: dist.Work, tensors: list[torch.Tensor]) -> torch.futures.Future[Any]:
    """``work``'s future; for a Gloo work that has none (``reduce_scatter``), one completed by a
    thread that waits for it (value: its result, else ``tensors``), so that the communication
    thread never does."""
    try:
        return work.get_future()
    except RuntimeError:  # "Work::getFuture not implemented"
        pass
    future: torch.futures.Future[Any] = torch.futures.Future()

    def wait() -> None:
        try:
            work.wait()
        except BaseException as exc:
            future.set_exception(exc)
            return
        try:
            value = work.result()
        except RuntimeError:  # "result() not implemented": the tensors, reduced in place
            value = tensors
        future.set_result(value)

    threading.Thread(target=wait, name="cerar-exact-wait", daemon=True).start()
    return future
