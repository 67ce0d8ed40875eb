"""Ranks forked from one process that imported their heavy modules once (``launch(preload=)``).

A rank of a short run spends most of its CPU importing: torch, FSDP and transformers' GPT-NeoX
cost each rank about 6 s of CPU before its first step (transformers alone reads every model
file it ships to build its import table), paid N times per launch on cores the ranks share.
A :class:`Zygote` is one Python process that imports those modules once and then, for each
launch handed to it, forks the launch's ranks: each child takes its own stdout and stderr
pipes, its rank's environment and working directory, and runs the command's module as
``__main__``, as ``python -m`` would. The imported pages are shared copy-on-write; what a rank
does once it runs is unchanged. One zygote serves every launch of a ``cerar train`` run.

The contract of the direct start is kept: one exit code and one output per rank; a launch's
ranks form one process group, which the launcher signals to stop them and whatever they
started; the kernel kills a rank when the zygote dies and the zygote when the launcher dies
(the orphan guard). Only ``python -m MODULE`` commands fork, and the environment read while
importing is the zygote's (the launcher's: a rank's own variables, ``RANK`` and the
rendezvous, are read when it joins the group). Only ranks on this machine's network fork: a
namespace entered after the fork would still show the host's ``/sys`` (``ip netns exec``
remounts it), which the bench reads for its byte counters.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from typing import Any

from cerar.harness.processes import RankProcesses, base_environment, orphan_guard

__all__ = ["ForkedRanks", "Zygote", "module_command"]

_START_S = 60.0  # a zygote that has not forked a launch's ranks by then is broken
_MAX_SPEC_BYTES = 1 << 17  # one message on the zygote's socket (the kernel's default buffer: ~200 KiB)


def module_command(argv: Sequence[str]) -> tuple[str, list[str]]:
    """``(module, args)`` of ``[sys.executable, "-m", module, *args]`` (the zygote is this
    interpreter); ValueError for any other argv."""
    if len(argv) < 3 or argv[0] != sys.executable or argv[1] != "-m":
        raise ValueError(f"Argument 'command' must be [sys.executable, '-m', MODULE, ...] with preload, not {argv!r}.")
    return argv[2], list(argv[3:])


class Zygote:
    """One process that imported ``modules`` and forks the ranks of each launch given to it.

    Use as a context manager (or call :meth:`close`) and pass it as ``launch(preload=)``; a
    list of module names there starts a zygote for that launch alone. ``cwd``: where it
    starts (``python -m`` imports from there); ``env``: added to the launcher's environment,
    which is what the modules see while they import.
    """

    def __init__(self, modules: Sequence[str], *, cwd: str | None = None, env: dict[str, str] | None = None) -> None:
        self.modules = list(modules)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self.process = subprocess.Popen(
                [*orphan_guard(), sys.executable, "-m", "cerar.harness.forked", str(theirs.fileno())],
                env=base_environment(env),
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                pass_fds=[theirs.fileno()],
                start_new_session=True,  # the launcher's Ctrl-C is the launcher's to handle
            )
        self._socket = ours
        self._socket.sendall(json.dumps(self.modules).encode())

    def fork(self, spec: dict[str, Any], status: int, pipes: Sequence[int]) -> None:
        """Hand one launch to the zygote: its ranks' settings, the status pipe it reports on
        (``group PGID``, then ``RANK CODE`` per rank as each exits) and each rank's stdout and
        stderr pipe."""
        payload = json.dumps(spec).encode()
        if len(payload) > _MAX_SPEC_BYTES:
            raise ValueError(f"the ranks' settings take {len(payload)} bytes, over a zygote's {_MAX_SPEC_BYTES}")
        if self.process.poll() is not None:
            raise RuntimeError(f"the zygote (pid {self.process.pid}) exited with {self.process.returncode}")
        socket.send_fds(self._socket, [payload], [status, *pipes])

    def close(self) -> None:
        """Stop the zygote (a launch still running is the launcher's to stop first)."""
        self._socket.close()  # it exits when it reads the end
        try:
            self.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Status:
    """What the zygote reports on one launch's status pipe, read by a thread."""

    def __init__(self, fd: int) -> None:
        self.codes: dict[int, int] = {}
        self.group = 0
        self.grouped = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(fd,), daemon=True)
        self._thread.start()

    def _read(self, fd: int) -> None:
        with os.fdopen(fd) as status:
            for line in status:
                key, value = line.split()
                if key == "group":
                    self.group = int(value)
                    self.grouped.set()
                else:
                    self.codes[int(key)] = int(value)
        self.grouped.set()  # the end without a group: the zygote is gone

    def finish(self) -> None:
        self._thread.join(timeout=2.0)


