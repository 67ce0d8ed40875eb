"""FSDP2's hybrid sharding (HSDP) with CERAR between nodes: shard inside each node, all-reduce the
shards across nodes through cerar's process group.

Run on one machine as 3 "nodes" of 2 ranks (torchrun numbers ranks node by node)::

    torchrun --standalone --nproc-per-node=6 examples/fsdp2_hsdp.py --ranks-per-node 2

or across real nodes (``LOCAL_WORLD_SIZE`` then gives the ranks per node)::

    torchrun --nnodes=3 --nproc-per-node=2 --rdzv-endpoint=HOST:29500 examples/fsdp2_hsdp.py

``cerar.group.hsdp_groups()`` makes each node's exact group, cerar's group of each local rank
across the nodes, and the 2-D mesh whose replicate dimension is cerar's group; ``fully_shard``
on that mesh is FSDP2's native HSDP (``--route hook``: FSDP on each node plus
``set_all_reduce_hook``, torchtitan's fault-tolerant route). Rank 0 prints the first and final
loss and every rank what crossed between nodes through CERAR; exit 1 if the loss did not fall
or nothing went through CERAR.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import cerar.group


def say(line: str) -> None:
    sys.stdout.write(line + "\n")  # one write: the ranks share one terminal
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--ranks-per-node", type=int, default=None, help="default: torchrun's LOCAL_WORLD_SIZE")
    parser.add_argument("--route", choices=("mesh", "hook"), default="mesh")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # FSDP2 does not broadcast: every rank builds the same weights
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))
    # min_bytes=0: this model's shards are far below the 2 MiB default (sent exact below it).
    groups = cerar.group.hsdp_groups(args.ranks_per_node, min_bytes=0)
    mesh = groups.mesh if args.route == "mesh" else groups.shard_mesh
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if args.route == "hook":
        cerar.group.set_all_reduce_hook(model, groups.replicate)

    weight = torch.randn(32, 8, generator=torch.Generator().manual_seed(0)) / 32**0.5
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1 + rank))
    y = x @ weight
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses = []
    for _ in range(args.steps):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()  # reduce-scatter in the node, then CERAR across the nodes
        optimizer.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged)  # the default group: exact
        losses.append(logged.item() / dist.get_world_size())

    routes = groups.replicate.stats.as_dict()
    coded = routes.get("cerar", {}).get("avg", {"calls": 0})["calls"]
    wire = cerar.collective.get_stats(groups.replicate.transport)
    say(f"rank {rank}: hook calls={coded} bytes_sent={wire.bytes_sent} rounds={wire.rounds} nodes={groups.nodes}")
    if rank == 0:
        say(f"first loss {losses[0]:.6f} final loss {losses[-1]:.6f}")
    ok = losses[-1] < losses[0] and coded > 0
    cerar.shutdown()
    dist.destroy_process_group()
    if not ok:
        print(f"rank {rank}: FAILED (loss did not decrease or nothing went through CERAR)", file=sys.stderr, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
