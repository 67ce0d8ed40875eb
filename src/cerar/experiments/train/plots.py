"""PNG figures of training runs: validation loss against step and against training time, and
each run's step-time breakdown. Matplotlib's Agg backend: no display needed."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cerar.experiments._extras import pyplot
from cerar.experiments.train.report import RunSummary

__all__ = ["plot_breakdown", "plot_loss"]


def plot_loss(runs: Sequence[dict[str, Any]], path: Path, *, target: float | None = None) -> Path:
    """Validation loss vs step (left) and vs training wall-clock, evaluation excluded (right), of
    every run: allreduce dashed, the communication-avoiding schedules dash-dotted."""
    plt = pyplot("train")
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for run in runs:
        evals = run["ranks"][0]["evals"]
        steps = [e["step"] for e in evals]
        times = [e["train_time_s"] for e in evals]
        losses = [e["val_loss"] for e in evals]
        method = run["ranks"][0]["method"]
        style = "--" if method == "allreduce" else "-." if method in ("accum", "localsgd", "diloco") else "-"
        by_step.plot(steps, losses, style, marker=".", label=run["label"])
        by_time.plot(times, losses, style, marker=".", label=run["label"])
    for axis in (by_step, by_time):
        if target is not None:
            axis.axhline(target, color="grey", linewidth=0.8, linestyle=":")
        axis.grid(alpha=0.3)
    world_size = runs[0]["world_size"] if runs else "?"
    by_step.set(xlabel="step", ylabel="validation loss (nats/byte)", title=f"validation loss, N = {world_size}")
    by_time.set(xlabel="training time (s, evaluation excluded)", title="against wall-clock")
    by_time.legend(fontsize=8)
    # The early steps dwarf the differences that matter: show the second half of the range.
    finals = [r["ranks"][0]["evals"][-1]["val_loss"] for r in runs]
    if finals:
        top = max(e["val_loss"] for r in runs for e in r["ranks"][0]["evals"][1:2] or r["ranks"][0]["evals"])
        by_step.set_ylim(min(finals) - 0.05, max(min(top, max(finals) + 0.6), max(finals) + 0.05))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_breakdown(summaries: Sequence[RunSummary], path: Path) -> Path:
    """Stacked mean step time per run: forward, backward compute, exposed communication, the
    rest of ``backward()`` (copying buckets back), optimizer (re-sync included)."""
    plt = pyplot("train")
    parts = [
        ("forward", "forward_s"),
        ("backward compute", "backward_compute_s"),
        ("exposed communication", "exposed_comm_s"),
        ("rest of backward", "backward_rest_s"),
        ("optimizer", "optimizer_s"),
    ]
    labels = [s.label for s in summaries]
    fig, axis = plt.subplots(figsize=(max(6.0, 1.2 * len(labels) + 2), 4.2))
    bottom = [0.0] * len(summaries)
    for name, key in parts:
        values = [1e3 * getattr(s, key) for s in summaries]
        axis.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    axis.set(ylabel="ms per step (mean over ranks)", title="step-time breakdown")
    axis.legend(fontsize=8)
    axis.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
