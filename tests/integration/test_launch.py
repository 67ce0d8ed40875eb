"""cerar.harness.launch: argument checks, fast and slow runs, and cleanup on every exit path.

Rank scripts here are plain Python (no torch) except one Gloo all-reduce per regime, so the
file stays fast. Multi-process tests carry their own timeouts: a regression fails, never hangs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from processes import alive

from cerar.harness import netem
from cerar.harness.forked import Zygote
from cerar.harness.launch import LaunchError, launch

needs_netns = pytest.mark.skipif(netem.unavailable_reason() is not None, reason=str(netem.unavailable_reason()))

GLOO = textwrap.dedent(
    """
    import os, torch, torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    t = torch.full((8,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    print("sum", int(t[0].item()), os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"], flush=True)
    dist.destroy_process_group()
    """
)

# Writes its pid (and the run id in slow) to DIR/pid-RANK, then: rank FAIL_RANK exits with
# FAIL_CODE (or kills itself with SIGKILL if FAIL_CODE is "kill"), the others sleep.
SLEEPER = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    d, fail_rank, fail_code = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    rank = int(os.environ["RANK"])
    child = subprocess.Popen(["sleep", "120"])  # a grandchild: must die with the rank
    path = os.path.join(d, f"pid-{rank}")
    with open(path + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {child.pid} {os.environ.get('CERAR_RUN_ID', '')}")
    os.replace(path + ".tmp", path)
    print(f"rank {rank} started", flush=True)
    if rank == fail_rank:
        time.sleep(0.5)
        print(f"rank {rank} failing on purpose", file=sys.stderr, flush=True)
        if fail_code == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        sys.exit(int(fail_code))
    time.sleep(120)
    """
)


def _pids(d: Path, world_size: int, timeout: float = 60.0) -> list[tuple[int, int, str]]:
    """(rank pid, grandchild pid, run id) per rank, once every rank has written them."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        files = [d / f"pid-{r}" for r in range(world_size)]
        if all(f.exists() for f in files):
            out = []
            for f in files:
                fields = f.read_text().split()
                out.append((int(fields[0]), int(fields[1]), fields[2] if len(fields) > 2 else ""))
            return out
        time.sleep(0.05)
    raise AssertionError("ranks did not start in time")


def _assert_gone(pids: list[tuple[int, int, str]], run_id: str | None = None) -> None:
    end = time.monotonic() + 10
    while time.monotonic() < end and any(alive(p) for rank in pids for p in rank[:2]):
        time.sleep(0.05)
    assert not [p for rank in pids for p in rank[:2] if alive(p)]
    if run_id:
        assert netem.leftovers(run_id) == {"namespaces": [], "links": [], "processes": []}


def _sleeper(tmp_path: Path) -> Path:
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    return script


def _sleepers(tmp_path: Path, args: list[str], start: str) -> tuple[list[str], dict]:
    """The sleeper's argv and launch's keywords: each rank its own interpreter (``exec``), or
    forked from one that imported ``json`` (``fork``, ``preload``: a ``-m`` module)."""
    _sleeper(tmp_path)
    if start == "fork":
        return [sys.executable, "-m", "sleeper", *args], {"cwd": str(tmp_path), "preload": ["json"]}
    return [sys.executable, str(tmp_path / "sleeper.py"), *args], {}


# --------------------------------------------------------------------------------------------
# argument checks


def test_command_must_be_argv() -> None:
    with pytest.raises(TypeError, match="Argument 'command'"):
        launch("python -c pass", 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Argument 'command'"):
        launch([], 2)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"world_size": 0}, ValueError, "Argument 'world_size' must be at least 1, not 0"),
        ({"world_size": 1.5}, TypeError, "Argument 'world_size' must be an integer, not 1.5"),
        ({"regime": "medium"}, ValueError, "Argument 'regime' must be one of 'fast', 'slow', not 'medium'"),
        ({"rate": "quick"}, ValueError, "Argument 'rate'"),
        ({"delay": "soon"}, ValueError, "Argument 'delay'"),
        ({"timeout_s": 0}, ValueError, "Argument 'timeout_s' must be positive, not 0.0"),
        ({"env": {"A": 1}}, TypeError, "Argument 'env'"),
        ({"cwd": "/no/such/dir"}, ValueError, "Argument 'cwd'"),
        ({"preload": "json"}, TypeError, "Argument 'preload' must be a sequence of module names"),
        ({"preload": ["json"]}, ValueError, r"'command' must be \[sys.executable, '-m', MODULE, ...\] with preload"),
        ({"preload": ["json"], "regime": "slow"}, ValueError, "Argument 'preload' needs regime 'fast'"),
        ({"preload": ["json"], "launcher": "torchrun"}, ValueError, "Argument 'preload' needs .* launcher 'direct'"),
    ],
)
def test_bad_arguments(kwargs: dict, error: type, message: str) -> None:
    args = {"world_size": 2, **kwargs}
    world_size = args.pop("world_size")
    with pytest.raises(error, match=message):
        launch([sys.executable, "-c", "pass"], world_size, **args)


# --------------------------------------------------------------------------------------------
# fast (loopback)


@pytest.mark.multirank
def test_fast_gloo_all_reduce(tmp_path: Path) -> None:
    lines: list[tuple[int, str, str]] = []
    result = launch(
        [sys.executable, "-c", GLOO],
        2,
        timeout_s=120,
        on_line=lambda rank, stream, line: lines.append((rank, stream, line)),
    )
    assert result.regime == "fast" and result.link_rate_bytes_per_s is None and result.run_id is None
    assert [r.rank for r in result.ranks] == [0, 1]
    assert all(r.returncode == 0 for r in result.ranks)
    assert [r.stdout.split() for r in result.ranks] == [["sum", "3", "0", "2"], ["sum", "3", "1", "2"]]
    assert (0, "stdout", "sum 3 0 2") in lines and (1, "stdout", "sum 3 1 2") in lines


@pytest.mark.multirank
def test_env_and_cwd_reach_ranks(tmp_path: Path) -> None:
    env = "os.environ['CERAR_X'], os.environ['OMP_NUM_THREADS'], os.environ['RANK']"
    code = f"import os; print(os.getcwd(), {env})"
    result = launch([sys.executable, "-c", code], 2, env={"CERAR_X": "yes"}, cwd=str(tmp_path), timeout_s=60)
    assert [r.stdout.split() for r in result.ranks] == [
        [str(tmp_path), "yes", "1", "0"],
        [str(tmp_path), "yes", "1", "1"],
    ]


@pytest.mark.multirank
def test_preload_imports_once_and_forks_each_rank(tmp_path: Path) -> None:
    (tmp_path / "heavy.py").write_text("import os\nIMPORTED_BY = os.getpid()\n")
    (tmp_path / "ranker.py").write_text(
        "import os, sys, heavy\n"
        "print(os.environ['RANK'], heavy.IMPORTED_BY, os.getpid(), os.getcwd(), os.environ['CERAR_X'], *sys.argv[1:])\n"
        "print('to stderr', os.environ['RANK'], file=sys.stderr)\n"
        "sys.exit(0 if __name__ == '__main__' else 5)\n"
    )
    command = [sys.executable, "-m", "ranker", "--flag", "x y"]
    result = launch(command, 3, cwd=str(tmp_path), env={"CERAR_X": "yes"}, preload=["heavy"], timeout_s=60)
    fields = [r.stdout.split() for r in result.ranks]
    assert [f[0] for f in fields] == ["0", "1", "2"] and all(r.returncode == 0 for r in result.ranks)
    imported_by, pids = {f[1] for f in fields}, {f[2] for f in fields}
    assert len(imported_by) == 1 and len(pids) == 3 and not imported_by & pids  # one import, three ranks
    assert all(f[3:] == [str(tmp_path), "yes", "--flag", "x", "y"] for f in fields)
    assert [r.stderr for r in result.ranks] == [f"to stderr {rank}\n" for rank in range(3)]


@pytest.mark.multirank
def test_one_zygote_serves_several_launches_even_after_one_fails(tmp_path: Path) -> None:
    (tmp_path / "heavy.py").write_text("import os\nIMPORTED_BY = os.getpid()\n")
    (tmp_path / "ranker.py").write_text(
        "import os, sys, heavy\nprint(heavy.IMPORTED_BY)\nsys.exit(int(sys.argv[1]) * int(os.environ['RANK']))\n"
    )
    _sleeper(tmp_path)
    with Zygote(["heavy"], cwd=str(tmp_path)) as zygote:
        first = launch([sys.executable, "-m", "ranker", "0"], 2, preload=zygote, timeout_s=60)
        with pytest.raises(LaunchError) as info:
            launch([sys.executable, "-m", "ranker", "3"], 2, preload=zygote, timeout_s=60)
        assert info.value.failed == [1] and info.value.results[1].returncode == 3
        with pytest.raises(LaunchError) as info:  # a timeout stops this launch's ranks, not the zygote
            launch([sys.executable, "-m", "sleeper", str(tmp_path), "-1", "0"], 2, preload=zygote, timeout_s=3)
        assert info.value.timed_out
        _assert_gone(_pids(tmp_path, 2, timeout=1))
        again = launch([sys.executable, "-m", "ranker", "0"], 2, preload=zygote, timeout_s=60)
        assert zygote.process.poll() is None
    assert zygote.process.poll() is not None  # closed with the block
    imported_by = {r.stdout.split()[0] for result in (first, again) for r in result.ranks}
    assert imported_by == {str(zygote.process.pid)}  # the orphan guard execs the zygote: one pid


@pytest.mark.multirank
def test_a_preload_that_fails_to_import_leaves_the_rank_to_say_so(tmp_path: Path) -> None:
    (tmp_path / "ranker.py").write_text("import no_such_module_of_cerar\n")
    with pytest.raises(LaunchError) as info:
        launch([sys.executable, "-m", "ranker"], 2, cwd=str(tmp_path), preload=["no_such_module_of_cerar"])
    assert info.value.failed and "No module named 'no_such_module_of_cerar'" in str(info.value)


@pytest.mark.multirank
@pytest.mark.parametrize("start", ["exec", "fork"])
def test_fast_failed_rank_kills_the_others(tmp_path: Path, start: str) -> None:
    command, options = _sleepers(tmp_path, [str(tmp_path), "1", "3"], start)
    with pytest.raises(LaunchError) as info:
        launch(command, 3, timeout_s=60, **options)
    err = info.value
    assert err.failed == [1] and not err.timed_out
    assert "rank 1 exited with 3" in str(err) and "failing on purpose" in str(err)
    assert err.results[1].returncode == 3
    assert err.results[0].returncode < 0 and err.results[2].returncode < 0  # killed by the launcher
    _assert_gone(_pids(tmp_path, 3, timeout=1))


@pytest.mark.multirank
@pytest.mark.parametrize("start", ["exec", "fork"])
def test_fast_timeout(tmp_path: Path, start: str) -> None:
    command, options = _sleepers(tmp_path, [str(tmp_path), "-1", "0"], start)
    with pytest.raises(LaunchError) as info:
        launch(command, 2, timeout_s=3, **options)
    assert info.value.timed_out and info.value.failed == []
    assert "timed out after 3 s" in str(info.value)
    _assert_gone(_pids(tmp_path, 2, timeout=1))


# --------------------------------------------------------------------------------------------
# slow (namespaces)


@pytest.mark.multirank
@pytest.mark.netns
@needs_netns
def test_slow_gloo_all_reduce() -> None:
    result = launch([sys.executable, "-c", GLOO], 2, regime="slow", rate="200mbit", timeout_s=120)
    assert [r.stdout.split()[:2] for r in result.ranks] == [["sum", "3"], ["sum", "3"]]
    assert result.link_rate_bytes_per_s is not None and result.link_rate_bytes_per_s > 0
    assert result.rate == "200mbit" and result.run_id
    assert netem.leftovers(result.run_id) == {"namespaces": [], "links": [], "processes": []}


@pytest.mark.multirank
@pytest.mark.netns
@needs_netns
def test_slow_killed_rank_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(LaunchError) as info:
        launch(
            [sys.executable, str(_sleeper(tmp_path)), str(tmp_path), "0", "kill"],
            3,
            regime="slow",
            probe=False,
            timeout_s=60,
        )
    assert info.value.failed == [0]
    assert "rank 0 exited with -9 (SIGKILL)" in str(info.value)
    pids = _pids(tmp_path, 3, timeout=1)
    _assert_gone(pids, run_id=pids[0][2])


LAUNCHER = textwrap.dedent(
    """
    import faulthandler, signal, sys
    faulthandler.register(signal.SIGUSR1)  # the test asks for every thread's stack if it hangs
    # Ctrl-C as in a terminal: a suite started in the background (`make test &`) hands its
    # children SIGINT ignored, and an ignored SIGINT is not what this test is about.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from cerar.harness.launch import launch
    script, d, regime, start = sys.argv[1:5]
    if start == "fork":  # the sleeper as a module, the ranks forked from one process
        launch([sys.executable, "-m", "sleeper", d, "-1", "0"], 2, cwd=d, preload=["json"], timeout_s=120)
    else:
        launch([sys.executable, script, d, "-1", "0"], 2, regime=regime, probe=False, timeout_s=120)
    """
)


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("regime", "sig"),
    [
        pytest.param("slow", signal.SIGTERM, marks=[pytest.mark.netns, needs_netns]),
        pytest.param("slow", signal.SIGINT, marks=[pytest.mark.netns, needs_netns]),
        ("fast", signal.SIGTERM),
        ("fork", signal.SIGTERM),
    ],
)
def test_signal_to_launcher_cleans_up(tmp_path: Path, regime: str, sig: signal.Signals) -> None:
    start = "fork" if regime == "fork" else "exec"
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(_sleeper(tmp_path)), str(tmp_path), regime, start],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        pids = _pids(tmp_path, 2)
        launcher.send_signal(sig)
        # A hang guard, not a speed limit: in a full suite on two loaded cores the kill grace,
        # the reader joins and the namespace teardown once took over 30 s (2026-12-01), and a
        # SIGINT left the launcher polling for 90 s when the suite ran in the background
        # (SIGINT ignored, inherited; 2026-12-02): if it hangs, its threads' stacks are the
        # failure's message.
        try:
            _, err = launcher.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            launcher.send_signal(signal.SIGUSR1)
            time.sleep(2.0)
            launcher.kill()
            _, err = launcher.communicate()
            pytest.fail(f"the launcher did not exit within 90 s of {sig.name}; its stacks:\n{err[-6000:]}")
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode != 0
    if sig == signal.SIGINT:
        assert "KeyboardInterrupt" in err
    else:
        assert launcher.returncode == 128 + signal.SIGTERM
    _assert_gone(pids, run_id=pids[0][2] or None)
    if regime == "slow":
        assert netem.leftovers(str(launcher.pid))["namespaces"] == []


@pytest.mark.multirank
def test_launch_module_cli(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "cerar.harness.launch",
            "-N",
            "2",
            "--",
            sys.executable,
            "-c",
            "import os; print(os.environ['RANK'])",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == ["[0] 0", "[1] 1"]


@pytest.mark.multirank
def test_launch_module_cli_writes_each_line_whole() -> None:
    # Four ranks write many short lines at once: every forwarded line must arrive whole
    # (the reader threads once interleaved two ranks' lines: '[0] 0[1] 1').
    lines = 300
    script = f"import os\nfor i in range({lines}): print(os.environ['RANK'], i, flush=True)"
    done = subprocess.run(
        [sys.executable, "-m", "cerar.harness.launch", "-N", "4", "--", sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    expected = sorted(f"[{rank}] {rank} {i}" for rank in range(4) for i in range(lines))
    assert sorted(done.stdout.splitlines()) == expected


@pytest.mark.multirank
@pytest.mark.parametrize("regime", [pytest.param("slow", marks=[pytest.mark.netns, needs_netns]), "fast", "fork"])
def test_sigkilled_launcher_takes_its_ranks_along(tmp_path: Path, regime: str) -> None:
    start = "fork" if regime == "fork" else "exec"
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(_sleeper(tmp_path)), str(tmp_path), regime, start],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        pids = _pids(tmp_path, 2)
        launcher.kill()  # no cleanup code runs: the kernel's parent-death signal must do it
        launcher.wait(timeout=30)
        end = time.monotonic() + 10
        while time.monotonic() < end and any(alive(rank) for rank, _, _ in pids):
            time.sleep(0.05)
        assert not [rank for rank, _, _ in pids if alive(rank)]
        if regime == "slow":
            # the namespaces outlive a SIGKILLed launcher; the next run (or --cleanup) removes them
            assert netem.leftovers(str(launcher.pid))["namespaces"]
            netem.cleanup_stale()
            assert netem.leftovers(str(launcher.pid))["namespaces"] == []
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for _, child, _ in _pids(tmp_path, 2, timeout=1) if (tmp_path / "pid-1").exists() else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)  # the sleepers' orphaned grandchildren


def test_slow_unavailable_raises_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netem, "unavailable_reason", lambda: "network namespaces need root (test)")
    with pytest.raises(netem.NetemUnavailable, match="cannot emulate a slow network: network namespaces need root"):
        launch([sys.executable, "-c", "pass"], 2, regime="slow")


@pytest.mark.multirank
def test_fast_retries_when_the_port_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    import cerar.harness.launch as launch_module

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        ports = [taken.getsockname()[1]]  # the first attempt gets a port someone else holds
        real = launch_module.free_loopback_port
        monkeypatch.setattr(launch_module, "free_loopback_port", lambda: ports.pop() if ports else real())
        result = launch([sys.executable, "-c", GLOO], 2, timeout_s=120)
    assert [r.stdout.split()[:2] for r in result.ranks] == [["sum", "3"], ["sum", "3"]]
    assert ports == []
