"""Multi-node torchrun on emulated nodes: ``launch(..., launcher="torchrun")``.

Each emulated node is one network namespace running one ``torchrun --nnodes M --nproc-per-node G``
agent, with a c10d rendezvous at node 0 (:mod:`cerar.harness.torchrun`); the launcher starts only
those. The tests run 2 nodes x 2 ranks: the hierarchical example's sums against the exact sum
on every rank, a killed rank (error within a timeout, every process and namespace gone), and
``cerar bench --launcher torchrun``. The slow ones need root, ``ip`` and ``tc`` and skip
otherwise; a fast (loopback) variant of the killed rank runs anywhere. Only the addresses of
the namespaces the tests create are used.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import ModuleType

import pytest
from processes import alive

import cerar
from cerar.harness import netem
from cerar.harness.launch import LaunchError, launch
from cerar.harness.torchrun import torchrun_argv

needs_netns = pytest.mark.skipif(netem.unavailable_reason() is not None, reason=str(netem.unavailable_reason()))

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "torchrun_hierarchical.py"
NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
TIMEOUT_S = 300  # a loaded 2-core machine; an unloaded run takes about 20 s
HOOK_LINE = re.compile(r"rank (\d+): hook calls=(\d+) bytes_sent=(\d+) rounds=(\d+)")
LOSS_LINE = re.compile(r"first loss (\d+\.\d+) final loss (\d+\.\d+)")
ERROR_LINE = re.compile(r"rank (\d+) node (\d+) local (\d+): .* hier-cerar rel_err=(\S+) bound=(\S+) .* node=(\d+)")


def _example() -> ModuleType:
    """The example as a module: the test recomputes the inputs and the exact sum with its code."""
    spec = importlib.util.spec_from_file_location("torchrun_hierarchical", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------------------------
# arguments (no processes)


def test_torchrun_argv_c10d_and_static() -> None:
    command = [sys.executable, "train.py", "--x"]
    c10d = torchrun_argv(
        command,
        nodes=4,
        ranks_per_node=2,
        node=1,
        master_addr="10.99.0.1",
        master_port=29500,
        local_addr="10.99.0.2",
        run_id="r1",
    )
    assert c10d[:3] == [sys.executable, "-m", "torch.distributed.run"]
    for option in (
        "--nnodes=4",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=10.99.0.1:29500",
        "--rdzv-id=r1",
        "--rdzv-conf=is_host=false",  # only node 0 hosts the store
        "--local-addr=10.99.0.2",
        "--max-restarts=0",
    ):
        assert option in c10d
    assert not any(a.startswith("--node-rank") for a in c10d)  # c10d ignores it (and warns)
    assert c10d[-3:] == command and "--no-python" in c10d
    static = torchrun_argv(
        command, nodes=2, ranks_per_node=3, node=0, master_addr="a", master_port=1, local_addr="a", rdzv="static"
    )
    assert {"--node-rank=0", "--master-addr=a", "--master-port=1"} <= set(static)
    assert not any(a.startswith("--rdzv") for a in static)
    with pytest.raises(ValueError, match="Argument 'rdzv' must be one of 'c10d', 'static', not 'etcd'"):
        torchrun_argv(
            command, nodes=2, ranks_per_node=1, node=0, master_addr="a", master_port=1, local_addr="a", rdzv="etcd"
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"launcher": "mpirun"}, "Argument 'launcher' must be one of 'direct', 'torchrun', not 'mpirun'"),
        ({"launcher": "torchrun", "rdzv": "etcd"}, "Argument 'rdzv' must be one of 'c10d', 'static', not 'etcd'"),
    ],
)
def test_bad_launcher_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        launch([sys.executable, "-c", "pass"], 2, **kwargs)


def test_bench_config_launcher() -> None:
    from cerar.experiments.bench.config import BenchConfig

    assert BenchConfig(nodes=2, ranks_per_node=2, launcher="torchrun").launcher == "torchrun"
    with pytest.raises(ValueError, match="Argument 'launcher'"):
        BenchConfig(launcher="mpirun")
    with pytest.raises(ValueError, match="Argument 'rdzv'"):
        BenchConfig(rdzv="etcd")


# --------------------------------------------------------------------------------------------
# 2 emulated nodes x 2 ranks under torchrun


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.netns
@needs_netns
def test_torchrun_nodes_hierarchical_sum_is_exact_on_every_rank(tmp_path: Path) -> None:
    """The example under one torchrun per namespace: every rank's hier-ring sum is the exact sum
    (float32 rounding), its hier-cerar sum within the code's bound, equal on a node's ranks; the
    DDP step with hier_cerar_hook ran everywhere; nothing is left afterwards."""
    import torch

    result = launch(
        [sys.executable, str(EXAMPLE), "--save", str(tmp_path), "--values", "30001"],
        WORLD,
        regime="slow",
        ranks_per_node=PER_NODE,
        launcher="torchrun",
        probe=False,
        timeout_s=TIMEOUT_S,
        cwd=str(ROOT),
    )
    assert result.launcher == "torchrun" and [r.rank for r in result.ranks] == [0, 1]  # one agent per node
    assert netem.leftovers(result.run_id) == {"namespaces": [], "links": [], "processes": []}
    output = "".join(r.stdout for r in result.ranks)

    # Each node's agent ran that node's two ranks, torchrun numbering them node by node.
    for node, node_result in enumerate(result.ranks):
        lines = [ERROR_LINE.search(line) for line in node_result.stdout.splitlines()]
        found = sorted((int(m[1]), int(m[2]), int(m[3]), int(m[6])) for m in lines if m)
        assert found == [(node * PER_NODE + l, node, l, node) for l in range(PER_NODE)], node_result.stdout

    example = _example()
    exact = example.exact_sum(WORLD, 30001)
    saved = {r: torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)}
    bound = 2.0 * float(cerar.codes.choose(NODES).error_bound.max()) + example.RING_TOLERANCE
    for rank, sums in saved.items():
        assert sums["layout"] == [rank // PER_NODE, rank % PER_NODE]
        assert example.relative_error(sums["hier-ring"], exact) <= example.RING_TOLERANCE, rank
        assert example.relative_error(sums["hier-cerar"], exact) <= bound, rank
    for node in range(NODES):  # exact inside a node: its ranks hold identical values
        first = saved[node * PER_NODE]
        for l in range(1, PER_NODE):
            assert torch.equal(saved[node * PER_NODE + l]["hier-cerar"], first["hier-cerar"])

    hook = {int(m[1]): (int(m[2]), int(m[3])) for m in HOOK_LINE.finditer(output)}
    assert sorted(hook) == list(range(WORLD)), output
    assert len({calls for calls, _ in hook.values()}) == 1 and all(c > 0 and b > 0 for c, b in hook.values())
    (first_loss, final_loss), *rest = LOSS_LINE.findall(output)
    assert not rest and float(final_loss) < 0.5 * float(first_loss), output


# Every rank writes its pid (and the run id) to DIR/pid-RANK, then all-reduces every 50 ms
# until it is killed: a killed rank breaks its peers' next all-reduce.
LOOPER = textwrap.dedent(
    """
    import os, sys, time, torch, torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    path = os.path.join(sys.argv[1], f"pid-{rank}")
    with open(path + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {os.getppid()} {os.environ.get('CERAR_RUN_ID', '')}")
    os.replace(path + ".tmp", path)
    end = time.monotonic() + 240
    t = torch.ones(1000)
    while time.monotonic() < end:
        dist.all_reduce(t)
        time.sleep(0.05)
    """
)


def _pids(d: Path, timeout: float) -> list[tuple[int, int, str]]:
    """(rank pid, its torchrun agent's pid, run id) per rank, once every rank has written them."""
    end = time.monotonic() + timeout
    files = [d / f"pid-{r}" for r in range(WORLD)]
    while time.monotonic() < end:
        if all(f.exists() for f in files):
            rows = [f.read_text().split() for f in files]
            return [(int(r[0]), int(r[1]), r[2] if len(r) > 2 else "") for r in rows]
        time.sleep(0.05)
    raise AssertionError("the ranks did not start in time")


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("regime", [pytest.param("slow", marks=[pytest.mark.netns, needs_netns]), "fast"])
def test_torchrun_nodes_killed_rank_fails_and_cleans_up(tmp_path: Path, regime: str) -> None:
    """SIGKILL one rank on node 1: its agent exits non-zero, the launcher stops every agent and
    rank and removes the namespaces, and LaunchError names the node, well within the limit."""
    script = tmp_path / "looper.py"
    script.write_text(LOOPER)
    victim = WORLD - 1  # on node 1
    killed: list[tuple[int, int, str]] = []

    def kill_when_up() -> None:
        pids = _pids(tmp_path, TIMEOUT_S)
        killed.extend(pids)
        os.kill(pids[victim][0], signal.SIGKILL)

    killer = threading.Thread(target=kill_when_up, daemon=True)
    killer.start()
    started = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(
            [sys.executable, str(script), str(tmp_path)],
            WORLD,
            regime=regime,
            ranks_per_node=PER_NODE,
            launcher="torchrun",
            probe=False,
            timeout_s=TIMEOUT_S,
        )
    killer.join(timeout=5)
    assert killed, "the ranks never started"
    err = info.value
    assert not err.timed_out and 1 in err.failed, str(err)
    assert "node 1 exited with" in str(err) and "SIGKILL" in str(err), str(err)
    # The error came from the kill, not from a timeout: the peers' Gloo connections break at once.
    assert time.monotonic() - started < TIMEOUT_S / 2
    end = time.monotonic() + 10
    pids = [pid for rank in killed for pid in rank[:2]]  # every rank and every agent
    while time.monotonic() < end and any(alive(p) for p in pids):
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)]
    if regime == "slow":
        run_id = killed[0][2]
        assert run_id and netem.leftovers(run_id) == {"namespaces": [], "links": [], "processes": []}


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.netns
@needs_netns
def test_bench_with_torchrun_launcher() -> None:
    """``cerar bench --nodes 2 --ranks-per-node 2 --launcher torchrun`` in its smallest form."""
    from cerar.experiments.bench.config import BenchConfig
    from cerar.experiments.bench.run import run_bench

    config = BenchConfig(
        nodes=NODES,
        ranks_per_node=PER_NODE,
        launcher="torchrun",
        regimes=("slow",),
        methods=("builtin", "hier-ring", "hier-cerar"),
        sizes_bytes=(64 << 10,),
        components=(4,),
        iters=1,
        warmup=0,
        timeout_s=TIMEOUT_S,
    )
    doc = run_bench(config, progress=False, log=lambda _: None)
    info = doc["regimes"]["slow"]
    assert info["error"] is None and info["launcher"] == "torchrun" and doc["settings"]["launcher"] == "torchrun"
    assert sorted(r["method"] for r in doc["results"]) == ["builtin", "hier-cerar", "hier-ring"]


LAUNCHER = textwrap.dedent(
    """
    import sys
    from cerar.harness.launch import launch
    launch([sys.executable, sys.argv[1], sys.argv[2]], 4, regime=sys.argv[3], ranks_per_node=2,
           launcher="torchrun", probe=False, timeout_s=240)
    """
)


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("regime", [pytest.param("slow", marks=[pytest.mark.netns, needs_netns]), "fast"])
def test_torchrun_nodes_sigterm_to_launcher_cleans_up(tmp_path: Path, regime: str) -> None:
    """SIGTERM to the launcher while the ranks run: it exits 143 and no agent, rank or
    namespace of the run is left."""
    script = tmp_path / "looper.py"
    script.write_text(LOOPER)
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(script), str(tmp_path), regime],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        pids = _pids(tmp_path, TIMEOUT_S)
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 128 + signal.SIGTERM, err[-3000:]
    every = [pid for rank in pids for pid in rank[:2]]
    end = time.monotonic() + 10
    while time.monotonic() < end and any(alive(p) for p in every):
        time.sleep(0.05)
    assert not [p for p in every if alive(p)]
    if regime == "slow":
        assert netem.leftovers(pids[0][2]) == {"namespaces": [], "links": [], "processes": []}
