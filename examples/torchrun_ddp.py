"""DDP training under torchrun with cerar's communication hook, in the shape of PyTorch's DDP tutorial.

Run (4 local ranks, Gloo on CPU)::

    torchrun --standalone --nproc-per-node=4 examples/torchrun_ddp.py

The model is the tutorial's ``ToyModel``; each rank trains on its own shard of one fixed
regression task, so the loss must fall. What cerar adds to the tutorial is two lines: build a
``cerar.ddp.CerarState`` and ``register_comm_hook`` it with ``cerar.ddp.cerar_hook``. Every
gradient bucket is then averaged by CERAR instead of DDP's all-reduce. At the end rank 0 prints
the first and final loss (averaged over the ranks) and every rank prints what its hook sent; the
script exits 1 if the loss did not decrease or the hook never ran, so it doubles as a test.
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


def mean_over_ranks(value: torch.Tensor) -> float:
    total = value.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def say(line: str) -> None:
    """Print one line in a single write: the ranks share one terminal, and ``print`` writes the
    newline separately, which lets another rank's line slip in between."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def describe(code: cerar.Code) -> str:
    return f"{code.construction}(N={code.world_size}, c={code.components})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()

    torch.manual_seed(0)  # DDP broadcasts rank 0's parameters anyway; this makes runs repeatable
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
    rank = dist.get_rank()

    model = DDP(ToyModel())
    # The code defaults to cerar.codes.choose(world size). min_bucket_bytes=0: this toy model's
    # buckets are far below the 2 MiB default, which would send them to the exact all-reduce.
    state = cerar.ddp.CerarState(min_bucket_bytes=0)
    model.register_comm_hook(state, cerar.ddp.cerar_hook)

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
    say(
        f"rank {rank}: hook calls={stats.calls} bytes_sent={stats.bytes_sent} rounds={stats.rounds} "
        f"code={describe(state.code)}"
    )
    if rank == 0:
        say(f"first loss {losses[0]:.6f} final loss {losses[-1]:.6f}")
    ok = losses[-1] < losses[0] and stats.calls > 0
    cerar.shutdown()  # stop cerar's communication thread before the groups go away
    dist.destroy_process_group()
    if not ok:
        print(f"rank {rank}: FAILED (loss did not decrease or the hook never ran)", file=sys.stderr, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
