"""Run a function on N Gloo ranks in forked processes, with a hard deadline.

``run_ranks(fn, world_size, *args)`` returns ``[fn(rank, world_size, *args) for each rank]``;
a rank that plays a stopped peer calls :func:`wait_for_peers`.
A rank's exception comes back as a :class:`RankFailure` in its slot (so tests can assert that
*every* rank raised); a rank that neither returns nor raises before ``timeout`` fails the test
with all processes killed, so a regression fails instead of hanging CI.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class RankFailure:
    rank: int
    type_name: str
    message: str
    traceback: str


# Set by run_ranks before it forks, so that its ranks inherit them: how many ranks of the run have
# returned or raised so far (a shared counter), and how many there are.
_RETURNED: Any = None
_WORLD = 0


def wait_for_peers(at_most: float) -> None:
    """In a rank: stay alive and silent until every other rank of this run has returned or
    raised, or for ``at_most`` seconds: a stopped peer for exactly as long as the others need
    one (a fixed sleep long enough for a loaded machine made each such test wait it out)."""
    end = time.monotonic() + at_most
    while _RETURNED.value < _WORLD - 1 and time.monotonic() < end:
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    pg_timeout: float,
    results: Any,
    args: tuple[Any, ...],
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=pg_timeout)
        )
        value: Any = fn(rank, world_size, *args)
    except BaseException as exc:  # reported to the parent, which decides
        value = RankFailure(rank, type(exc).__name__, str(exc), traceback.format_exc())
    with _RETURNED.get_lock():
        _RETURNED.value += 1
    results.put((rank, value))
    results.close()
    results.join_thread()  # flush the queue's feeder thread before os._exit below
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    os._exit(0)  # skip interpreter teardown: a dead peer must not make this rank hang at exit


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    pg_timeout: float = 30.0,
    allow_missing: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; see the module docstring.

    ``allow_missing``: a rank that exits without reporting (e.g. killed on purpose) gets None.
    """
    global _RETURNED, _WORLD
    ctx = mp.get_context("fork")
    _RETURNED, _WORLD = ctx.Value("i", 0), world_size
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, port, pg_timeout, results, args), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    collected: dict[int, Any] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(collected) < world_size:
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(collected))
                raise TimeoutError(f"ranks {missing} did not finish in {timeout} s")
            try:
                rank, value = results.get(timeout=min(remaining, 1.0))
                collected[rank] = value
            except queue.Empty:
                if allow_missing and all(not p.is_alive() for p in procs):
                    break
                # A rank reports before it exits 0; one that died (a signal, an abort in C++) never
                # will, and waiting out the timeout would hide how it ended.
                died = {r: p.exitcode for r, p in enumerate(procs) if r not in collected and p.exitcode}
                if died and not allow_missing:
                    message = f"ranks died without reporting (rank: exit code; negative: a signal): {died}"
                    raise RuntimeError(message) from None
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return [collected.get(r) for r in range(world_size)]


def check(values: list[Any]) -> list[Any]:
    """Raise if any rank failed, showing its traceback."""
    for value in values:
        if isinstance(value, RankFailure):
            raise AssertionError(f"rank {value.rank} raised {value.type_name}: {value.message}\n{value.traceback}")
    return values
