"""The training loop of one rank: DDP + a method's hook, AdamW with warm-up and cosine decay.

Per step it records the local loss, the phases' durations (forward; backward's compute;
exposed communication from the :class:`~cerar.experiments.train.timeline.Timeline`; the rest of
``backward()``; optimizer, re-sync included), the bytes this rank sent and the hook's
encode/decode time. Every ``eval_every`` steps (and after the last) it measures the validation
loss and :func:`cerar.comm.ddp.hooks.replica_divergence`; evaluation time is kept out of training time.

With ``accum:K`` a step runs ``K`` micro-batches, the first ``K - 1`` (forward and backward, under
``model.no_sync()``) counted in "forward"; ``localsgd``/``diloco`` average after the optimizer
step (:mod:`cerar.experiments.train.periodic`), their blocking averages recorded as ``sync_s``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from cerar.comm.ddp.hooks import replica_divergence
from cerar.experiments.train.config import TrainConfig
from cerar.experiments.train.data import Split, load_split, train_batch, validation_batch
from cerar.experiments.train.installed import InstalledHook
from cerar.experiments.train.methods import install
from cerar.experiments.train.model import build_model, lm_loss, parameter_groups
from cerar.experiments.train.parallel import build_parallel, no_buffer_sync
from cerar.experiments.train.periodic import install_schedule
from cerar.experiments.train.timeline import Timeline

__all__ = ["lr_factor", "train"]

Progress = Callable[[int, int, float], None]
#: The hook's counters recorded per step (as differences of the cumulative ones).
STEP_COUNTERS = ("bytes_sent", "collectives", "encode_s", "decode_s", "collective_wall_s", "syncs", "sync_s")



def lr_factor(step: int, config: TrainConfig) -> float:
    """Learning-rate multiplier at ``step``: linear warm-up, then cosine to ``min_lr_ratio``."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    span = max(1, config.steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def train(config: TrainConfig, progress: Progress | None = None, split: Split | None = None) -> dict[str, Any]:
    """Train on the initialised default process group; return this rank's record (a dict)."""
    if isinstance(config.bucket_cap_mb, tuple):
        raise ValueError(
            f"Argument 'bucket_cap_mb' of one run must be one size, not {config.bucket_cap_mb}: "
            "`cerar train --bucket-cap-mb 1,4,16` runs a sweep as one run per size."
        )
    rank, world_size = dist.get_rank(), dist.get_world_size()
    split = split if split is not None else load_split()
    module = build_model(config.model, config.seed)
    replicas = None  # the group the replicas are compared over (None: the world)
    if config.parallel != "ddp":  # through cerar's process group (DDP without a hook, or HSDP)
        model, hook, timeline, replicas = build_parallel(config, module, world_size)
    else:
        model = DistributedDataParallel(module, bucket_cap_mb=config.bucket_cap_mb, **no_buffer_sync())
        timeline = Timeline(module)
        installer = install if config.schedule is None else install_schedule
        hook = installer(config, model, timeline)
    optimizer = torch.optim.AdamW(
        parameter_groups(module, config.weight_decay), lr=config.lr, betas=(0.9, 0.95), eps=1e-8
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config))
    optimizer = hook.wrap_optimizer(module, optimizer)  # localsgd: torch's PostLocalSGDOptimizer
    val_tokens = validation_batch(split, config.eval_sequences, config.model.seq_len)[rank::world_size]

    steps: list[dict[str, float]] = []
    evals = [_evaluate(module, val_tokens, 0, 0.0, replicas)]
    train_time = 0.0  # evaluation is kept out of it
    before = hook.counters()
    for step in range(config.steps):
        tokens = train_batch(split, step, rank, world_size, config.batch_size, config.model.seq_len, config.seed)
        record = _step(model, module, tokens, optimizer, scheduler, hook, timeline, config)
        after = hook.counters()  # this step's share of the cumulative counters
        record.update({key: after[key] - before[key] for key in STEP_COUNTERS})
        before = after
        steps.append(record)
        train_time += record["step_s"]
        if (step + 1) % config.eval_every == 0 or step + 1 == config.steps:
            evals.append(_evaluate(module, val_tokens, step + 1, train_time, replicas))
        if progress is not None:
            progress(step + 1, config.steps, record["loss"])
    return {
        "final_divergence": _exact_divergence(module, replicas),
        "rank": rank,
        "world_size": world_size,
        "method": hook.name,
        "description": hook.description,
        "bytes_measured": hook.measured_bytes,
        "method_info": hook.extra,
        "parameters": sum(p.numel() for p in module.parameters()),
        "steps": steps,
        "evals": evals,
        "train_time_s": train_time,
        "skipped_steps": sum(1 for s in steps if not s["finite"]),
        "counters": hook.counters(),
        "memory": _memory(hook),
    }


def _memory(hook: Any) -> dict[str, int]:
    """This rank's peak resident memory (the process's, ``ru_maxrss``) and what error feedback's
    residuals hold (the DDP state's, or a schedule's averager's)."""
    import resource

    state, averager = getattr(hook, "state", None), getattr(getattr(hook, "sync", None), "averager", None)
    feedback = getattr(state, "feedback_bytes", 0)
    store = getattr(averager, "feedback", None)
    feedback += store.nbytes if store is not None else 0
    return {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "feedback_bytes": feedback}


