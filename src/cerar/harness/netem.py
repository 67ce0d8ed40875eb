"""Slow-network emulation: one network namespace per rank (or per node), rate-limited links to a bridge.

Layout of one emulated network (``run_id`` = ``<launcher pid>-<4 random hex>``)::

    namespace cerar-<run_id>-hub :  bridge <tag>br, ports <tag>h0 .. <tag>h{N-1}
    namespace cerar-<run_id>-r<i>:  veth <tag>r<i> (10.99.x.y/16), peer of <tag>h<i>,
                                    egress shaped by ``tc tbf`` (and ``netem delay``)

With ``ranks_per_node=G`` (emulated nodes, ``cerar bench --nodes M --ranks-per-node G``) there is
one namespace per *node* instead, ``cerar-<run_id>-n<k>`` with veth ``<tag>n<k>``, holding its
``G`` ranks: they talk to each other over the node's own loopback (a local address is routed
through ``lo``: fast, unlimited), and the node's one shaped link to the bridge is shared by its
ranks, like a node's NIC.

Every link's TCP connections use :data:`CONGESTION_CONTROL` (cubic, Linux's default), set on the
link's route, whatever the machine's default is: with BBR (some machines' and clouds' default)
on a ``tbf``-shaped link, the ring's bursts of point-to-point messages, each waited for before
the next, stalled now and then for tens of milliseconds (the socket holding unsent data while
BBR's bandwidth estimate, taken from app-limited traffic, was far below the link's), which
Gloo's own collectives seldom met; ``docs/results.md`` has the measurement.

Every link is created directly inside its namespace, so nothing appears in the root namespace
and deleting the namespaces removes every link. ``tag`` (``cx`` + 7 hex) keeps interface names
within Linux's 15-character limit and unique to the run. Only addresses inside these namespaces
are used: traffic never leaves them.

Use :func:`emulated_network` (a context manager) to build and always tear down a network,
:func:`unavailable_reason` to ask whether this machine can do it at all, and :func:`leftovers` /
:func:`cleanup_stale` to find (or remove) what a killed run left behind;
:func:`cerar.harness.probe.measure_link_rate` measures a link's achieved TCP rate.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from cerar._checks import check_int

NS_PREFIX = "cerar-"
IF_PREFIX = "cx"
_IF_PATTERN = re.compile(r"^cx[0-9a-f]{7}(br|[hrn]\d+)$")
_NS_PATTERN = re.compile(r"^cerar-(\d+)-([0-9a-f]{4})-(hub|[rn]\d+)$")
_RATE_PATTERN = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$", re.I)
_DELAY_PATTERN = re.compile(r"^\d+(\.\d+)?(us|ms|s)$")
#: The TCP congestion control of every emulated link (see the module doc); if this kernel does
#: not offer it, the links keep the machine's default (:func:`congestion_control` says which).
CONGESTION_CONTROL = "cubic"
_AVAILABLE_CC = "/proc/sys/net/ipv4/tcp_available_congestion_control"
_DEFAULT_CC = "/proc/sys/net/ipv4/tcp_congestion_control"
MAX_RANKS = 250 * 200


class NetemUnavailable(RuntimeError):
    """This machine cannot emulate a slow network (not root, or ``ip``/``tc`` missing)."""


@dataclass(frozen=True)
class RankLink:
    """One rank's end of the emulated network (with emulated nodes: its node's namespace and link)."""

    rank: int
    namespace: str
    ifname: str
    address: str


@dataclass
class Network:
    """A built emulated network; valid inside :func:`emulated_network` only."""

    run_id: str
    hub: str
    bridge: str
    rate: str
    delay: str
    ranks: list[RankLink] = field(default_factory=list)
    ranks_per_node: int = 1
    congestion_control: str = CONGESTION_CONTROL  # its links' TCP (:func:`congestion_control`)

    @property
    def namespaces(self) -> list[str]:
        return [*dict.fromkeys(link.namespace for link in self.ranks), self.hub]

    @property
    def nodes(self) -> int:
        """Namespaces holding ranks (the ranks themselves unless ``ranks_per_node > 1``)."""
        return len(self.ranks) // self.ranks_per_node

    def exec_prefix(self, rank: int) -> list[str]:
        """The argv prefix that runs a command inside ``rank``'s namespace."""
        return ["ip", "netns", "exec", self.ranks[rank].namespace]


def congestion_control() -> str:
    """The TCP congestion control the emulated links use: :data:`CONGESTION_CONTROL` if this
    kernel offers it, else the machine's default (``"unknown"`` if neither can be read)."""
    try:
        with open(_AVAILABLE_CC) as available:
            if CONGESTION_CONTROL in available.read().split():
                return CONGESTION_CONTROL
        with open(_DEFAULT_CC) as default:
            return default.read().strip() or "unknown"
    except OSError:
        return "unknown"


