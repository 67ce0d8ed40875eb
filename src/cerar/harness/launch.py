"""Run one command as ``world_size`` local ranks of a torch.distributed job, on a fast or slow net.

:func:`launch` starts the ranks with the environment ``init_process_group("gloo")`` (``env://``)
reads (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ``GLOO_SOCKET_IFNAME``), waits for them, and returns their exit codes and output.

Regimes:

* ``fast``: every rank on loopback (127.0.0.1, a free port), unlimited: the NVLink-like case,
  where this machine's CPUs set the pace.
* ``slow``: every rank in its own network namespace, joined by veth links to a bridge, each
  rank's egress limited by ``tc`` to ``rate`` (see :mod:`cerar.harness.netem`). A short TCP probe between
  two rank namespaces measures the achieved link rate before the ranks start.

Why 400 Mbit/s by default: the link must dominate the built-in all-reduce, or the slow regime
says nothing about slow links. Measured here (4 ranks, 16 MiB float32, `cerar bench`): the TCP
probe achieves 48.2 MB/s; Gloo's all-reduce takes 0.53 s, 1.01x its wire time
``1.5 x 16.8 MB / 48.2 MB/s = 0.52 s``, against 0.04 s on loopback: the link is 93% of the time.
Much faster links bring the two CPU cores back into play (at 1 Gbit/s the wire time of the same
call is 0.2 s, comparable to the CPU work of the coded methods); slower ones only lengthen the run.

If a rank fails or ``timeout_s`` passes, every rank is killed, the network is removed and
:class:`LaunchError` names the failed ranks, their exit codes and the tail of their stderr.
Ranks, namespaces and links are cleaned up on every exit path: normal end, exception, Ctrl-C
(SIGINT) or SIGTERM to the launcher, a crashed rank. A SIGKILLed launcher runs no code: the
kernel then kills its ranks (parent-death signal, Linux) and the next slow launch, or
``cerar bench --cleanup``, removes the namespaces it left.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

from cerar._checks import check_choice, check_float, check_int
from cerar.harness.netem import (
    NetemUnavailable,
    Network,
    check_delay,
    check_rate,
    emulated_network,
    free_loopback_port,
    measure_link_rate,
)

REGIMES = ("fast", "slow")
DEFAULT_RATE = "400mbit"
SLOW_MASTER_PORT = 29500  # inside the run's own namespaces, so it can never collide
_KILL_GRACE_S = 1.0
_TAIL_LINES = 20
_PORT_ATTEMPTS = 3

LineCallback = Callable[[int, str, str], None]

__all__ = [
    "DEFAULT_RATE",
    "REGIMES",
    "LaunchError",
    "LaunchResult",
    "NetemUnavailable",
    "RankResult",
    "launch",
]


@dataclass
class RankResult:
    """One rank's exit code and everything it wrote."""

    rank: int
    returncode: int
    stdout: str
    stderr: str


@dataclass
class LaunchResult:
    """What :func:`launch` returns when every rank exited with 0.

    Attributes:
        ranks: per-rank results, index = rank.
        link_rate_bytes_per_s: achieved TCP payload rate between two rank namespaces, measured
            before the ranks started (``None`` in ``fast`` or without the probe).
        regime: ``"fast"`` or ``"slow"``.
        rate: the ``tc`` rate limit in ``slow`` (``None`` in ``fast``).
        delay: the added one-way delay in ``slow`` (``None`` in ``fast``).
        run_id: the emulated network's id (``None`` in ``fast``); namespaces are
            ``cerar-<run_id>-*``.
        wall_s: seconds from the ranks' start to the last rank's exit.
    """

    ranks: list[RankResult]
    link_rate_bytes_per_s: float | None
    regime: str
    rate: str | None = None
    delay: str | None = None
    run_id: str | None = None
    wall_s: float = 0.0


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


def launch(
    command: Sequence[str],
    world_size: int,
    *,
    regime: str = "fast",
    rate: str = DEFAULT_RATE,
    delay: str = "0ms",
    timeout_s: float = 600.0,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    probe: bool = True,
    on_line: LineCallback | None = None,
) -> LaunchResult:
    """Run ``command`` as ``world_size`` ranks and wait for all of them.

    Args:
        command: argv of one rank, e.g. ``[sys.executable, "-m", "cerar.experiments.bench.worker", ...]``.
        world_size: number of ranks (at least 1).
        regime: ``"fast"`` (loopback) or ``"slow"`` (namespaces, rate-limited links).
        rate: ``slow``: each rank's egress limit, a ``tc`` rate (``"400mbit"``, ``"1gbit"``).
        delay: ``slow``: added one-way latency (``"0ms"``; non-zero needs the kernel's netem).
        timeout_s: limit for the ranks' run, from their start (setup and probe excluded).
        env: extra environment for every rank, over the launcher's own. ``OMP_NUM_THREADS``
            defaults to 1 (two ranks per core here; torch's thread pools would only fight).
        cwd: working directory of the ranks.
        probe: ``slow``: measure the link rate with a short TCP stream before starting.
        on_line: called as ``on_line(rank, "stdout" | "stderr", line)`` for every line a rank
            writes, from a reader thread, while the ranks run (e.g. to drive a progress bar).

    Raises:
        LaunchError: a rank failed, or the timeout passed.
        NetemUnavailable: ``slow`` on a machine without root, ``ip`` or ``tc``.
        ValueError, TypeError: bad arguments.
    """
    argv = _check_command(command)
    world_size = check_int("world_size", world_size, minimum=1)
    regime = check_choice("regime", regime, REGIMES)
    rate, delay = check_rate(rate), check_delay(delay)
    timeout_s = check_float("timeout_s", timeout_s, positive=True)
    if cwd is not None and not os.path.isdir(cwd):
        raise ValueError(f"Argument 'cwd' must be an existing directory, not {cwd!r}.")
    base_env = dict(os.environ)
    base_env.setdefault("OMP_NUM_THREADS", "1")
    base_env["PYTHONUNBUFFERED"] = "1"  # ranks' lines arrive while they run
    base_env.update(_check_env(env))

    with contextlib.ExitStack() as stack:
        stack.enter_context(_sigterm_exits())
        net: Network | None = None
        link_rate: float | None = None
        if regime == "slow":
            net = stack.enter_context(emulated_network(world_size, rate, delay))
            if probe and world_size >= 2:
                link_rate = measure_link_rate(net)
        for attempt in range(_PORT_ATTEMPTS):
            ranks = _Ranks(argv, world_size, base_env, cwd, net, on_line)
            stack.callback(ranks.stop)  # registered before any start; runs before the network's teardown
            ranks.start()
            try:
                results = ranks.wait(timeout_s)
                break
            except LaunchError as exc:
                # On loopback another program may take the free port between our probe and
                # rank 0's bind: try again on a new port (the ranks never got past start-up).
                if net is not None or attempt + 1 == _PORT_ATTEMPTS or not _port_taken(exc):
                    raise
        return LaunchResult(
            ranks=results,
            link_rate_bytes_per_s=link_rate,
            regime=regime,
            rate=rate if net else None,
            delay=delay if net else None,
            run_id=net.run_id if net else None,
            wall_s=ranks.wall_s,
        )
    raise AssertionError("unreachable")  # pragma: no cover - ExitStack does not swallow