def _step(
    model: torch.nn.Module,
    module: torch.nn.Module,
    tokens: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    hook: InstalledHook,
    timeline: Timeline,
    config: TrainConfig,
) -> dict[str, float]:
    """One optimizer step; return its loss and the phases' durations: forward; backward's
    compute; the communication left exposed after it; all of ``backward()``; the optimizer (the
    re-sync included); and the CPU time the rank's process spent in the step, all its threads
    (training, cerar's communication thread, Gloo's): where ranks share cores, a method's CPU
    beyond another's is taken from the ranks' compute, which the wall-clock phases show only
    through the noise of the scheduler."""
    timeline.begin()
    start, cpu_start = time.perf_counter(), time.process_time()
    earlier = 0.0
    if hook.micro_batches > 1:
        earlier, tokens = _accumulate(model, tokens, hook.micro_batches)
        loss = lm_loss(model, tokens) / hook.micro_batches
    else:
        loss = lm_loss(model, tokens)
    forward_end = time.perf_counter()
    loss.backward()  # the hook communicates bucket by bucket while backward still computes
    backward_end = time.perf_counter()
    compute_end = timeline.compute_end or backward_end
    exposed = timeline.exposed()
    clip = config.grad_clip if config.grad_clip > 0 else math.inf
    norm = torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
    finite = bool(torch.isfinite(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))  # FSDP2: a DTensor
    if finite:
        optimizer.step()  # else skip the update, as a loss scaler would (counted by the caller)
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    resynced = hook.after_step(module)
    end, cpu_end = time.perf_counter(), time.process_time()
    return {
        "loss": float(loss.detach()) + earlier,
        "step_s": end - start,
        "cpu_s": cpu_end - cpu_start,
        "forward_s": forward_end - start,
        "backward_compute_s": max(0.0, compute_end - forward_end),
        "exposed_comm_s": exposed,
        "backward_s": backward_end - forward_end,
        "optimizer_s": end - backward_end,
        "buckets": float(timeline.buckets),
        "finite": float(finite),
        "resynced": float(resynced),
        "lr": scheduler.get_last_lr()[0],
    }


def _accumulate(model: DistributedDataParallel, tokens: torch.Tensor, micro_batches: int) -> tuple[float, torch.Tensor]:
    """``accum:K``: forward and backward of the first ``K - 1`` micro-batches (equal slices of
    ``tokens``) without gradient sync, each loss divided by ``K`` so that the summed gradient is
    the batch's; return their losses' sum and the last micro-batch."""
    parts = tokens.chunk(micro_batches)
    earlier = 0.0
    with model.no_sync():
        for part in parts[:-1]:
            loss = lm_loss(model, part) / micro_batches
            loss.backward()
            earlier += float(loss.detach())
    return earlier, parts[-1]


def _exact_divergence(module: torch.nn.Module, group: Any = None, top: int = 4) -> dict[str, Any]:
    """Exact ``max_j ||theta_j - theta_0|| / ||theta_0||`` at the end of training (all parameters
    gathered: fine at this scale), and the tensors that contribute most to it. Checks the
    sketch estimate and shows *where* replicas drift (e.g. rows of unused byte embeddings,
    whose true gradient is 0: Adam's normalisation turns decode noise there into full steps)."""
    flat = torch.cat([_local(p).detach().reshape(-1) for p in module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, flat, group=group)
    reference = gathered[0].double()
    diffs = torch.stack([g.double() - reference for g in gathered])  # (N, P)
    norm0 = float(torch.linalg.vector_norm(reference))
    total = float(torch.linalg.vector_norm(diffs, dim=1).max()) / norm0
    per_tensor = []
    offset = 0
    for name, p in module.named_parameters():
        numel = _local(p).numel()
        part = diffs[:, offset : offset + numel]
        offset += numel
        per_tensor.append((float(torch.linalg.vector_norm(part, dim=1).max()) / norm0, name))
    per_tensor.sort(reverse=True)
    return {"exact": total, "largest": [{"name": n, "share": v} for v, n in per_tensor[:top] if v > 0]}


def _evaluate(
    module: torch.nn.Module, tokens: torch.Tensor, step: int, train_time: float, replicas: Any
) -> dict[str, float]:
    """Validation loss (each rank scores its own replica on its slice of the fixed validation
    set; the mean over all sequences is returned on every rank) and replica divergence (over
    ``replicas``: the ranks holding the same shards; None: the world)."""
    started = time.perf_counter()
    module.eval()
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for row in range(0, len(tokens), 8):
            batch = tokens[row : row + 8]
            total[0] += float(lm_loss(module, batch)) * len(batch)
            total[1] += len(batch)
    module.train()
    dist.all_reduce(total)
    divergence = replica_divergence(module, replicas)
    return {
        "step": float(step),
        "train_time_s": train_time,
        "val_loss": float(total[0] / total[1]),
        "divergence": divergence,
        "eval_s": time.perf_counter() - started,
    }


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's parameters), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