def unavailable_reason() -> str | None:
    """Why the slow regime cannot run here, or ``None`` if it can (root, ``ip`` and ``tc``)."""
    if sys.platform != "linux":
        return f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, or use --regime fast)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"missing tool(s) {', '.join(missing)} (install iproute2)"
    return None


def check_rate(rate: str) -> str:
    """Return ``rate`` after checking it is a ``tc`` rate such as ``"400mbit"``."""
    match = _RATE_PATTERN.match(rate) if isinstance(rate, str) else None
    # A zero rate matches the pattern but stops every link (and divides by zero in the models).
    if match is None or float(rate[: match.start(2)]) <= 0:
        raise ValueError(f"Argument 'rate' must be a tc rate such as '400mbit' or '1gbit', not {rate!r}.")
    return rate


def check_delay(delay: str) -> str:
    """Return ``delay`` after checking it is a ``tc`` time such as ``"0ms"`` or ``"2ms"``."""
    if not isinstance(delay, str) or not _DELAY_PATTERN.match(delay):
        raise ValueError(f"Argument 'delay' must be a time such as '0ms' or '500us', not {delay!r}.")
    return delay


def rate_bytes_per_s(rate: str) -> float:
    """The nominal rate of a ``tc`` rate string in bytes per second (``"400mbit"`` -> 5e7)."""
    match = re.match(r"^(\d+(?:\.\d+)?)([a-z]+)$", check_rate(rate).lower())
    assert match is not None
    value, unit = float(match.group(1)), match.group(2)
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
    if unit.endswith("bps"):  # tc: bps = bytes per second
        return value * scale[unit[:-3]]
    return value * scale[unit[:-3]] / 8.0


def _delay_is_zero(delay: str) -> bool:
    return float(re.sub(r"[a-z]+$", "", delay)) == 0.0


def _run(argv: Sequence[str]) -> None:
    done = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        detail = done.stderr.strip() or done.stdout.strip()
        raise NetemUnavailable(f"command failed ({done.returncode}): {' '.join(argv)}: {detail}")


_SUBNET = "10.99.0.0/16"  # every link's address (_address) lies in it


def _address(rank: int) -> str:
    return f"10.99.{rank // 250}.{rank % 250 + 1}"