class _ForkedRank:
    """One rank as :class:`RankProcesses` handles a process: ``pid`` (the launch's process
    group, as for a directly started rank), ``poll``, ``wait`` and ``returncode``. A rank the
    zygote did not report died with it and takes its exit code."""

    def __init__(self, zygote: Zygote, rank: int, status: _Status) -> None:
        self.pid, self.rank, self.returncode = status.group, rank, None
        self._zygote, self._status = zygote, status

    def poll(self) -> int | None:
        if self.returncode is None:
            code = self._status.codes.get(self.rank)
            if code is None and self._zygote.process.poll() is not None:
                self._status.finish()
                code = self._status.codes.get(self.rank, self._zygote.process.returncode or -signal.SIGKILL)
            self.returncode = code
        return self.returncode

    def wait(self, timeout: float) -> int:
        end = time.perf_counter() + timeout
        while (code := self.poll()) is None:
            if time.perf_counter() > end:
                raise subprocess.TimeoutExpired(f"rank {self.rank}", timeout)
            time.sleep(0.02)
        return code


class ForkedRanks(RankProcesses):
    """:class:`RankProcesses` whose ranks the ``zygote`` forks."""

    def __init__(self, *args: Any, zygote: Zygote, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.module, self.args = module_command(self.argv)
        self.zygote = zygote

    def start(self, port: int) -> None:
        self.started = time.perf_counter()
        pipes = [(os.pipe(), os.pipe()) for _ in range(self.count)]
        status_read, status_write = os.pipe()
        writes = [fd for out, err in pipes for fd in (out[1], err[1])]
        envs = [self.env(rank, port) for rank in range(self.count)]
        spec = {"module": self.module, "args": self.args, "cwd": self.cwd, "env": envs[0]}
        spec["ranks"] = [{k: v for k, v in env.items() if envs[0].get(k) != v} for env in envs]  # RANK & co.
        try:
            self.zygote.fork(spec, status_write, writes)
        finally:
            for fd in (status_write, *writes):
                os.close(fd)  # the ranks hold them now: their end is EOF for the readers
        status = _Status(status_read)
        if not status.grouped.wait(_START_S) or not status.group:
            raise RuntimeError(f"the zygote (pid {self.zygote.process.pid}) did not start the ranks")
        self.procs = [_ForkedRank(self.zygote, rank, status) for rank in range(self.count)]  # type: ignore[misc]
        for rank, (out, err) in enumerate(pipes):
            self.follow(rank, os.fdopen(out[0], "r", errors="replace"), os.fdopen(err[0], "r", errors="replace"))


# --------------------------------------------------------------------------------------------
# the zygote's side


def _serve(sock: socket.socket) -> int:
    """Import the modules, then fork each launch's ranks and report their exit codes, until the
    launcher closes the socket."""
    for name in json.loads(sock.recv(_MAX_SPEC_BYTES)):
        with contextlib.suppress(ImportError):  # the rank imports it again and says what is missing
            importlib.import_module(name)
    zygote = os.getpid()
    children: dict[int, tuple[int, int]] = {}  # pid -> (status fd, rank)
    pending: dict[int, int] = {}  # status fd -> ranks still running
    while True:
        ready, _, _ = select.select([sock], [], [], 0.05 if children else None)
        if ready:
            payload, fds, _, _ = socket.recv_fds(sock, _MAX_SPEC_BYTES, 4096)
            if not payload:
                return 0
            spec, status, pipes = json.loads(payload), fds[0], fds[1:]
            group = 0
            for rank in range(len(spec["ranks"])):
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    inherited = [sock.fileno(), status, *pending, *pipes]
                    _rank(spec, rank, pipes, inherited, group, zygote)  # never returns
                with contextlib.suppress(OSError):  # also here: no kill may find it outside
                    os.setpgid(pid, group or pid)
                group = group or pid
                children[pid] = (status, rank)
            _report(status, f"group {group}")
            for fd in pipes:
                os.close(fd)
            pending[status] = len(spec["ranks"])
        while children:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            status, rank = children.pop(pid)
            _report(status, f"{rank} {os.waitstatus_to_exitcode(wait_status)}")
            pending[status] -= 1
            if not pending[status]:
                del pending[status]
                os.close(status)


def _report(status: int, line: str) -> None:
    with contextlib.suppress(OSError):  # a launcher that stopped reading has its answer already
        os.write(status, f"{line}\n".encode())


def _rank(
    spec: dict[str, Any], rank: int, pipes: Sequence[int], inherited: Sequence[int], group: int, zygote: int
) -> None:
    """In the child: become the rank (group, streams, environment, directory, argv) and run its
    module; leave without returning to the zygote's loop. Only the descriptors the zygote
    holds for its launches are closed (an imported module may hold others)."""
    code = 1
    try:
        os.setpgid(0, group)  # 0: rank 0 leads the launch's group
        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != zygote:
            os._exit(137)  # the zygote died before the signal was armed
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(pipes[2 * rank], 1)
        os.dup2(pipes[2 * rank + 1], 2)
        for fd in {devnull, *inherited} - {0, 1, 2}:
            os.close(fd)
        os.environ.clear()
        os.environ.update({**spec["env"], **spec["ranks"][rank]})
        if spec["cwd"]:
            os.chdir(spec["cwd"])
            sys.path[0] = os.getcwd()  # where `python -m` looks first
        sys.argv = [spec["module"], *spec["args"]]
        import runpy

        runpy.run_module(spec["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


if __name__ == "__main__":
    sys.exit(_serve(socket.socket(fileno=int(sys.argv[1]))))
