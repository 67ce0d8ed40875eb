"""The rank processes of one :func:`cerar.harness.launch.launch`: start, read, wait, kill.

Kept apart from :mod:`cerar.harness.launch` (the arguments, the network, the retry policy) so
that each file reads in one go. Each rank runs in its own session behind an orphan guard (the
kernel kills it if the launcher dies); two reader threads per rank collect its stdout and
stderr line by line and hand each line to the caller's callback while the rank runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO

from cerar.harness.netem import Network

__all__ = ["LaunchError", "LineCallback", "RankProcesses", "RankResult", "describe_returncode"]

_KILL_GRACE_S = 1.0
_TAIL_LINES = 20

LineCallback = Callable[[int, str, str], None]


@dataclass
class RankResult:
    """One rank's exit code and everything it wrote."""

    rank: int
    returncode: int
    stdout: str
    stderr: str


class LaunchError(RuntimeError):
    """A rank failed or the run timed out; every rank was killed and the network removed.

    Attributes:
        failed: ranks that failed on their own (exited non-zero or were killed by a signal
            before the launcher stopped the run); empty on timeout.
        timed_out: the run passed ``timeout_s``.
        results: every rank's result (those the launcher killed have negative exit codes).
    """

    def __init__(self, message: str, failed: Sequence[int], results: Sequence[RankResult], timed_out: bool):
        super().__init__(message)
        self.failed = list(failed)
        self.results = list(results)
        self.timed_out = timed_out


def describe_returncode(code: int) -> str:
    """``"1"`` or, for a signal, ``"-9 (SIGKILL)"``."""
    if code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            return str(code)
    return str(code)


