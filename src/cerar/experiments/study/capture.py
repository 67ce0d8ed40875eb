"""Capture real per-rank gradients of the ``cerar train`` model at chosen points of training.

The accuracy study (:mod:`cerar.experiments.study.gradients`) needs what an all-reduce really receives: the
``N`` local gradients of one step, each computed on its rank's own batch, before any averaging.
This module trains the GPT-NeoX model of ``cerar train`` data-parallel with *exact* averaging
(DDP's built-in all-reduce), with the same data partition and order (:func:`cerar.experiments.train.data.train_batch`),
optimiser (AdamW, Pythia's decay groups, betas ``(0.9, 0.95)``), learning-rate schedule
(:func:`cerar.experiments.train.loop.lr_factor`) and gradient clipping as :func:`cerar.experiments.train.loop.train`.
At each capture step ``s`` every rank computes its local flattened gradient on its batch of step
``s`` with the parameters held *before* update ``s`` (:func:`cerar.experiments.train.model.local_gradient`,
no communication) and rank 0 gathers them. Step ``steps`` (after the last update) is a valid
capture step: it uses the batch that step ``steps`` would train on.

Three ways to run it:

* :func:`capture_rank`: in a process that already joined a process group (tests use it with
  ``tests/multirank.run_ranks``);
* ``python -m cerar.experiments.study.capture --out PATH ...``: one rank under :func:`cerar.harness.launch.launch`
  or ``torchrun`` (rendezvous from ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``);
  rank 0 writes the ``.npz``;
* :func:`capture_gradients`: launches that command on ``N`` local ranks (fast regime) and loads
  the result.

The ``.npz`` file, :class:`Capture` and its parameter layout: :mod:`cerar.experiments.study.capture_file`
(this module re-exports them).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cerar._checks import check_float, check_int
from cerar.experiments.study.capture_file import (
    Capture,
    check_parameters,
    check_path,
    load_capture,
    model_parameters,
    parameter_layout,
    save_capture,
)
from cerar.experiments.train.config import ModelConfig, TrainConfig, add_config_arguments, config_from_args

__all__ = [
    "Capture",
    "capture_gradients",
    "capture_rank",
    "check_capture_steps",
    "check_parameters",
    "default_capture_steps",
    "load_capture",
    "main",
    "model_parameters",
    "parameter_layout",
    "save_capture",
]


def default_capture_steps(steps: int) -> tuple[int, ...]:
    """Start, middle and end of a run of ``steps`` updates: ``(0, steps // 2, steps)``."""
    steps = check_int("steps", steps, minimum=1)
    return tuple(sorted({0, steps // 2, steps}))


def check_capture_steps(capture_steps: Sequence[int], steps: int) -> tuple[int, ...]:
    """``capture_steps`` as a sorted tuple after checking each is an integer in ``[0, steps]``
    and that none repeats."""
    if isinstance(capture_steps, (str, bytes)) or not isinstance(capture_steps, Sequence):
        raise TypeError(f"Argument 'capture_steps' must be a sequence of integers, not {capture_steps!r}.")
    if not capture_steps:
        raise ValueError(f"Argument 'capture_steps' must hold at least one step, not {capture_steps!r}.")
    values = [check_int("capture_steps", s, minimum=0) for s in capture_steps]
    for value in values:
        if value > steps:
            raise ValueError(f"Argument 'capture_steps' must hold steps of at most steps={steps}, not {value}.")
    if len(set(values)) != len(values):
        raise ValueError(f"Argument 'capture_steps' must not repeat a step, not {list(capture_steps)!r}.")
    return tuple(sorted(values))


# ---------------------------------------------------------------------------------------------
# One rank
def capture_rank(
    config: TrainConfig,
    capture_steps: Sequence[int],
    progress: Callable[[int, int, float], None] | None = None,
) -> Capture | None:
    """Train on the initialised default process group and capture local gradients.

    Args:
        config: the run (``config.method`` is ignored: averaging is always DDP's exact one).
        capture_steps: steps in ``[0, config.steps]`` at which to capture.
        progress: called on rank 0 as ``progress(step, steps, loss)`` after every update.

    Returns:
        On rank 0 the :class:`Capture` of every rank; ``None`` on the other ranks.
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from cerar.experiments.train.data import load_split, train_batch
    from cerar.experiments.train.loop import lr_factor
    from cerar.experiments.train.model import build_model, lm_loss, local_gradient, parameter_groups
    from cerar.experiments.train.parallel import no_buffer_sync

    if not isinstance(config, TrainConfig):
        raise TypeError(f"Argument 'config' must be a TrainConfig, not {type(config).__name__}.")
    wanted = check_capture_steps(capture_steps, config.steps)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    split = load_split()
    module = build_model(config.model, config.seed)
    model = DistributedDataParallel(module, bucket_cap_mb=config.bucket_cap_mb, **no_buffer_sync())
    optimizer = torch.optim.AdamW(
        parameter_groups(module, config.weight_decay), lr=config.lr, betas=(0.9, 0.95), eps=1e-8
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config))

    def batch(step: int) -> torch.Tensor:
        return train_batch(split, step, rank, world_size, config.batch_size, config.model.seq_len, config.seed)

    gathered: list[np.ndarray] = []
    losses: list[np.ndarray] = []
    for step in range(config.steps + 1):
        if step in wanted:
            tokens = batch(step)
            gradient = local_gradient(module, tokens).detach().float().contiguous()
            with torch.no_grad():
                loss = torch.tensor([float(lm_loss(module, tokens))])
            gathered.append(_gather(gradient, rank, world_size))
            losses.append(_gather(loss, rank, world_size)[:, 0])
        if step == config.steps:
            break
        loss_value = lm_loss(model, batch(step))
        loss_value.backward()
        norm = torch.nn.utils.clip_grad_norm_(
            module.parameters(), config.grad_clip if config.grad_clip > 0 else math.inf
        )
        if bool(torch.isfinite(norm)):  # as the training loop: skip a non-finite update
            optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if progress is not None and rank == 0:
            progress(step + 1, config.steps, float(loss_value.detach()))
    if rank != 0:
        return None
    return Capture(
        steps=wanted,
        gradients=np.stack(gathered),
        losses=np.stack(losses),
        config=config,
        parameters=parameter_layout(module),
    )


def _gather(tensor: Any, rank: int, world_size: int) -> np.ndarray:
    """Rank 0 gets the ``(N, len)`` stack of every rank's 1-D ``tensor``; others an empty array."""
    import torch
    import torch.distributed as dist

    if rank == 0:
        rows = [torch.empty_like(tensor) for _ in range(world_size)]
        dist.gather(tensor, rows, dst=0)
        return torch.stack(rows).numpy()
    dist.gather(tensor, None, dst=0)
    return np.empty((0, tensor.numel()), dtype=np.float32)


# ---------------------------------------------------------------------------------------------
# Launching
def capture_gradients(
    world_size: int,
    steps: int,
    capture_steps: Sequence[int] | None,
    model_config: ModelConfig | None,
    out_path: Path | str,
    *,
    batch_size: int = 8,
    seed: int = 0,
    timeout_s: float = 1800.0,
    on_line: Callable[[int, str, str], None] | None = None,
) -> Capture:
    """Run the capture on ``world_size`` local ranks (:func:`cerar.harness.launch.launch`, fast regime),
    write it to ``out_path`` and return it.

    Args:
        world_size: ``N`` (at least 2).
        steps: training updates (the learning-rate schedule spans them, as in ``cerar train``).
        capture_steps: steps in ``[0, steps]``; ``None``: :func:`default_capture_steps`.
        model_config: the model (``None``: :class:`ModelConfig`'s default, 0.86 M parameters).
        out_path: the ``.npz`` to write.
        batch_size: sequences per rank per step.
        seed: initial weights and data order.
        timeout_s: limit for the ranks' run.
        on_line: forwarded to :func:`cerar.harness.launch.launch` (rank 0's progress lines are of
            kind ``capture``, see :mod:`cerar.harness.progress`: step, steps, loss).
    """
    from cerar.experiments.train.model import RANK_IMPORTS
    from cerar.harness.launch import launch

    world_size = check_int("world_size", world_size, minimum=2)
    steps = check_int("steps", steps, minimum=1)
    wanted = default_capture_steps(steps) if capture_steps is None else check_capture_steps(capture_steps, steps)
    model_config = ModelConfig() if model_config is None else model_config
    if not isinstance(model_config, ModelConfig):
        raise TypeError(f"Argument 'model_config' must be a ModelConfig, not {type(model_config).__name__}.")
    out_path = check_path(out_path)
    batch_size = check_int("batch_size", batch_size, minimum=1)
    seed = check_int("seed", seed, minimum=0)
    timeout_s = check_float("timeout_s", timeout_s, positive=True)
    argv = [
        sys.executable, "-m", "cerar.experiments.study.capture",
        "--out", str(out_path.resolve()),
        "--steps", str(steps),
        "--batch-size", str(batch_size),
        "--seed", str(seed),
        "--capture-steps", *[str(s) for s in wanted],
        "--layers", str(model_config.layers),
        "--hidden", str(model_config.hidden),
        "--heads", str(model_config.heads),
        "--seq-len", str(model_config.seq_len),
        "--rotary-pct", repr(model_config.rotary_pct),
        "--progress",
    ]  # fmt: skip
    # The warm-up must fit in short runs (TrainConfig's default is 30 steps).
    argv += ["--warmup-steps", str(min(TrainConfig().warmup_steps, max(steps // 10, 1)))]
    launch(argv, world_size, regime="fast", timeout_s=timeout_s, on_line=on_line, preload=RANK_IMPORTS)
    return load_capture(out_path)


#: The kind of this worker's progress lines (see :mod:`cerar.harness.progress`: step, steps, loss).
PROGRESS_KIND = "capture"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m cerar.experiments.study.capture",
        description="One rank: train with exact averaging and capture per-rank gradients.",
    )
    parser.add_argument("--out", type=Path, required=True, help="rank 0 writes the .npz here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--capture-steps", type=int, nargs="+", default=None,
                        help="steps in [0, steps] (default: 0, steps // 2, steps)")
    parser.add_argument("--progress", action="store_true", help="rank 0 prints progress lines of kind 'capture'")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="Gloo timeout for one collective")
    add_config_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of one rank (see the module docstring); started and stopped as every rank is
    (:func:`cerar.harness.rank.rank_process`)."""
    from cerar.harness.progress import print_progress
    from cerar.harness.rank import rank_process

    args = build_parser().parse_args(argv)
    with rank_process(args.timeout_s) as me:
        config = config_from_args(args, "allreduce", args.seed, me.world_size)
        wanted = default_capture_steps(config.steps) if args.capture_steps is None else args.capture_steps

        def report(step: int, steps: int, loss: float) -> None:
            print_progress(PROGRESS_KIND, step, steps, f"{loss:.4f}")

        capture = capture_rank(config, wanted, report if args.progress else None)
        if capture is not None:
            save_capture(capture, args.out)
            print(json.dumps({"out": str(args.out), "steps": list(capture.steps), "size": capture.size}))
    return 0


if __name__ == "__main__":
    from cerar.harness.rank import exit_rank

    exit_rank(main)
