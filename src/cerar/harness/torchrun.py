"""Multi-node torchrun, for real: one ``torchrun`` agent per (emulated) node, nothing else.

With ``launch(..., launcher="torchrun", ranks_per_node=G)`` the launcher starts only ``M = N / G``
processes, one per node, each::

    torchrun --nnodes M --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint NODE0:29500 \\
             --rdzv-id RUN --local-addr NODE_ADDR --max-restarts 0 --no-python CMD ...

inside its node's network namespace (``ip netns exec cerar-<run>-n<k>``, slow regime) or on
loopback (fast regime). torchrun does the rest as on a real cluster: the rendezvous (c10d's
TCPStore on node 0, which the ranks then share for ``init_process_group``), starting the ``G``
local ranks with ``RANK``, ``LOCAL_RANK``, ``GROUP_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT``, watching them, and stopping its node's ranks (and exiting non-zero) when one fails.

Two rendezvous:

* ``c10d`` (the default, what a real cluster uses): node 0 hosts the store (``is_host=true``;
  a namespace shares the machine's hostname, so torchrun cannot guess who hosts it) and every
  agent names its own address (``--local-addr``: the ranks' ``MASTER_ADDR`` is node 0's).
  c10d numbers the nodes itself, in the order of their addresses: node 0 (the lowest) is
  always group rank 0, and for fewer than 10 nodes node ``k`` is group rank ``k``;
  ``--node-rank`` is not passed (c10d ignores it and warns).
* ``static``: ``--node-rank k --master-addr NODE0 --master-port 29500``, the fixed numbering.

Every agent gets the node's environment: ``GLOO_SOCKET_IFNAME`` (the node's link, or ``lo``),
``CERAR_IFNAME``, ``CERAR_RUN_ID``, ``CERAR_REGIME``, ``CERAR_RANKS_PER_NODE`` and ``CERAR_NODE``
(the namespace's index ``k``); the ranks inherit it. Each rank runs behind the orphan guard of
:mod:`cerar.harness.processes` (the kernel kills it when its agent dies, even by SIGKILL);
``--log-dir`` is a temporary folder of the launch (torchrun otherwise leaves a
``/tmp/torchelastic_*`` per agent behind).

The result holds one entry per node (``RankResult.rank`` is the node's index, its output the
interleaved lines of the node's ranks), and ``LaunchError.failed`` lists nodes.
"""

from __future__ import annotations

import os
import sys

from cerar.harness.netem import Network
from cerar.harness.processes import LineCallback, RankProcesses, orphan_guard

__all__ = ["RENDEZVOUS", "NodeProcesses", "torchrun_argv"]

RENDEZVOUS = ("c10d", "static")


def torchrun_argv(
    command: list[str],
    *,
    nodes: int,
    ranks_per_node: int,
    node: int,
    master_addr: str,
    master_port: int,
    local_addr: str,
    rdzv: str = "c10d",
    run_id: str = "cerar",
    log_dir: str | None = None,
) -> list[str]:
    """The argv of node ``node``'s torchrun agent that runs ``command`` as each of its ranks.

    ``command`` is a full argv (run with ``--no-python``), each rank behind the orphan guard.
    """
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",  # what the torchrun script runs, with the launcher's interpreter
        f"--nnodes={nodes}",
        f"--nproc-per-node={ranks_per_node}",
        "--max-restarts=0",
        f"--local-addr={local_addr}",
    ]
    if rdzv == "c10d":
        argv += [
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={master_addr}:{master_port}",
            f"--rdzv-id={run_id}",
            f"--rdzv-conf=is_host={'true' if node == 0 else 'false'}",
        ]
    elif rdzv == "static":
        argv += [f"--node-rank={node}", f"--master-addr={master_addr}", f"--master-port={master_port}"]
    else:
        raise ValueError(f"Argument 'rdzv' must be one of {', '.join(map(repr, RENDEZVOUS))}, not {rdzv!r}.")
    if log_dir is not None:
        argv.append(f"--log-dir={log_dir}")
    return [*argv, "--no-python", *orphan_guard(parent="-"), *command]


class NodeProcesses(RankProcesses):
    """The torchrun agents of one launch, one per node (``count`` = nodes, labelled ``node``)."""

    label = "node"

    def __init__(
        self,
        argv: list[str],
        world_size: int,
        base_env: dict[str, str],
        cwd: str | None,
        net: Network | None,
        on_line: LineCallback | None,
        ranks_per_node: int,
        rdzv: str,
        run_id: str,
        log_dir: str,
    ) -> None:
        super().__init__(argv, world_size, base_env, cwd, net, on_line, ranks_per_node)
        self.count = world_size // ranks_per_node
        self.out = [([], []) for _ in range(self.count)]
        self.rdzv, self.run_id, self.log_dir = rdzv, run_id, log_dir
        self.kill_descendants = True  # torchrun starts its ranks in sessions of their own

    def _first_rank(self, node: int) -> int:
        return node * self.ranks_per_node

    def prefix(self, index: int) -> list[str]:
        return self.net.exec_prefix(self._first_rank(index)) if self.net else []

    def command(self, index: int, port: int) -> list[str]:
        net = self.net
        return torchrun_argv(
            self.argv,
            nodes=self.count,
            ranks_per_node=self.ranks_per_node,
            node=index,
            master_addr=net.ranks[0].address if net else "127.0.0.1",
            master_port=port,
            local_addr=net.ranks[self._first_rank(index)].address if net else "127.0.0.1",
            rdzv=self.rdzv,
            run_id=self.run_id,
            log_dir=os.path.join(self.log_dir, f"node{index}"),
        )

    def env(self, index: int, port: int) -> dict[str, str]:
        """The agent's environment: the launcher's, plus the node's link; torchrun sets the
        ranks' own variables (``RANK``, ``MASTER_ADDR`` ...), so any the launcher had are dropped."""
        net = self.net
        env = {k: v for k, v in self.base_env.items() if k not in _TORCHRUN_SETS}
        env.update(
            GLOO_SOCKET_IFNAME=net.ranks[self._first_rank(index)].ifname if net else "lo",
            CERAR_RANKS_PER_NODE=str(self.ranks_per_node),
            CERAR_REGIME="slow" if net else "fast",
            CERAR_NODE=str(index),
        )
        if net:
            env["CERAR_RUN_ID"] = net.run_id
            env["CERAR_IFNAME"] = net.ranks[self._first_rank(index)].ifname
        return env


#: Variables torchrun sets for its ranks: a launcher running inside another job must not
#: hand its own to the agents.
_TORCHRUN_SETS = frozenset(
    {
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_USE_AGENT_STORE",
        "TORCHELASTIC_ERROR_FILE",
    }
)
