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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO

from cerar.harness.netem import Network

__all__ = [
    "LaunchError",
    "LineCallback",
    "RankProcesses",
    "RankResult",
    "base_environment",
    "describe_returncode",
    "orphan_guard",
]

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


def base_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The launcher's environment under ``env``, as every rank gets it."""
    base = dict(os.environ)
    base.setdefault("OMP_NUM_THREADS", "1")
    base["PYTHONUNBUFFERED"] = "1"  # ranks' lines arrive while they run
    base.update(env or {})
    return base


class RankProcesses:
    """The rank processes of one launch, their reader threads and their collected output.

    One process per rank (``count`` = ``world_size``, labelled ``rank`` in errors); a subclass
    may start other processes (:class:`cerar.harness.torchrun.NodeProcesses`: one torchrun
    agent per node) by overriding ``count``, ``label``, :meth:`prefix`, :meth:`command` and
    :meth:`env`, or start them otherwise (:class:`cerar.harness.forked.ForkedRanks`: forked
    from one process) by overriding :meth:`start`.
    """

    label = "rank"

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
        self.count = world_size
        self.kill_descendants = False  # also kill what the processes started in other sessions
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

    def prefix(self, index: int) -> list[str]:
        """The argv prefix of process ``index`` (its namespace, in ``slow``)."""
        return self.net.exec_prefix(index) if self.net else []

    def command(self, index: int, port: int) -> list[str]:
        """The argv of process ``index``, after :meth:`prefix` and the orphan guard."""
        return self.argv

    def env(self, index: int, port: int) -> dict[str, str]:
        """The environment of process ``index``."""
        return self.rank_env(index, port)

    def start(self, port: int) -> None:
        """Start every rank (rank 0 listens on ``port``), with its reader threads."""
        self.started = time.perf_counter()
        for rank in range(self.count):
            # Own session: a terminal's Ctrl-C reaches only the launcher, which then stops the
            # ranks itself, and killpg reaches anything a rank started.
            proc = subprocess.Popen(
                [*self.prefix(rank), *orphan_guard(), *self.command(rank, port)],
                env=self.env(rank, port),
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                errors="replace",
                start_new_session=True,
            )
            self.procs.append(proc)
            self.follow(rank, proc.stdout, proc.stderr)

    def follow(self, rank: int, stdout: IO[str] | None, stderr: IO[str] | None) -> None:
        """Start ``rank``'s two reader threads on its output streams."""
        for stream, name, sink in ((stdout, "stdout", self.out[rank][0]), (stderr, "stderr", self.out[rank][1])):
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
        # Processes started in sessions of their own (torchrun's ranks) escape killpg: they are
        # found before the first signal (their parent may die of it) and killed at the end.
        others = _descendants([p.pid for p in self.procs]) if self.kill_descendants else set()
        for sig, grace in ((signal.SIGTERM, _KILL_GRACE_S), (signal.SIGKILL, 5.0)):
            if sig == signal.SIGKILL and self.kill_descendants:
                others |= _descendants([p.pid for p in self.procs])
            for proc in self.procs:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)  # the group outlives its leader: always signal it
            end = time.perf_counter() + grace
            while time.perf_counter() < end and any(p.poll() is None for p in self.procs):
                time.sleep(0.02)
        for pid in others:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
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
            head = f"{self.label}s timed out after {timeout_s:g} s and were killed"
            shown = list(range(self.count))
        else:
            label = self.label
            codes = ", ".join(f"{label} {r} exited with {describe_returncode(results[r].returncode)}" for r in failed)
            head = f"{codes}; the other {label}s were killed"
            shown = failed
        parts = [head]
        for r in shown:
            tail = "".join(results[r].stderr.splitlines(keepends=True)[-_TAIL_LINES:]).rstrip()
            parts.append(f"--- {self.label} {r} (exit {describe_returncode(results[r].returncode)}) stderr tail ---")
            parts.append(tail or "(empty)")
        return LaunchError("\n".join(parts), failed, results, timed_out)


# Run in front of each rank's command on Linux: ask the kernel to SIGKILL the rank when the
# launcher dies (even by SIGKILL, which no cleanup code survives), then exec the command. The
# launcher stays the parent because `ip netns exec` execs rather than forks. Parent "-": the
# process that started the guard, whichever it is (torchrun's agent, whose pid is not known
# when its argv is built).
_GUARD = """
import ctypes, os, signal, sys
parent = os.getppid() if sys.argv[1] == "-" else int(sys.argv[1])
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
except Exception:
    pass
if os.getppid() != parent:
    os._exit(137)  # the launcher died before the guard was armed
os.execvp(sys.argv[2], sys.argv[2:])
"""


def orphan_guard(parent: str | None = None) -> list[str]:
    """The argv prefix that kills a process when its parent dies (empty off Linux).

    ``parent``: the pid that must stay the parent (default: this launcher's), or ``"-"`` for
    the process that starts the guard.
    """
    if not sys.platform.startswith("linux"):
        return []
    return [sys.executable, "-c", _GUARD, parent if parent is not None else str(os.getpid())]


def _descendants(roots: Sequence[int]) -> set[int]:
    """Every live descendant of ``roots`` (from ``/proc``; empty where there is none)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return set()
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found: set[int] = set()
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found
