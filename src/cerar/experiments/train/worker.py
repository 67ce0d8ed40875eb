"""One rank of a training run: ``python -m cerar.experiments.train.worker``.

Reads the rendezvous from the environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, as set by :func:`cerar.harness.launch.launch` or ``torchrun``), joins a Gloo group,
trains (:func:`cerar.experiments.train.loop.train`) and, on rank 0, writes every rank's record as JSON::

    torchrun --nproc-per-node 4 -m cerar.experiments.train.worker --method cerar:8 --steps 100 --out run.json

``--config FILE`` takes a :class:`~cerar.experiments.train.config.TrainConfig` JSON instead of the options
(what ``cerar train`` passes). ``--progress lines`` prints progress lines of kind ``train``
(:mod:`cerar.harness.progress`: step, steps, loss) on rank 0 for a launcher to follow; ``bar``
shows a tqdm bar; ``none`` is silent. The process starts and stops as every rank does
(:func:`cerar.harness.rank.rank_process`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from cerar._files import atomic_write_text
from cerar.experiments.train.config import TrainConfig, add_config_arguments, config_from_args
from cerar.experiments.train.loop import train
from cerar.harness.progress import print_progress
from cerar.harness.rank import exit_rank, rank_process

#: The kind of this worker's progress lines (see :mod:`cerar.harness.progress`).
PROGRESS_KIND = "train"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m cerar.experiments.train.worker", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--config", type=Path, default=None, help="a TrainConfig JSON (overrides the options)")
    parser.add_argument(
        "--method",
        default="allreduce",
        help="allreduce, ring, cerar[:c|:kN], fp16, bf16, powersgd[:r[:startK]], or a schedule around one: "
        "accum:K[:<method>], localsgd:H[:<method>], diloco:H[:lrX][:<method>]",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="rank 0 writes the run's JSON here")
    parser.add_argument("--progress", choices=("bar", "lines", "none"), default=None)
    parser.add_argument("--timeout-s", type=float, default=300.0, help="Gloo timeout for one collective")
    add_config_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one rank."""
    args = build_parser().parse_args(argv)
    with rank_process(args.timeout_s) as me:
        if args.config is not None:
            config = TrainConfig.from_json(args.config.read_text())
        else:
            config = config_from_args(args, args.method, args.seed, me.world_size)
        record = train(config, progress=_progress(args.progress, me.rank, config.label))
        records: list[Any] = [None] * me.world_size
        dist.all_gather_object(records, record)
        if me.rank == 0:
            out = {"config": config.to_dict(), "label": config.label, "world_size": me.world_size, "ranks": records}
            atomic_write_text(args.out, json.dumps(out))
    return 0


def _progress(kind: str | None, rank: int, label: str) -> Any:
    if rank != 0:
        return None
    kind = kind or ("bar" if sys.stderr.isatty() else "none")
    if kind == "lines":

        def line(step: int, steps: int, loss: float) -> None:
            print_progress(PROGRESS_KIND, step, steps, f"{loss:.4f}")

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
    exit_rank(main)