def _port_taken(exc: LaunchError) -> bool:
    return any("address already in use" in r.stderr.lower() for r in exc.results)


def _check_command(command: Sequence[str]) -> list[str]:
    if isinstance(command, (str, bytes)) or not isinstance(command, Sequence):
        raise TypeError(f"Argument 'command' must be a sequence of strings (argv), not {command!r}.")
    argv = list(command)
    if not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"Argument 'command' must be a non-empty list of strings, not {command!r}.")
    return argv


def _check_env(env: Mapping[str, str] | None) -> dict[str, str]:
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise TypeError(f"Argument 'env' must be a mapping of strings, not {env!r}.")
    for key, value in env.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"Argument 'env' must map strings to strings, not {key!r}: {value!r}.")
    return dict(env)


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    """Turn SIGTERM into ``SystemExit(143)`` while the launch runs, so cleanup runs too.

    (SIGINT already raises KeyboardInterrupt.) Only the main thread can own signal handlers;
    elsewhere the launcher relies on its caller.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Ranks:
    """The rank processes of one launch, their reader threads and their collected output."""

    def __init__(
        self,
        argv: list[str],
        world_size: int,
        base_env: dict[str, str],
        cwd: str | None,
        net: Network | None,
        on_line: LineCallback | None,
    ) -> None:
        self.world_size = world_size
        self.on_line = on_line
        self.procs: list[subprocess.Popen[str]] = []
        self.out: list[tuple[list[str], list[str]]] = [([], []) for _ in range(world_size)]
        self.threads: list[threading.Thread] = []
        self.wall_s = 0.0
        self.stopped = False
        self.argv, self.base_env, self.cwd, self.net = argv, base_env, cwd, net
        self.started = time.perf_counter()

    def start(self) -> None:
        """Start every rank, with its reader threads."""
        net, world_size, argv, cwd = self.net, self.world_size, self.argv, self.cwd
        port = SLOW_MASTER_PORT if net else free_loopback_port()
        master = net.ranks[0].address if net else "127.0.0.1"
        self.started = time.perf_counter()
        for rank in range(world_size):
            env = dict(self.base_env)
            env.update(
                RANK=str(rank),
                WORLD_SIZE=str(world_size),
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(world_size),
                MASTER_ADDR=master,
                MASTER_PORT=str(port),
                GLOO_SOCKET_IFNAME=net.ranks[rank].ifname if net else "lo",
                CERAR_REGIME="slow" if net else "fast",
            )
            if net:
                env["CERAR_RUN_ID"] = net.run_id
                env["CERAR_IFNAME"] = net.ranks[rank].ifname
            prefix = net.exec_prefix(rank) if net else []
            # Own session: a terminal's Ctrl-C reaches only the launcher, which then stops the
            # ranks itself, and killpg reaches anything a rank started.
            proc = subprocess.Popen(
                [*prefix, *_orphan_guard(), *argv],
                env=env,
                cwd=cwd,
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


def describe_returncode(code: int) -> str:
    """``"1"`` or, for a signal, ``"-9 (SIGKILL)"``."""
    if code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            return str(code)
    return str(code)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m cerar.harness.launch [--world-size N] [--regime R] -- CMD ...``: a small torchrun."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m cerar.harness.launch")
    parser.add_argument("--world-size", "-N", type=int, default=2)
    parser.add_argument("--regime", default="fast", choices=REGIMES)
    parser.add_argument("--rate", default=DEFAULT_RATE)
    parser.add_argument("--delay", default="0ms")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command

    def echo(rank: int, stream: str, line: str) -> None:
        print(f"[{rank}] {line}", file=sys.stdout if stream == "stdout" else sys.stderr, flush=True)

    try:
        result = launch(
            command,
            args.world_size,
            regime=args.regime,
            rate=args.rate,
            delay=args.delay,
            timeout_s=args.timeout,
            on_line=echo,
        )
    except LaunchError as exc:
        print(f"launch failed: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    if result.link_rate_bytes_per_s is not None:
        print(f"link rate {result.link_rate_bytes_per_s / 1e6:.1f} MB/s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
