"""cerar.shutdown(): stopping the communication thread, restarting it, and exiting cleanly."""

from __future__ import annotations

import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import cerar
from cerar.coding import codes
from cerar.comm.collective.api import ShutdownError
from cerar.harness.launch import launch
from multirank import check, run_ranks

pytestmark = pytest.mark.multirank


def _comm_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "cerar-comm" and t.is_alive())


def _restart_worker(rank: int, world: int) -> dict[str, object]:
    code = codes.perturbed(world, 2 * world)
    out: dict[str, object] = {"before": cerar.shutdown()}  # never used yet: a no-op
    x = torch.full((1000,), float(rank + 1))
    cerar.all_reduce(x, code=code)
    out["threads_running"] = _comm_threads()
    # Queued async calls are finished, not dropped, by a shutdown.
    pending = [torch.full((500,), float(rank)) for _ in range(3)]
    works = [cerar.all_reduce(t, async_op=True, code=code) for t in pending]
    out["stopped"] = cerar.shutdown()
    out["completed"] = [w.is_completed() for w in works]
    out["pending"] = [float(t.mean()) for t in pending]
    out["threads_after"] = _comm_threads()
    out["again"] = cerar.shutdown()  # idempotent
    y = torch.full((1000,), float(rank + 1))
    cerar.ring_all_reduce(y)  # a later call starts a new thread
    out["restarted"] = (float(x.mean()), float(y.mean()), _comm_threads())
    return out


def test_shutdown_finishes_queued_calls_and_a_later_call_restarts() -> None:
    world = 3
    for out in check(run_ranks(_restart_worker, world, timeout=90)):
        assert out["before"] is True
        assert out["threads_running"] == 1
        assert out["stopped"] is True and out["again"] is True
        assert out["completed"] == [True, True, True]
        assert out["pending"] == [pytest.approx(3.0, rel=1e-3)] * 3  # 0 + 1 + 2
        assert out["threads_after"] == 0
        x_mean, y_mean, threads = out["restarted"]
        assert x_mean == pytest.approx(6.0, rel=1e-3) and y_mean == pytest.approx(6.0, rel=1e-6)
        assert threads == 1


def _stuck_worker(rank: int, world: int) -> dict[str, object]:
    code = codes.exact(world)
    out: dict[str, object] = {}
    if rank == 0:
        first = torch.ones(100)
        stuck = cerar.all_reduce(first, async_op=True, code=code)  # rank 1 joins 3 s later
        queued = cerar.all_reduce(torch.ones(100), async_op=True, code=code)  # rank 1 never does
        started = time.monotonic()
        out["stopped"] = cerar.shutdown(timeout_s=0.5)
        out["waited"] = time.monotonic() - started
        try:
            queued.wait(timeout=5)
        except ShutdownError as exc:
            out["queued"] = "ShutdownError: " + str(exc)
        stuck.wait(timeout=30)  # the abandoned thread still finishes the call it was in
        out["stuck"] = float(first[0])
    else:
        time.sleep(3.0)
        first = torch.ones(100)
        cerar.all_reduce(first, code=code)
        out["stuck"] = float(first[0])
    after = torch.ones(10)
    cerar.all_reduce(after, code=code)  # a fresh thread on rank 0
    out["after"] = float(after[0])
    return out


def test_shutdown_gives_up_on_a_stuck_call_and_fails_the_queued_ones() -> None:
    results = check(run_ranks(_stuck_worker, 2, timeout=90))
    assert results[0]["stopped"] is False
    assert results[0]["waited"] > 0.4  # it waited its timeout (0.5 s) for the stuck call, then gave up
    assert "never ran" in results[0]["queued"]
    assert [r["stuck"] for r in results] == [2.0, 2.0]
    assert [r["after"] for r in results] == [2.0, 2.0]


def test_shutdown_without_any_call_is_a_no_op() -> None:
    assert cerar.shutdown() is True
    assert cerar.shutdown(timeout_s=0) is True
    with pytest.raises(ValueError, match=r"Argument 'timeout_s' must be non-negative, not -1\.0"):
        cerar.shutdown(timeout_s=-1)
    with pytest.raises(TypeError, match="Argument 'timeout_s'"):
        cerar.shutdown(timeout_s="soon")  # type: ignore[arg-type]


# Exits while calls are still running or queued. An exit handler registered before the first
# cerar call runs after cerar's own (last in, first out): it sees whether they all finished.
IN_FLIGHT = textwrap.dedent(
    """
    import atexit, sys
    import torch, torch.distributed as dist
    import cerar
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    code = cerar.codes.perturbed(world, 2 * world)

    def report():
        sys.stdout.write(f"completed {[w.is_completed() for w in works]}\\n")
        sys.stdout.flush()

    atexit.register(report)
    x = torch.randn(2_000_000)
    works = [cerar.all_reduce(x, async_op=True, code=code) for _ in range(3)]
    """
)


def test_exit_with_async_calls_in_flight_exits_cleanly(tmp_path: Path) -> None:
    script = tmp_path / "in_flight.py"
    script.write_text(IN_FLIGHT)
    # Without the exit handler the C++ runtime aborted such processes (SIGABRT) most times.
    for _ in range(3):
        result = launch([sys.executable, str(script)], 2, timeout_s=120)
        assert [r.returncode for r in result.ranks] == [0, 0]
        assert [r.stdout.strip() for r in result.ranks] == ["completed [True, True, True]"] * 2
        assert not any("terminate called" in r.stderr for r in result.ranks)
