"""The rank start/stop every worker uses (cerar.harness.rank) and the progress-line protocol
(cerar.harness.progress), end to end under the launcher."""

from __future__ import annotations

import sys
import textwrap

import pytest

from cerar.harness.launch import launch
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
