"""One rank of a training run: ``python -m cerar.experiments.train.worker``.

Reads the rendezvous from the environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, as set by :func:`cerar.harness.launch.launch` or ``torchrun``), joins a Gloo group,
trains (:func:`cerar.experiments.train.loop.train`) and, on rank 0, writes every rank's record as JSON::

    torchrun --nproc-per-node 4 -m cerar.experiments.train.worker --method cerar:8 --steps 100 --out run.json

``--config FILE`` takes a :class:`~cerar.experiments.train.config.TrainConfig` JSON instead of the options
(what ``cerar train`` passes). ``--progress lines`` prints ``cerar-progress STEP STEPS LOSS`` on
rank 0 for a launcher to follow; ``bar`` shows a tqdm bar; ``none`` is silent.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cerar.experiments.train.config import TrainConfig, add_config_arguments, config_from_args
from cerar.experiments.train.loop import train

PROGRESS_PREFIX = "cerar-progress"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m cerar.experiments.train.worker", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--config", type=Path, default=None, help="a TrainConfig JSON (overrides the options)")
    parser.add_argument(
        "--method", default="allreduce", help="allreduce, ring, cerar[:c|:kN], fp16, bf16, powersgd[:r]"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="rank 0 writes the run's JSON here")
    parser.add_argument("--progress", choices=("bar", "lines", "none"), default=None)
    parser.add_argument("--timeout-s", type=float, default=300.0, help="Gloo timeout for one collective")
    add_config_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one rank. The process group stays up on return: see :func:`_exit`."""
    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)  # several ranks share two cores: intra-op threads would only fight
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if args.config is not None:
        config = TrainConfig.from_json(args.config.read_text())
    else:
        config = config_from_args(args, args.method, args.seed, world_size)
    record = train(config, progress=_progress(args.progress, rank, config.label))
    records: list[Any] = [None] * world_size
    dist.all_gather_object(records, record)
    if rank == 0:
        out = {"config": config.to_dict(), "label": config.label, "world_size": world_size, "ranks": records}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(out))
        os.replace(tmp, args.out)
    dist.barrier()  # rank 0's file is written before any rank leaves
    return 0


def _exit(code: int) -> None:
    """Leave without interpreter teardown. Tearing down Gloo groups while cerar's daemon
    communication threads still exist aborted a rank once in a few runs here ("terminate called
    without an active exception", SIGABRT) after all its work was done; every result is
    written and every rank is past the final barrier, so nothing is lost by skipping it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _progress(kind: str | None, rank: int, label: str) -> Any:
    if rank != 0:
        return None
    kind = kind or ("bar" if sys.stderr.isatty() else "none")
    if kind == "lines":

        def line(step: int, steps: int, loss: float) -> None:
            print(f"{PROGRESS_PREFIX} {step} {steps} {loss:.4f}", flush=True)

        return line
    if kind == "bar":
        from tqdm import tqdm

        bar = tqdm(desc=label, unit="step")

        def advance(step: int, steps: int, loss: float) -> None:
            bar.total = steps
            bar.update(step - bar.n)
            bar.set_postfix(loss=f"{loss:.3f}")
            if step == steps:
                bar.close()

        return advance
    return None


if __name__ == "__main__":
    _exit(main())
