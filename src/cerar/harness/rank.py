"""The one way a rank process starts and stops: :func:`rank_process`.

Every rank entry point (``cerar.experiments.bench.worker``, ``cerar.experiments.train.worker``,
``cerar.experiments.study.capture``) runs its work inside it::

    with rank_process(timeout_s=300) as me:
        ...  # me.rank, me.world_size

Start: one intra-op thread (several ranks share a few cores: torch's thread pools would only
fight), then ``init_process_group("gloo")`` from the environment a launcher sets (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), unless the process already joined a group.

Stop, in this order, because each step needs the previous one done:

1. ``cerar.shutdown()``: the cerar calls still queued run to the end (the peers' threads are
   still up to take part) and the communication thread exits. It comes first because the
   barrier below is a collective on the same group: issued from another thread while a call
   is on the wire, the two could pair up in a different order on each rank and deadlock. And
   no thread may be inside Gloo when the group goes (the C++ runtime aborts the process
   otherwise, SIGABRT);
2. a barrier, on a clean exit only: no rank leaves (and tears down its end of the links) while
   another still needs it, e.g. before rank 0 has written the results (after an error the peers
   may be gone, and a barrier would only wait for the timeout);
3. ``destroy_process_group()``, if this context created the group: Gloo's own threads stop
   before interpreter teardown (which aborted ranks at exit otherwise).

A worker's ``__main__`` then ends through :func:`exit_rank`, which leaves the process without
interpreter teardown: even with every Python thread gone and the groups destroyed, a rank
occasionally still aborted there ("terminate called without an active exception", SIGABRT, with
no Python frame on the stack), in C++ destructors that run after all of cerar's work and results
are done, and the launcher would report the run as failed.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from cerar._checks import check_float, check_int

__all__ = ["RankInfo", "exit_rank", "rank_process"]


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int


@contextlib.contextmanager
def rank_process(timeout_s: float | None = None, threads: int = 1) -> Iterator[RankInfo]:
    """Join the job's Gloo group for the ``with`` block and leave it cleanly; see the module doc.

    Args:
        timeout_s: the process group's timeout for one collective (``None``: torch's default,
            30 minutes): a dead or stuck peer makes the others fail after this long.
        threads: ``torch.set_num_threads`` for this process.

    Yields:
        The :class:`RankInfo` of this process.
    """
    import torch
    import torch.distributed as dist

    from cerar.comm.collective.api import shutdown

    if timeout_s is not None:
        timeout_s = check_float("timeout_s", timeout_s, positive=True)
    threads = check_int("threads", threads, minimum=1)
    torch.set_num_threads(threads)
    created = not dist.is_initialized()
    if created:
        if timeout_s is None:
            dist.init_process_group("gloo")
        else:
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    clean = False
    try:
        yield RankInfo(dist.get_rank(), dist.get_world_size())
        clean = True
    finally:
        try:
            # A call still running fails on its own within the group's timeout at most.
            stopped = shutdown() if timeout_s is None else shutdown(timeout_s)
            if clean and stopped:
                dist.barrier()
        finally:
            if created and dist.is_initialized():
                dist.destroy_process_group()


def exit_rank(main: Callable[[], int]) -> None:
    """Run a rank's ``main()`` and end the process with its return code, without interpreter
    teardown (see the module doc): the output streams are flushed and ``os._exit`` ends it.

    An exception from ``main`` takes Python's usual way out (its traceback, exit status 1): a
    failed rank is reported as failed either way.
    """
    code = main()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or detached stream has nothing to flush
            stream.flush()
    os._exit(code if isinstance(code, int) else 0)
