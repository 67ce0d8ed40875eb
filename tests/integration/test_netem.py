"""cerar.harness.netem: argument checks everywhere; namespace set-up and teardown where root, ip, tc exist."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from processes import alive

from cerar.harness import netem, probe

needs_netns = pytest.mark.skipif(netem.unavailable_reason() is not None, reason=str(netem.unavailable_reason()))


@pytest.mark.parametrize(
    ("rate", "expected"),
    [("400mbit", 50e6), ("1gbit", 125e6), ("8kbit", 1e3), ("2mbps", 2e6), ("100bit", 12.5)],
)
def test_rate_bytes_per_s(rate: str, expected: float) -> None:
    assert netem.rate_bytes_per_s(rate) == pytest.approx(expected)


@pytest.mark.parametrize("rate", ["fast", "400", "400 mbit", "-1mbit", ""])
def test_bad_rate_names_argument(rate: str) -> None:
    with pytest.raises(ValueError, match="Argument 'rate'"):
        netem.check_rate(rate)


def test_bad_rate_type() -> None:
    with pytest.raises(ValueError, match=r"Argument 'rate'.*400"):
        netem.check_rate(400)  # type: ignore[arg-type]


@pytest.mark.parametrize("delay", ["1", "ms", "1 h", "-2ms"])
def test_bad_delay_names_argument(delay: str) -> None:
    with pytest.raises(ValueError, match="Argument 'delay'"):
        netem.check_delay(delay)


def test_bad_world_size() -> None:
    with pytest.raises(ValueError, match="Argument 'world_size' must be at least 1, not 0"):
        with netem.emulated_network(0):
            pass
    with pytest.raises(TypeError, match="Argument 'world_size'"):
        with netem.emulated_network(2.0):  # type: ignore[arg-type]
            pass


def test_unavailable_reason_matches_the_machine() -> None:
    # None exactly when this machine can build namespaces; otherwise the reason names the cause.
    reason = netem.unavailable_reason()
    if sys.platform != "linux":
        assert reason is not None and "Linux" in reason
    elif os.geteuid() != 0:
        assert reason is not None and "root" in reason
    elif shutil.which("ip") is None or shutil.which("tc") is None:
        assert reason is not None and "iproute2" in reason
    else:
        assert reason is None


@pytest.mark.skipif(sys.platform != "linux", reason="the later checks need Linux")
def test_unavailable_reason_names_each_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert netem.unavailable_reason() == "network namespaces need root (run as root, or use --regime fast)"
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "tc" else f"/usr/sbin/{tool}")
    assert netem.unavailable_reason() == "missing tool(s) tc (install iproute2)"
    monkeypatch.setattr(shutil, "which", lambda tool: f"/usr/sbin/{tool}")
    assert netem.unavailable_reason() is None


@pytest.mark.netns
@needs_netns
def test_network_built_and_removed() -> None:
    with netem.emulated_network(3, rate="100mbit") as net:
        found = netem.leftovers(net.run_id)
        assert sorted(found["namespaces"]) == sorted(net.namespaces)
        assert found["links"] == []  # every link lives inside the run's namespaces
        assert [link.address for link in net.ranks] == ["10.99.0.1", "10.99.0.2", "10.99.0.3"]
        assert all(len(link.ifname) <= 15 for link in net.ranks) and len(net.bridge) <= 15
        shown = subprocess.run(
            ["tc", "-n", net.ranks[1].namespace, "qdisc", "show", "dev", net.ranks[1].ifname],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "tbf" in shown and "100Mbit" in shown
        sleeper = subprocess.Popen([*net.exec_prefix(2), "sleep", "60"])
        rate = probe.measure_link_rate(net, seconds=0.2)
        assert rate > 0
    assert netem.leftovers(net.run_id) == {"namespaces": [], "links": [], "processes": []}
    sleeper.wait(timeout=10)  # teardown killed it
    assert sleeper.returncode == -9


@pytest.mark.netns
@needs_netns
def test_network_removed_after_exception() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with netem.emulated_network(2) as net:
            raise RuntimeError("boom")
    assert netem.leftovers(net.run_id)["namespaces"] == []


@pytest.mark.netns
@needs_netns
def test_two_networks_do_not_collide() -> None:
    with netem.emulated_network(2) as a, netem.emulated_network(2) as b:
        assert a.run_id != b.run_id and a.bridge != b.bridge
        assert not set(a.namespaces) & set(b.namespaces)
    assert netem.leftovers(a.run_id)["namespaces"] == netem.leftovers(b.run_id)["namespaces"] == []


@pytest.mark.netns
@needs_netns
def test_failed_setup_cleans_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # The set-up fails for certain half-way, on the third rank's link: the hub and the first
    # ranks' namespaces exist by then, and must all be gone afterwards.
    before = set(netem.leftovers(str(os.getpid()))["namespaces"])
    real_shape = netem._shape
    built: list[str] = []

    def shape(link: netem.RankLink, rate: str, delay: str) -> None:
        built.extend(n for n in netem.leftovers(str(os.getpid()))["namespaces"] if n not in before)
        if link.rank == 2:
            raise netem.NetemUnavailable("command failed (2): tc ...: injected by the test")
        real_shape(link, rate, delay)

    monkeypatch.setattr(netem, "_shape", shape)
    with pytest.raises(netem.NetemUnavailable, match="injected by the test"):
        with netem.emulated_network(4):
            pytest.fail("the set-up must not succeed")
    assert {n.rsplit("-", 1)[1] for n in built} >= {"hub", "r0", "r1", "r2"}  # it did fail half-way
    assert set(netem.leftovers(str(os.getpid()))["namespaces"]) == before


@pytest.mark.netns
@needs_netns
def test_delay_builds_or_fails_cleanly() -> None:
    # A delay needs the kernel's netem qdisc: with it the set-up succeeds, without it fails
    # with a message that says so. Either way nothing may be left behind.
    before = set(netem.leftovers(str(os.getpid()))["namespaces"])
    try:
        with netem.emulated_network(2, delay="1ms") as net:
            assert len(netem.leftovers(net.run_id)["namespaces"]) == 3
    except netem.NetemUnavailable as exc:
        assert "no netem qdisc (sch_netem)" in str(exc)
    assert set(netem.leftovers(str(os.getpid()))["namespaces"]) == before


@pytest.mark.netns
@needs_netns
def test_cleanup_stale_removes_dead_runs_only() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    if alive(dead.pid):  # pid reused already: nothing to test with this pid
        pytest.skip("pid reused")
    stale = f"cerar-{dead.pid}-abcd-hub"
    live = f"cerar-{os.getpid()}-abcd-hub"  # this test process is alive: must be kept
    for name in (stale, live):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        removed = netem.cleanup_stale()
        assert stale in removed and live not in removed
        names = netem.leftovers()["namespaces"]
        assert stale not in names and live in names
        # building a network removes stale namespaces first
        subprocess.run(["ip", "netns", "add", stale], check=True)
        with netem.emulated_network(2):
            assert stale not in netem.leftovers()["namespaces"]
    finally:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


_CONNECT_AND_REPORT = """
import socket, sys, time
host, port = sys.argv[1], int(sys.argv[2])
for _ in range(100):
    try:
        conn = socket.create_connection((host, port), timeout=5)
        break
    except OSError:
        time.sleep(0.05)
print(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\\0").decode())
"""
_ACCEPT_ONE = """
import socket, sys
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
server.settimeout(10)
server.accept()[0].close()
"""


@pytest.mark.netns
@needs_netns
@pytest.mark.skipif(netem.congestion_control() != netem.CONGESTION_CONTROL, reason="kernel lacks cubic")
def test_links_use_the_chosen_congestion_control() -> None:
    # A connection between two rank namespaces gets the link's congestion control, whatever the
    # machine's default is (BBR stalled the ring's bursts on shaped links: netem's module doc).
    with netem.emulated_network(2) as net:
        address, port = net.ranks[1].address, "5301"
        server = subprocess.Popen([*net.exec_prefix(1), sys.executable, "-c", _ACCEPT_ONE, address, port])
        try:
            client = subprocess.run(
                [*net.exec_prefix(0), sys.executable, "-c", _CONNECT_AND_REPORT, address, port],
                capture_output=True,
                text=True,
                timeout=30,
            )
        finally:
            server.wait(timeout=30)
    assert client.returncode == 0, client.stderr
    assert client.stdout.strip() == netem.CONGESTION_CONTROL
