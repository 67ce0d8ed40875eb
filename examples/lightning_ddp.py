"""PyTorch Lightning's ``DDPStrategy`` with cerar's communication hook, on CPU (Gloo).

Run (4 local ranks; Lightning picks up torchrun's environment)::

    torchrun --standalone --nproc-per-node=4 examples/lightning_ddp.py

Lightning takes a DDP communication hook and its state as strategy arguments::

    DDPStrategy(ddp_comm_state=cerar.ddp.CerarState(), ddp_comm_hook=cerar.ddp.cerar_hook)

**CPU caveat.** ``DDPStrategy`` registers the hook only when the model is on a CUDA device (its
``_register_ddp_hooks`` checks ``root_device.type == "cuda"``, a leftover of the time DDP hooks
needed NCCL); on CPU it silently trains with DDP's own all-reduce instead. DDP itself has run
comm hooks on Gloo for a long time, so :class:`CommHookDDPStrategy` below registers the hook on
every device. On CUDA it behaves exactly as ``DDPStrategy``.

**Without the hook** (``--route group``): ``DDPStrategy(process_group_backend="cerar")`` makes
Lightning call ``init_process_group("cerar")`` (the backend registered by ``import cerar.group``;
``cerar.group.register_backend(...)`` sets the default group's settings), so DDP's default group
is cerar's and its buckets run CERAR on any device, with no strategy subclass.

The script prints the first and final training loss (rank 0) and every rank's hook statistics,
and exits 1 if the loss did not decrease or the hook never ran.
"""

from __future__ import annotations

import argparse
import os
import sys

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import cerar
import cerar.group


class CommHookDDPStrategy(DDPStrategy):
    """``DDPStrategy`` that registers ``ddp_comm_hook`` on CPU too (Lightning does on CUDA only)."""

    def _register_ddp_hooks(self) -> None:
        if self.root_device.type == "cuda" or self._ddp_comm_hook is None:
            return super()._register_ddp_hooks()
        if self._ddp_comm_wrapper is not None:  # on CPU, wrap the hook yourself instead
            raise ValueError(f"Argument 'ddp_comm_wrapper' must be None on CPU, not {self._ddp_comm_wrapper!r}.")
        self.model.register_comm_hook(self._ddp_comm_state, self._ddp_comm_hook)


class Regression(pl.LightningModule):
    """PyTorch's DDP tutorial ``ToyModel`` as a LightningModule; records its training losses."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5))
        self.lr = lr
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def dataset(samples: int = 512) -> TensorDataset:
    """One fixed regression task (a linear map); Lightning's sampler gives each rank its shard."""
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
    parser.add_argument("--route", choices=("hook", "group"), default="hook")
    args = parser.parse_args()

    pl.seed_everything(0, verbose=False)
    # min_bucket_bytes=0 (min_bytes=0): the toy model's buckets are far below the 2 MiB default,
    # which would keep them exact.
    state = None
    if args.route == "group":
        cerar.group.register_backend(min_bytes=0)
        strategy: DDPStrategy = DDPStrategy(process_group_backend="cerar")
    else:  # no process group needed yet: the state makes its own at the first bucket
        state = cerar.ddp.CerarState(min_bucket_bytes=0)
        strategy = CommHookDDPStrategy(ddp_comm_state=state, ddp_comm_hook=cerar.ddp.cerar_hook)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy=strategy,
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Regression(args.lr)
    trainer.fit(model, DataLoader(dataset(), batch_size=16))

    rank = trainer.global_rank
    with cerar.exact():  # the losses' average, bitwise the same on every rank (a no-op without cerar's group)
        first, final = average_over_ranks(model.losses[:8]), average_over_ranks(model.losses[-8:])
    if state is not None:
        stats, code = state.stats, state.code  # the code: resolved for the group's size at the first bucket
        what = f"code={code.construction}(N={code.world_size}, c={code.components})"
    else:
        group = dist.group.WORLD
        stats, what = cerar.collective.get_stats(group.transport), f"backend={dist.get_backend()}"
    say(f"rank {rank}: hook calls={stats.calls} bytes_sent={stats.bytes_sent} rounds={stats.rounds} {what}")
    if rank == 0:
        say(f"first loss {first:.6f} final loss {final:.6f}")
    ok = final < first and stats.calls > 0
    cerar.shutdown()  # stop cerar's communication thread before the groups go away
    dist.destroy_process_group()
    if not ok:
        print(f"rank {rank}: FAILED (loss did not decrease or the hook never ran)", file=sys.stderr, flush=True)
    return 0 if ok else 1


def average_over_ranks(losses: list[float]) -> float:
    """The mean of some steps' losses over the steps and the ranks (the group still exists)."""
    total = torch.tensor(sum(losses) / len(losses), dtype=torch.float64)
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


if __name__ == "__main__":
    sys.exit(main())
