"""DDP through cerar's process group, no hook: the DDP tutorial's model with ``process_group=`` set.

Run (4 local ranks, Gloo on CPU)::

    torchrun --standalone --nproc-per-node=4 examples/ddp_group.py

What cerar adds to the tutorial is one line: ``group = cerar.new_group(...)``, passed to DDP as
its ``process_group``. DDP's bucket all-reduces (float sums of at least ``min_bytes``) then run
CERAR; its start-up broadcasts and everything else go to the group's exact inner group.
``cerar.exact()`` sends the loss logging there too, so every rank prints the same loss. Rank 0
prints the first and final loss and every rank what its group sent; the script exits 1 if the
loss did not decrease or nothing went through CERAR.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import cerar


class ToyModel(nn.Module):
    """The tutorial's model: two linear layers with a ReLU between them."""

    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def shard(rank: int, samples: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's inputs and the targets of one task shared by all ranks (a fixed linear map)."""
    weight = torch.randn(10, 5, generator=torch.Generator().manual_seed(0))
    x = torch.randn(samples, 10, generator=torch.Generator().manual_seed(1 + rank))
    return x, x @ weight


def say(line: str) -> None:
    sys.stdout.write(line + "\n")  # one write: the ranks share one terminal
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()

    torch.manual_seed(0)
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
    rank = dist.get_rank()
    # min_bytes=0: this toy model's buckets are far below the 2 MiB default (sent exact below it).
    group = cerar.new_group(min_bytes=0)
    model = DDP(ToyModel(), process_group=group)

    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    x, y = shard(rank)
    losses = []
    for _ in range(args.steps):
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()  # DDP's buckets go through cerar's group
        optimizer.step()
        logged = loss.detach().clone()
        with cerar.exact(group):  # bitwise the same on every rank
            dist.all_reduce(logged, group=group)
        losses.append(logged.item() / dist.get_world_size())

    routes = group.stats.as_dict()
    coded = routes.get("cerar", {}).get("sum", {"calls": 0})["calls"]
    wire = cerar.collective.get_stats(group.transport)
    exact = sorted(routes["exact"])  # DDP's start-up and the loss logging: handed to the exact group
    say(f"rank {rank}: hook calls={coded} bytes_sent={wire.bytes_sent} rounds={wire.rounds} exact={exact}")
    if rank == 0:
        say(f"first loss {losses[0]:.6f} final loss {losses[-1]:.6f}")
    ok = losses[-1] < losses[0] and coded > 0
    cerar.shutdown()  # stop cerar's communication thread before the groups go away
    dist.destroy_process_group()
    if not ok:
        print(f"rank {rank}: FAILED (loss did not decrease or nothing went through CERAR)", file=sys.stderr, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
