"""Hierarchical CERAR under multi-node torchrun: exact inside each node, CERAR between nodes.

On a real cluster of M nodes with G ranks each, run on every node k = 0 .. M-1 (Gloo on CPU;
NODE0 is node 0's address, reachable from every node)::

    torchrun --nnodes M --nproc-per-node G --node-rank k \\
        --rdzv-backend c10d --rdzv-endpoint NODE0:29500 --rdzv-id job1 \\
        examples/torchrun_hierarchical.py

(c10d numbers the nodes itself and ignores ``--node-rank``; with the static rendezvous,
``--master-addr NODE0 --master-port 29500`` instead of the three ``--rdzv`` options, it is used.)
On one machine, emulated nodes, each in its own network namespace with one rate-limited link
(root, ``ip`` and ``tc``)::

    python -m cerar.harness.launch -N 4 --ranks-per-node 2 --regime slow --launcher torchrun -- \\
        python examples/torchrun_hierarchical.py

The node layout comes from torchrun's ``LOCAL_WORLD_SIZE``, ``LOCAL_RANK`` and ``GROUP_RANK``.
The script

1. sums one tensor with :func:`cerar.hierarchical_all_reduce` (a code for the M nodes) and with
   :func:`cerar.hierarchical_ring_all_reduce`, and compares both with the exact sum of every
   rank's input (recomputed locally in float64: each input comes from its rank's seed);
2. trains the DDP tutorial's ``ToyModel`` with ``cerar.ddp.hier_cerar_hook``.

Every rank prints its errors, the code's bound and what its hook sent; rank 0 prints the first
and final loss. It exits 1 if an error exceeds its bound, the loss did not fall or the hook never
ran, so it doubles as a test. ``--save DIR`` also writes each rank's two sums to ``DIR``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import cerar

RING_TOLERANCE = 1e-5  # the exact ring between nodes: float32 rounding only


class ToyModel(nn.Module):
    """The DDP tutorial's model: two linear layers with a ReLU between them."""

    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def rank_input(rank: int, values: int, seed: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input to the all-reduce: i.i.d. standard normal float32 from its own seed."""
    return torch.randn(values, generator=torch.Generator().manual_seed(1000 * seed + rank))


def exact_sum(world_size: int, values: int, seed: int = 0) -> torch.Tensor:
    """The sum of every rank's input in float64, without communication."""
    return sum(
        (rank_input(r, values, seed).double() for r in range(world_size)), torch.zeros(values, dtype=torch.float64)
    )


def relative_error(result: torch.Tensor, exact: torch.Tensor) -> float:
    return float((result.double() - exact).norm() / exact.norm())


def shard(rank: int, samples: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's training inputs and the targets of one task shared by all ranks."""
    weight = torch.randn(10, 5, generator=torch.Generator().manual_seed(0))
    x = torch.randn(samples, 10, generator=torch.Generator().manual_seed(1 + rank))
    return x, x @ weight


def mean_over_ranks(value: torch.Tensor) -> float:
    total = value.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def say(line: str) -> None:
    """One line in a single write: the ranks of a node share one stdout."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=100_003, help="size of the summed tensor (float32 values)")
    parser.add_argument("--steps", type=int, default=30, help="DDP training steps")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--save", default=None, metavar="DIR", help="write each rank's sums to DIR/rank<R>.pt")
    args = parser.parse_args()

    torch.set_num_threads(1)  # several ranks share a node's cores
    torch.manual_seed(0)
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = cerar.hierarchical.node_layout()  # from LOCAL_WORLD_SIZE (checked against GROUP_RANK)
    assert layout is not None
    where = f"rank {rank} node {layout.node} local {layout.local_rank}"

    # 1. One tensor, both hierarchical methods, against the exact sum.
    code = cerar.codes.choose(layout.nodes) if layout.nodes > 1 else None
    exact = exact_sum(world, args.values)
    sums = {}
    for name, reduce in (
        ("hier-cerar", cerar.hierarchical_all_reduce),
        ("hier-ring", cerar.hierarchical_ring_all_reduce),
    ):
        x = rank_input(rank, args.values)
        if name == "hier-cerar" and code is not None:
            reduce(x, code=code)
        else:
            reduce(x)
        sums[name] = x
    cerar_error = relative_error(sums["hier-cerar"], exact)
    ring_error = relative_error(sums["hier-ring"], exact)
    # The code's bound is relative to the spread of the node sums, about the sum's norm for
    # i.i.d. inputs; twice it, plus float32 rounding, leaves room for that approximation.
    bound = (2.0 * float(code.error_bound.max()) if code is not None else 0.0) + RING_TOLERANCE
    say(
        f"{where}: nodes={layout.nodes} ranks_per_node={layout.ranks_per_node} "
        f"hier-cerar rel_err={cerar_error:.3e} bound={bound:.3e} hier-ring rel_err={ring_error:.3e} "
        f"node={os.environ.get('CERAR_NODE', layout.node)}"
    )
    if args.save:
        os.makedirs(args.save, exist_ok=True)
        torch.save({**sums, "layout": [layout.node, layout.local_rank]}, os.path.join(args.save, f"rank{rank}.pt"))

    # 2. DDP with the hierarchical hook. min_bucket_bytes=0: this toy model's buckets are far
    # below the 2 MiB default, which would send them to the exact all-reduce.
    model = DDP(ToyModel())
    state = cerar.ddp.HierarchicalState(min_bucket_bytes=0)  # ranks_per_node: LOCAL_WORLD_SIZE
    model.register_comm_hook(state, cerar.ddp.hier_cerar_hook)
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    x, y = shard(rank)
    losses = []
    for _ in range(args.steps):
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()  # the hook averages the gradient buckets here
        optimizer.step()
        losses.append(mean_over_ranks(loss))

    stats = state.stats
    say(f"rank {rank}: hook calls={stats.calls} bytes_sent={stats.bytes_sent} rounds={stats.rounds}")
    if rank == 0:
        say(f"first loss {losses[0]:.6f} final loss {losses[-1]:.6f}")
    ok = cerar_error <= bound and ring_error <= RING_TOLERANCE and losses[-1] < losses[0] and stats.calls > 0
    cerar.shutdown()  # stop cerar's communication thread before the groups go away
    dist.destroy_process_group()
    if not ok:
        print(f"{where}: FAILED (error above its bound, loss did not fall, or no hook call)", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