@contextlib.contextmanager
def emulated_network(
    world_size: int, rate: str = "400mbit", delay: str = "0ms", ranks_per_node: int = 1
) -> Iterator[Network]:
    """Build a network of ``world_size`` ranks and tear it down on exit, always.

    1. Namespaces left by dead launchers (see :func:`cleanup_stale`) are removed first.
    2. The hub namespace and its bridge are made.
    3. ``ranks_per_node == 1``: one namespace per rank; otherwise one per node of
       ``ranks_per_node`` consecutive ranks (``world_size / ranks_per_node`` nodes), whose ranks
       share its loopback and its one link.

    Each namespace's egress is limited by ``tc tbf rate <rate> burst 256kb latency 100ms``; a
    non-zero ``delay`` adds ``netem delay`` in front (needs the kernel's sch_netem); its route
    sets the TCP congestion control (:func:`congestion_control`). On exit,
    normal or not, every process still inside the namespaces is killed and the namespaces (and
    with them every link) are deleted.

    Raises:
        NetemUnavailable: not root, ``ip``/``tc`` missing, or a setup command failed.
    """
    world_size = check_int("world_size", world_size, minimum=1)
    if world_size > MAX_RANKS:
        raise ValueError(f"Argument 'world_size' must be at most {MAX_RANKS}, not {world_size}.")
    ranks_per_node = check_int("ranks_per_node", ranks_per_node, minimum=1)
    if world_size % ranks_per_node:
        raise ValueError(f"Argument 'ranks_per_node' must divide world_size {world_size}, not {ranks_per_node}.")
    rate, delay = check_rate(rate), check_delay(delay)
    reason = unavailable_reason()
    if reason is not None:
        raise NetemUnavailable(f"cannot emulate a slow network: {reason}")
    cleanup_stale()  # what SIGKILLed launchers left behind (their ranks died with them)
    rand = secrets.token_hex(2)
    run_id = f"{os.getpid()}-{rand}"
    tag = f"{IF_PREFIX}{rand}{os.getpid() % 4096:03x}"
    net = Network(
        run_id, f"{NS_PREFIX}{run_id}-hub", f"{tag}br", rate, delay, ranks_per_node=ranks_per_node,
        congestion_control=congestion_control(),
    )  # fmt: skip
    created: list[str] = []
    try:
        created.append(net.hub)  # listed first: deleting a name that was never made is harmless
        _run(["ip", "netns", "add", net.hub])
        _run(["ip", "-n", net.hub, "link", "add", net.bridge, "type", "bridge"])
        _run(["ip", "-n", net.hub, "link", "set", net.bridge, "up"])
        kind = "r" if ranks_per_node == 1 else "n"  # a namespace per rank, or per node
        for index in range(world_size // ranks_per_node):
            link = RankLink(index, f"{NS_PREFIX}{run_id}-{kind}{index}", f"{tag}{kind}{index}", _address(index))
            created.append(link.namespace)
            _add_rank(net, link, f"{tag}h{index}")
            net.ranks += [
                RankLink(rank, link.namespace, link.ifname, link.address)
                for rank in range(index * ranks_per_node, (index + 1) * ranks_per_node)
            ]
        yield net
    finally:
        # Teardown must not be cut short by a second Ctrl-C: hold the signals until it is done.
        with _signals_blocked():
            _teardown(created)


def _add_rank(net: Network, link: RankLink, hub_side: str) -> None:
    """Create ``link``'s namespace and its veth pair to the hub's bridge, address it, shape it."""
    _run(["ip", "netns", "add", link.namespace])
    veth = ["type", "veth", "peer", "name", link.ifname, "netns", link.namespace]
    _run(["ip", "link", "add", hub_side, "netns", net.hub, *veth])
    _run(["ip", "-n", net.hub, "link", "set", hub_side, "master", net.bridge, "up"])
    # Gloo takes an interface's first address: keep IPv6 link-local ones off the link.
    _run(["ip", "netns", "exec", link.namespace, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"])
    _run(["ip", "-n", link.namespace, "addr", "add", f"{link.address}/16", "dev", link.ifname])
    _run(["ip", "-n", link.namespace, "link", "set", link.ifname, "up"])
    _run(["ip", "-n", link.namespace, "link", "set", "lo", "up"])
    _shape(link, net.rate, net.delay)
    if net.congestion_control == CONGESTION_CONTROL:  # the link's route: every connection over it
        route = ["route", "replace", _SUBNET, "dev", link.ifname, "proto", "kernel", "scope", "link"]
        _run(["ip", "-n", link.namespace, *route, "src", link.address, "congctl", CONGESTION_CONTROL])


def _shape(link: RankLink, rate: str, delay: str) -> None:
    tbf = ["tbf", "rate", rate, "burst", "256kb", "latency", "100ms"]
    tc = ["tc", "-n", link.namespace, "qdisc", "add", "dev", link.ifname]
    if _delay_is_zero(delay):
        _run([*tc, "root", *tbf])
        return
    try:
        _run([*tc, "root", "handle", "1:", "netem", "delay", delay])
    except NetemUnavailable as exc:
        raise NetemUnavailable(
            f"cannot add delay {delay!r}: the kernel has no netem qdisc (sch_netem); use delay '0ms' ({exc})"
        ) from exc
    _run([*tc, "parent", "1:", "handle", "10:", *tbf])


@contextlib.contextmanager
def _signals_blocked() -> Iterator[None]:
    blocked = {signal.SIGINT, signal.SIGTERM}
    try:
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    except (AttributeError, ValueError, OSError):  # pragma: no cover - non-POSIX
        yield
        return
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def namespace_pids(namespace: str) -> list[int]:
    """Processes living in ``namespace`` (empty if it does not exist)."""
    done = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, check=False)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


def _teardown(namespaces: Sequence[str]) -> None:
    """Kill every process inside ``namespaces``, then delete them (links go with them)."""
    for namespace in namespaces:
        for _ in range(50):  # a dying process may still be listed for a moment
            pids = namespace_pids(namespace)
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
    for namespace in reversed(namespaces):
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)


def leftovers(run_id: str | None = None) -> dict[str, list[str]]:
    """What cerar networks left on this machine: namespaces, root-namespace links, processes.

    With ``run_id`` only that run's namespaces count (other runs may be alive in parallel).
    ``processes`` lists ``"<namespace>:<pid>"`` for processes inside those namespaces.
    """
    if shutil.which("ip") is None:
        return {"namespaces": [], "links": [], "processes": []}
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    names = [line.split()[0] for line in listed.splitlines() if line.strip()]
    prefix = f"{NS_PREFIX}{run_id}-" if run_id is not None else NS_PREFIX
    namespaces = [n for n in names if n.startswith(prefix)]
    links_out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=False).stdout
    links = []
    for line in links_out.splitlines():
        parts = line.split(":")
        if len(parts) > 1:
            name = parts[1].strip().split("@")[0]
            if _IF_PATTERN.match(name):
                links.append(name)
    processes = [f"{n}:{pid}" for n in namespaces for pid in namespace_pids(n)]
    return {"namespaces": namespaces, "links": links, "processes": processes}


def cleanup_stale() -> list[str]:
    """Delete cerar namespaces whose launcher process is dead (left by a SIGKILLed run).

    Returns the namespaces removed. Namespaces of live launchers are left alone.
    """
    stale: list[str] = []
    for namespace in leftovers()["namespaces"]:
        match = _NS_PATTERN.match(namespace)
        if match is None:
            continue
        pid = int(match.group(1))
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            stale.append(namespace)
        except PermissionError:
            continue
    _teardown(stale)
    return stale


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
