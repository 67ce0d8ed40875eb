"""The client examples (examples/*.py) run as users run them: under torchrun, on Gloo ranks.

Each test launches one example with ``python -m torch.distributed.run --standalone`` (what the
``torchrun`` script runs) and checks what the example reports: exit code 0, every rank's hook
statistics (the hook really ran: calls and bytes on every rank, the same number of calls
everywhere) and a training loss that fell. The Lightning and accelerate tests skip where their
package is missing; the ``dev`` extra installs both, so CI runs them. Every launch has a hard
deadline and kills its whole process group when it passes, so a hang fails instead of
stalling CI. Models are tiny: the time is mostly the ranks importing torch and the clients.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 240  # a loaded 2-core machine; an unloaded run takes 10-30 s

# Not anchored to line starts: the ranks share one stdout, and torch or a client may write a
# partial line of its own just before an example's report.
HOOK_LINE = re.compile(r"rank (\d+): hook calls=(\d+) bytes_sent=(\d+) rounds=(\d+)")
LOSS_LINE = re.compile(r"first loss (\d+\.\d+) final loss (\d+\.\d+)")


@dataclass
class Report:
    output: str
    hook: dict[int, tuple[int, int, int]]  # rank -> (calls, bytes_sent, rounds)
    first_loss: float
    final_loss: float


def run_example(script: str, nproc: int, *args: str) -> Report:
    """Run ``examples/<script>`` on ``nproc`` local ranks and parse what it printed."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(EXAMPLES / script),
        *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # torchrun and its ranks share one process group: killed together
    )
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{script} on {nproc} ranks did not finish within {TIMEOUT_S} s:\n{output}")
    assert process.returncode == 0, f"{script} exited {process.returncode}:\n{output}"
    hook = {int(m[1]): (int(m[2]), int(m[3]), int(m[4])) for m in HOOK_LINE.finditer(output)}
    losses = LOSS_LINE.findall(output)
    assert len(losses) == 1, f"{script} printed {len(losses)} loss lines, not 1:\n{output}"
    return Report(output, hook, float(losses[0][0]), float(losses[0][1]))


def check(report: Report, nproc: int) -> None:
    """The hook ran on every rank, for the same buckets, and training made progress."""
    assert sorted(report.hook) == list(range(nproc)), report.output
    calls = {calls for calls, _, _ in report.hook.values()}
    assert len(calls) == 1, f"ranks ran different numbers of hook calls {calls}:\n{report.output}"
    assert calls.pop() > 0, report.output
    assert all(sent > 0 and rounds > 0 for _, sent, rounds in report.hook.values()), report.output
    # The tasks are easy: a loss that merely wobbles down would mean the averaging is broken.
    assert report.final_loss < 0.5 * report.first_loss, report.output


@pytest.mark.slow
@pytest.mark.multirank
def test_torchrun_example() -> None:
    """The README's command, 4 ranks: CERAR's approximate path (c = 8 > N)."""
    report = run_example("torchrun_ddp.py", 4)
    check(report, 4)


@pytest.mark.slow
@pytest.mark.multirank
def test_lightning_example() -> None:
    """DDPStrategy with the state built before the process group, and the CPU workaround.

    Two ranks: Lightning's import is the slowest part of this file (about 7 s of CPU per rank),
    and what is tested here is the client's wiring; the torchrun test covers N = 4.
    """
    pytest.importorskip("pytorch_lightning")
    report = run_example("lightning_ddp.py", 2)
    check(report, 2)


@pytest.mark.slow
@pytest.mark.multirank
def test_lightning_example_through_cerars_group() -> None:
    """DDPStrategy(process_group_backend="cerar"): Lightning's default group is cerar's, no hook."""
    pytest.importorskip("pytorch_lightning")
    report = run_example("lightning_ddp.py", 2, "--route", "group")
    check(report, 2)
    assert "backend=cerar" in report.output


@pytest.mark.slow
@pytest.mark.multirank
def test_accelerate_example() -> None:
    """Accelerator(cpu=True) under torchrun, the hook registered on the prepared model."""
    pytest.importorskip("accelerate")
    report = run_example("accelerate_ddp.py", 3)
    check(report, 3)


@pytest.mark.slow
@pytest.mark.multirank
def test_ddp_group_example() -> None:
    """DDP with cerar's process group and no hook, 4 ranks: DDP's buckets through CERAR."""
    report = run_example("ddp_group.py", 4)
    check(report, 4)
    assert "exact=['allgather', 'broadcast', 'sum']" in report.output  # start-up and the loss logging


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("route", ["mesh", "hook"])
def test_fsdp2_hsdp_example(route: str) -> None:
    """FSDP2 HSDP on 3 emulated nodes of 2 ranks, CERAR between them, by either route."""
    report = run_example("fsdp2_hsdp.py", 6, "--ranks-per-node", "2", "--route", route)
    check(report, 6)
    assert "nodes=3" in report.output
