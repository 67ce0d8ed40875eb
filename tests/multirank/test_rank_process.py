"""The rank start/stop every worker uses (cerar.harness.rank) and the progress-line protocol
(cerar.harness.progress), end to end under the launcher."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from cerar.harness.launch import LaunchError, launch
from cerar.harness.progress import PREFIX, Progress, format_progress, parse_progress

PROGRESS_RANK = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    import cerar
    from cerar.harness.progress import print_progress
    from cerar.harness.rank import rank_process
    with rank_process(timeout_s=60, threads=1) as me:
        print("me", me.rank, me.world_size, torch.get_num_threads(), flush=True)
        x = torch.full((1000,), float(me.rank + 1))
        work = cerar.all_reduce(x, async_op=True, code=cerar.codes.exact(me.world_size))
        if me.rank == 0:
            for step in (1, 2, 3):
                print_progress("demo", step, 3, f"loss {0.5 / step:.3f}")
    print("left", dist.is_initialized(), work.is_completed(), float(x[0]), flush=True)
    """
)


@pytest.mark.multirank
def test_rank_process_and_progress_lines() -> None:
    seen: list[Progress] = []

    def on_line(rank: int, stream: str, line: str) -> None:
        progress = parse_progress(line, "demo")
        if progress is not None:
            seen.append(progress)

    result = launch([sys.executable, "-c", PROGRESS_RANK], 2, timeout_s=120, on_line=on_line)
    assert seen == [Progress("demo", step, 3, f"loss {0.5 / step:.3f}") for step in (1, 2, 3)]
    for rank, r in enumerate(result.ranks):
        lines = [line for line in r.stdout.splitlines() if not line.startswith("@@cerar-progress")]
        # One thread; the group is gone after the block, and the async call finished before.
        assert lines == [f"me {rank} 2 1", "left False True 3.0"]


EXIT_RANK = textwrap.dedent(
    """
    import sys, torch, cerar
    from cerar.harness.rank import exit_rank, rank_process
    def main():
        with rank_process(timeout_s=60, threads=1) as me:
            x = torch.ones(1000)
            cerar.all_reduce(x, code=cerar.codes.exact(me.world_size))
        print("sum", float(x[0]))
        print("to stderr", file=sys.stderr)
        return int(sys.argv[1]) if me.rank == 1 else 0
    exit_rank(main)
    print("never")
    """
)


@pytest.mark.multirank
def test_exit_rank_flushes_the_output_and_keeps_the_return_code() -> None:
    result = launch([sys.executable, "-c", EXIT_RANK, "0"], 2, timeout_s=120)
    for r in result.ranks:
        assert r.returncode == 0
        assert r.stdout.splitlines() == ["sum 2.0"]
        assert "to stderr" in r.stderr
    with pytest.raises(LaunchError, match="rank 1 exited with 3"):
        launch([sys.executable, "-c", EXIT_RANK, "3"], 2, timeout_s=120)


def test_exit_rank_flushes_buffered_output() -> None:
    # The launcher makes ranks' output unbuffered; without it, os._exit would drop what a block
    # buffer holds unless exit_rank flushes it first.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    script = "from cerar.harness.rank import exit_rank\nexit_rank(lambda: print('kept') or 4)\nprint('never')"
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (4, "kept\n")


def test_progress_lines_round_trip_and_reject_others() -> None:
    line = format_progress("bench", 3, 10, "cerar c=8 64K")
    assert line == f"{PREFIX} bench 3 10 cerar c=8 64K"
    assert parse_progress(line + "\n") == Progress("bench", 3, 10, "cerar c=8 64K")
    assert parse_progress(line, "bench") == Progress("bench", 3, 10, "cerar c=8 64K")
    assert parse_progress(line, "train") is None  # another worker's line
    assert parse_progress(format_progress("train", 0, 5)) == Progress("train", 0, 5, "")
    for other in ("cerar-progress 1 2 0.5", f"{PREFIX} train x 2", f"{PREFIX} train 1", "", "[0] hello"):
        assert parse_progress(other) is None
    with pytest.raises(ValueError, match="Argument 'kind'"):
        format_progress("Bench progress", 1, 2)
    with pytest.raises(ValueError, match="Argument 'done' must be a non-negative integer, not -1"):
        format_progress("bench", -1, 2)
    with pytest.raises(ValueError, match="Argument 'detail'"):
        format_progress("bench", 1, 2, "two\nlines")