class RankProcesses:
    """The rank processes of one launch, their reader threads and their collected output."""

    def __init__(
        self,
        argv: list[str],
        world_size: int,
        base_env: dict[str, str],
        cwd: str | None,
        net: Network | None,
        on_line: LineCallback | None,
        ranks_per_node: int = 1,
    ) -> None:
        self.world_size = world_size
        self.ranks_per_node = ranks_per_node
        self.on_line = on_line
        self.procs: list[subprocess.Popen[str]] = []
        self.out: list[tuple[list[str], list[str]]] = [([], []) for _ in range(world_size)]
        self.threads: list[threading.Thread] = []
        self.wall_s = 0.0
        self.stopped = False
        self.argv, self.base_env, self.cwd, self.net = argv, base_env, cwd, net
        self.started = time.perf_counter()

    def rank_env(self, rank: int, port: int) -> dict[str, str]:
        """The environment of ``rank``: the launcher's, plus the rendezvous ``env://`` reads and
        torchrun's node variables (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``). With
        ``ranks_per_node`` G > 1, ranks ``k*G .. k*G + G - 1`` are node ``k``; with 1, all ranks
        are on this one machine, as before. ``CERAR_RANKS_PER_NODE`` is G either way (the
        bench's hierarchical methods read it)."""
        net = self.net
        env = dict(self.base_env)
        per_node = self.ranks_per_node
        local = per_node if per_node > 1 else self.world_size
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(rank % local),
            LOCAL_WORLD_SIZE=str(local),
            GROUP_RANK=str(rank // local),
            CERAR_RANKS_PER_NODE=str(per_node),
            MASTER_ADDR=net.ranks[0].address if net else "127.0.0.1",
            MASTER_PORT=str(port),
            GLOO_SOCKET_IFNAME=net.ranks[rank].ifname if net else "lo",
            CERAR_REGIME="slow" if net else "fast",
        )
        if net:
            env["CERAR_RUN_ID"] = net.run_id
            env["CERAR_IFNAME"] = net.ranks[rank].ifname
        return env

    def start(self, port: int) -> None:
        """Start every rank (rank 0 listens on ``port``), with its reader threads."""
        self.started = time.perf_counter()
        for rank in range(self.world_size):
            prefix = self.net.exec_prefix(rank) if self.net else []
            # Own session: a terminal's Ctrl-C reaches only the launcher, which then stops the
            # ranks itself, and killpg reaches anything a rank started.
            proc = subprocess.Popen(
                [*prefix, *_orphan_guard(), *self.argv],
                env=self.rank_env(rank, port),
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                errors="replace",
                start_new_session=True,
            )
            self.procs.append(proc)
            for stream, name, sink in (
                (proc.stdout, "stdout", self.out[rank][0]),
                (proc.stderr, "stderr", self.out[rank][1]),
            ):
                thread = threading.Thread(target=self._read, args=(rank, name, stream, sink), daemon=True)
                thread.start()
                self.threads.append(thread)

    def _read(self, rank: int, name: str, stream: IO[str] | None, sink: list[str]) -> None:
        if stream is None:
            return
        for line in stream:
            sink.append(line)
            if self.on_line is not None:
                try:
                    self.on_line(rank, name, line.rstrip("\n"))
                except Exception:  # a broken callback must not stop the pipe from draining
                    pass

    def wait(self, timeout_s: float) -> list[RankResult]:
        """Every rank's result once all exited with 0; LaunchError (all killed) otherwise."""
        deadline = self.started + timeout_s
        while True:
            codes = [p.poll() for p in self.procs]
            failed = [r for r, code in enumerate(codes) if code is not None and code != 0]
            if failed:
                self.stop()
                raise self._error(failed, timed_out=False, timeout_s=timeout_s)
            if all(code == 0 for code in codes):
                self.wall_s = time.perf_counter() - self.started
                self._join()
                return self._results()
            if time.perf_counter() > deadline:
                self.stop()
                raise self._error([], timed_out=True, timeout_s=timeout_s)
            time.sleep(0.05)

    def stop(self) -> None:
        """Kill every rank (and whatever it started) that is still running; idempotent."""
        if self.stopped:
            return
        self.stopped = True
        for sig, grace in ((signal.SIGTERM, _KILL_GRACE_S), (signal.SIGKILL, 5.0)):
            for proc in self.procs:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)  # the group outlives its leader: always signal it
            end = time.perf_counter() + grace
            while time.perf_counter() < end and any(p.poll() is None for p in self.procs):
                time.sleep(0.02)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1.0)
        if not self.wall_s:
            self.wall_s = time.perf_counter() - self.started
        self._join()

    def _join(self) -> None:
        for thread in self.threads:
            thread.join(timeout=2.0)

    def _results(self) -> list[RankResult]:
        return [
            RankResult(rank, p.returncode if p.returncode is not None else -9, "".join(out), "".join(err))
            for rank, (p, (out, err)) in enumerate(zip(self.procs, self.out, strict=True))
        ]

    def _error(self, failed: list[int], *, timed_out: bool, timeout_s: float) -> LaunchError:
        results = self._results()
        if timed_out:
            head = f"ranks timed out after {timeout_s:g} s and were killed"
            shown = list(range(self.world_size))
        else:
            codes = ", ".join(f"rank {r} exited with {describe_returncode(results[r].returncode)}" for r in failed)
            head = f"{codes}; the other ranks were killed"
            shown = failed
        parts = [head]
        for r in shown:
            tail = "".join(results[r].stderr.splitlines(keepends=True)[-_TAIL_LINES:]).rstrip()
            parts.append(f"--- rank {r} (exit {describe_returncode(results[r].returncode)}) stderr tail ---")
            parts.append(tail or "(empty)")
        return LaunchError("\n".join(parts), failed, results, timed_out)


# Run in front of each rank's command on Linux: ask the kernel to SIGKILL the rank when the
# launcher dies (even by SIGKILL, which no cleanup code survives), then exec the command. The
# launcher stays the parent because `ip netns exec` execs rather than forks.
_GUARD = """
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
except Exception:
    pass
if os.getppid() != int(sys.argv[1]):
    os._exit(137)  # the launcher died before the guard was armed
os.execvp(sys.argv[2], sys.argv[2:])
"""


def _orphan_guard() -> list[str]:
    """The argv prefix that kills a rank when its launcher dies (empty off Linux)."""
    if not sys.platform.startswith("linux"):
        return []
    return [sys.executable, "-c", _GUARD, str(os.getpid())]
