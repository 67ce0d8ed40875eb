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

Emulated nodes: with ``ranks_per_node=G`` the ranks ``k*G .. k*G + G - 1`` form node ``k`` (torchrun's
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK`` say so); in ``slow`` each node is one namespace
holding its ``G`` ranks, which talk over its loopback, and its one link is shaped to ``rate``.

Launchers: ``direct`` (the default) starts every rank itself, with the environment above;
``torchrun`` starts only one ``torchrun --nnodes M --nproc-per-node G`` agent per node (in the
node's namespace in ``slow``), with a c10d rendezvous at node 0 (or ``rdzv="static"``), and
torchrun starts the ranks, as on a real cluster (:mod:`cerar.harness.torchrun`). Its start-up
costs each node one more Python process with torch (the agent) and the rendezvous, several
seconds of CPU each (``docs/results.md``). The ranks' work is the same either way (once they
run, torchrun only watches them), so ``direct`` stays the default: it starts sooner and keeps
each rank's output apart. With ``preload`` (``fast`` only), ``direct`` forks the ranks from one
process that imported those modules once, instead of starting an interpreter per rank
(:mod:`cerar.harness.forked`), as ``cerar train`` and ``cerar study --gradients`` do on
loopback: importing their model costs each rank about 6 s of CPU.

