"""Hugging Face accelerate on CPU (Gloo) with cerar's DDP communication hook.

Run (4 local ranks)::

    torchrun --standalone --nproc-per-node=4 examples/accelerate_ddp.py

(``accelerate launch --cpu --num_processes=4`` starts several CPU processes only through
``mpirun``; without it, it starts one process, which this script refuses.)

``Accelerator(cpu=True)`` reads the launcher's environment, starts Gloo and, in ``prepare``,
wraps the model in ``DistributedDataParallel``. Register the hook on that wrapped model, after
``prepare``: accelerate has no argument for a custom hook (its ``DDPCommunicationHookType`` lists
only PyTorch's own), and the process group exists by then::

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state = cerar.ddp.CerarState()
    model.register_comm_hook(state, cerar.ddp.cerar_hook)

The script prints the first and final training loss (rank 0) and every rank's hook statistics,
and exits 1 if the loss did not decrease or the hook never ran.
"""

from __future__ import annotations

import argparse
import sys

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import cerar


def dataset(samples: int = 512) -> TensorDataset:
    """One fixed regression task (a linear map); accelerate's sampler gives each rank its shard."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(10, 5, generator=generator)
    x = torch.randn(samples, 10, generator=generator)
    return TensorDataset(x, x @ weight)


def say(line: str) -> None:
    """Print one line in a single write: the ranks share one terminal, and ``print`` writes the
    newline separately, which lets another rank's line slip in between."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    if accelerator.num_processes < 2:
        print(
            f"accelerate_ddp.py needs at least 2 processes, not {accelerator.num_processes}: run it with "
            "torchrun --standalone --nproc-per-node=4 examples/accelerate_ddp.py",
            file=sys.stderr,
        )
        return 2
    model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5))  # the DDP tutorial's ToyModel
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loader = DataLoader(dataset(), batch_size=16, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state = cerar.ddp.CerarState(min_bucket_bytes=0)  # toy buckets: below the 2 MiB default threshold
    model.register_comm_hook(state, cerar.ddp.cerar_hook)  # model is the DistributedDataParallel now

    losses = []
    for _ in range(args.epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)  # the hook averages the gradient buckets here
            optimizer.step()
            losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())

    rank = accelerator.process_index
    first, final = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
    stats = state.stats
    code = state.code  # resolved for the group's size at the first bucket
    say(
        f"rank {rank}: hook calls={stats.calls} bytes_sent={stats.bytes_sent} rounds={stats.rounds} "
        f"code={code.construction}(N={code.world_size}, c={code.components})"
    )
    if rank == 0:
        say(f"first loss {first:.6f} final loss {final:.6f}")
    ok = final < first and stats.calls > 0
    cerar.shutdown()  # stop cerar's communication thread before the groups go away
    accelerator.end_training()  # destroys the process group
    if not ok:
        print(f"rank {rank}: FAILED (loss did not decrease or the hook never ran)", file=sys.stderr, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