Why 400 Mbit/s by default: the link must dominate the built-in all-reduce, or the slow regime
says nothing about slow links: at 400 Mbit/s Gloo's all-reduce of 16 MiB takes its wire time
(``x wire`` near 1 in ``cerar bench``'s table), while much faster links bring the CPU back into
play on a machine with few cores (the coded methods' arithmetic becomes comparable to the wire
time); slower ones only lengthen the run.

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
import secrets
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from cerar._checks import check_choice, check_float, check_int
from cerar.harness.forked import ForkedRanks, Zygote, module_command
from cerar.harness.netem import (
    NetemUnavailable,
    Network,
    check_delay,
    check_rate,
    emulated_network,
    free_loopback_port,
)
from cerar.harness.probe import measure_link_rate
from cerar.harness.processes import (
    LaunchError,
    LineCallback,
    RankProcesses,
    RankResult,
    base_environment,
    describe_returncode,
)
from cerar.harness.torchrun import RENDEZVOUS, NodeProcesses

REGIMES = ("fast", "slow")
LAUNCHERS = ("direct", "torchrun")
DEFAULT_RATE = "400mbit"
SLOW_MASTER_PORT = 29500  # inside the run's own namespaces, so it can never collide
_PORT_ATTEMPTS = 3

__all__ = [
    "DEFAULT_RATE",
    "LAUNCHERS",
    "REGIMES",
    "RENDEZVOUS",
    "LaunchError",
    "LaunchResult",
    "LineCallback",
    "NetemUnavailable",
    "RankResult",
    "describe_returncode",
    "launch",
]


@dataclass
class LaunchResult:
    """What :func:`launch` returns when every rank exited with 0.

    Attributes:
        ranks: per-rank results, index = rank; with the ``torchrun`` launcher one per node
            (index = node, its output the lines of the node's ranks).
        link_rate_bytes_per_s: achieved TCP payload rate between two rank namespaces, measured
            before the ranks started (``None`` in ``fast`` or without the probe).
        regime: ``"fast"`` or ``"slow"``.
        rate: the ``tc`` rate limit in ``slow`` (``None`` in ``fast``).
        delay: the added one-way delay in ``slow`` (``None`` in ``fast``).
        congestion_control: the emulated links' TCP congestion control in ``slow``
            (:attr:`cerar.harness.netem.Network.congestion_control`; ``None`` in ``fast``).
        ranks_per_node: ranks on each (emulated) node; ``1``: a namespace per rank.
        run_id: the emulated network's id (``None`` in ``fast``); namespaces are
            ``cerar-<run_id>-*``.
        wall_s: seconds from the ranks' start to the last rank's exit.
        launcher: ``"direct"`` or ``"torchrun"``.
    """

    ranks: list[RankResult]
    link_rate_bytes_per_s: float | None
    regime: str
    rate: str | None = None
    delay: str | None = None
    congestion_control: str | None = None
    run_id: str | None = None
    wall_s: float = 0.0
    ranks_per_node: int = 1
    launcher: str = "direct"


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
    ranks_per_node: int = 1,
    launcher: str = "direct",
    rdzv: str = "c10d",
    preload: Sequence[str] | Zygote = (),
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
        ranks_per_node: ranks per emulated node (must divide ``world_size``); in ``slow`` each
            node is one namespace with one shaped link, and the probe runs between two nodes.
        launcher: ``"direct"`` (start every rank) or ``"torchrun"`` (start one torchrun agent
            per node, which starts the node's ranks; see :mod:`cerar.harness.torchrun`). With
            ``torchrun``, ``on_line`` and the results name nodes, not ranks.
        rdzv: ``torchrun``: ``"c10d"`` (node 0 hosts the store) or ``"static"``
            (``--node-rank``, ``--master-addr``).
        preload: modules to import once and fork every rank from (``fast``, ``direct``, a
            ``python -m`` command; see :mod:`cerar.harness.forked`), e.g. the ones a training
            rank spends its start-up importing, or a :class:`~cerar.harness.forked.Zygote`
            that imported them for several launches. Empty: every rank starts an interpreter.

    Raises:
        LaunchError: a rank (with ``torchrun``: a node's agent) failed, or the timeout passed.
        NetemUnavailable: ``slow`` on a machine without root, ``ip`` or ``tc``.
        ValueError, TypeError: bad arguments.
    """
    argv = _check_command(command)
    world_size = check_int("world_size", world_size, minimum=1)
    regime = check_choice("regime", regime, REGIMES)
    rate, delay = check_rate(rate), check_delay(delay)
    timeout_s = check_float("timeout_s", timeout_s, positive=True)
    ranks_per_node = check_int("ranks_per_node", ranks_per_node, minimum=1)
    if world_size % ranks_per_node:
        raise ValueError(f"Argument 'ranks_per_node' must divide world_size {world_size}, not {ranks_per_node}.")
    launcher = check_choice("launcher", launcher, LAUNCHERS)
    rdzv = check_choice("rdzv", rdzv, RENDEZVOUS)
    cwd, env = _check_cwd(cwd), _check_env(env)
    base_env = base_environment(env)
    preload = _check_preload(preload, argv, regime, launcher)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_sigterm_exits())
        net: Network | None = None
        link_rate: float | None = None
        if regime == "slow":
            net = stack.enter_context(emulated_network(world_size, rate, delay, ranks_per_node))
            if probe and net.nodes >= 2:
                link_rate = measure_link_rate(net, dst=ranks_per_node)  # rank 0's node to the next node

        zygote = preload if isinstance(preload, Zygote) else None
        if preload and zygote is None:
            zygote = stack.enter_context(Zygote(preload, cwd=cwd, env=env))
        log_dir = ""
        if launcher == "torchrun":  # the agents' logs and error files, not /tmp/torchelastic_*
            log_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="cerar-torchrun-"))

        def new_ranks() -> RankProcesses:
            if zygote is not None:
                return ForkedRanks(argv, world_size, base_env, cwd, net, on_line, ranks_per_node, zygote=zygote)
            if launcher == "direct":
                return RankProcesses(argv, world_size, base_env, cwd, net, on_line, ranks_per_node)
            run_id = net.run_id if net else f"{os.getpid()}-{secrets.token_hex(2)}"
            return NodeProcesses(argv, world_size, base_env, cwd, net, on_line, ranks_per_node, rdzv, run_id, log_dir)

        results, wall_s = _run(stack, new_ranks, timeout_s)
        return LaunchResult(
            ranks=results,
            link_rate_bytes_per_s=link_rate,
            regime=regime,
            rate=rate if net else None,
            delay=delay if net else None,
            congestion_control=net.congestion_control if net else None,
            run_id=net.run_id if net else None,
            wall_s=wall_s,
            ranks_per_node=ranks_per_node,
            launcher=launcher,
        )
    raise AssertionError("unreachable")  # pragma: no cover - ExitStack does not swallow


def _run(
    stack: contextlib.ExitStack, new_ranks: Callable[[], RankProcesses], timeout_s: float
) -> tuple[list[RankResult], float]:
    """Start the ranks and wait for them, on a new port if another program took the first.

    On loopback another program may take the free port between our probe and rank 0's bind:
    the ranks then never got past start-up, and a fresh set on a new port is started.
    Returns every rank's result and the ranks' wall time.
    """
    for attempt in range(_PORT_ATTEMPTS):
        ranks = new_ranks()
        stack.callback(ranks.stop)  # registered before any start; runs before the network's teardown
        ranks.start(SLOW_MASTER_PORT if ranks.net else free_loopback_port())
        try:
            results = ranks.wait(timeout_s)
            return results, ranks.wall_s
        except LaunchError as exc:
            if ranks.net is not None or attempt + 1 == _PORT_ATTEMPTS or not _port_taken(exc):
                raise
    raise AssertionError("unreachable")  # pragma: no cover - the last attempt raises or returns


def _port_taken(exc: LaunchError) -> bool:
    return any("address already in use" in r.stderr.lower() for r in exc.results)


def _check_command(command: Sequence[str]) -> list[str]:
    if isinstance(command, (str, bytes)) or not isinstance(command, Sequence):
        raise TypeError(f"Argument 'command' must be a sequence of strings (argv), not {command!r}.")
    argv = list(command)
    if not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"Argument 'command' must be a non-empty list of strings, not {command!r}.")
    return argv


def _check_preload(
    preload: Sequence[str] | Zygote, argv: list[str], regime: str, launcher: str
) -> Sequence[str] | Zygote:
    names = isinstance(preload, Sequence) and not isinstance(preload, (str, bytes))
    if not isinstance(preload, Zygote) and not (names and all(isinstance(m, str) and m for m in preload)):
        raise TypeError(f"Argument 'preload' must be a sequence of module names or a Zygote, not {preload!r}.")
    if preload and (regime != "fast" or launcher != "direct"):
        raise ValueError(
            f"Argument 'preload' needs regime 'fast' and launcher 'direct', not {regime!r} and {launcher!r}."
        )
    if preload:
        module_command(argv)  # raises for anything but `python -m MODULE`
    return preload if isinstance(preload, Zygote) else list(preload)


def _check_cwd(cwd: str | None) -> str | None:
    if cwd is not None and not os.path.isdir(cwd):
        raise ValueError(f"Argument 'cwd' must be an existing directory, not {cwd!r}.")
    return cwd


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


class _Echo:
    """Forwards ranks' lines as ``[RANK] LINE``, each in one write under a lock: the reader
    threads of different ranks never interleave within a line (``print`` writes the text and
    the newline separately, which let two ranks' lines run together)."""

    def __init__(self, stdout: TextIO, stderr: TextIO) -> None:
        self._streams = {"stdout": stdout, "stderr": stderr}
        self._lock = threading.Lock()

    def __call__(self, rank: int, stream: str, line: str) -> None:
        out = self._streams.get(stream, self._streams["stderr"])
        with self._lock:
            out.write(f"[{rank}] {line}\n")
            out.flush()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m cerar.harness.launch [--world-size N] [--regime R] -- CMD ...``: a small torchrun."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m cerar.harness.launch")
    parser.add_argument("--world-size", "-N", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=1)
    parser.add_argument("--regime", default="fast", choices=REGIMES)
    parser.add_argument("--rate", default=DEFAULT_RATE)
    parser.add_argument("--delay", default="0ms")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--launcher", default="direct", choices=LAUNCHERS)
    parser.add_argument("--rdzv", default="c10d", choices=RENDEZVOUS)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        result = launch(
            command,
            args.world_size,
            regime=args.regime,
            rate=args.rate,
            delay=args.delay,
            timeout_s=args.timeout,
            on_line=_Echo(sys.stdout, sys.stderr),
            ranks_per_node=args.ranks_per_node,
            launcher=args.launcher,
            rdzv=args.rdzv,
        )
    except LaunchError as exc:
        print(f"launch failed: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    if result.link_rate_bytes_per_s is not None:
        print(f"link rate {result.link_rate_bytes_per_s / 1e6:.1f} MB/s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
