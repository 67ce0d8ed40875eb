"""The bucket sweep of ``cerar train --bucket-cap-mb 1,4,16``: the full grid and each method at
its best bucket size.

Every method runs at every bucket size on the same data with the same seeds. A bucket size
trades overlap with backward (small buckets start communicating early) against fixed costs per
call (a method with a large fixed cost, as CERAR's rounds and per-call agreement, wants large
buckets), so each method is compared at its own best size, as a user would tune it: seed 003's
rule, time to quality against a *tuned* exact baseline. The best size is the one with the lowest
mean step time (:func:`cerar.experiments.train.report.best_buckets`); the target loss is the
tuned allreduce's (:func:`cerar.experiments.train.report.default_target`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cerar.experiments.train.report import RunSummary, at_best, compare, fmt

__all__ = ["format_sweep", "sweep_summary"]

#: The figures of each run in the grid (and of each method at its best size).
GRID_FIELDS = ("step_s", "final_val_loss", "bytes_per_step", "bytes_measured", "time_to_target_s")


def sweep_summary(
    summaries: Sequence[RunSummary], best: dict[str, float], link_rate_bytes_per_s: float | None
) -> dict[str, Any]:
    """The sweep's JSON: ``bucket_caps_mb``, ``best_bucket_mb`` (per method), ``grid`` (a row per
    run), ``best`` (a row per method and seed at its best size, with its ratios to the tuned
    allreduce of the same seed) and ``comparisons`` (tuned against tuned allreduce and, for
    cerar, tuned ring)."""
    tuned = at_best(summaries, best)
    grid = [
        {
            "label": s.label,
            "name": s.name,
            "seed": s.seed,
            "bucket_cap_mb": s.bucket_cap_mb,
            "best": best.get(s.name) == s.bucket_cap_mb,
            **{key: getattr(s, key) for key in GRID_FIELDS},
        }
        for s in summaries
    ]
    baseline = {s.seed: s for s in tuned if s.method == "allreduce"}
    rows = []
    for s in tuned:
        base = baseline.get(s.seed)
        rows.append(
            {
                "label": s.label,
                "name": s.name,
                "seed": s.seed,
                "best_bucket_mb": s.bucket_cap_mb,
                **{key: getattr(s, key) for key in GRID_FIELDS},
                "baseline": None if base is None else base.label,
                "step_vs_tuned_allreduce": _ratio(s.step_s, None if base is None else base.step_s),
                "time_to_target_vs_tuned_allreduce": _ratio(
                    s.time_to_target_s, None if base is None else base.time_to_target_s
                ),
            }
        )
    comparisons = compare(tuned, link_rate_bytes_per_s, same_bucket=False) + compare(
        tuned, link_rate_bytes_per_s, baseline="ring", only=("cerar",), same_bucket=False
    )
    return {
        "bucket_caps_mb": sorted({s.bucket_cap_mb for s in summaries}),
        "best_bucket_mb": best,
        "grid": grid,
        "best": rows,
        "comparisons": comparisons,
    }


def _ratio(value: float | None, base: float | None) -> float | None:
    return value / base if value is not None and base else None


def format_sweep(sweep: dict[str, Any]) -> str:
    """The grid (a row per method and seed, a column per bucket size) and the best-size table,
    as text (also valid Markdown)."""
    caps = sweep["bucket_caps_mb"]
    header = "| run | " + " | ".join(f"{cap:g} MB buckets" for cap in caps) + " |"
    lines = [
        "bucket sweep: step time (ms) / final val loss / bytes per step (MB); * the method's best size",
        "",
        header,
        "|" + "---|" * (len(caps) + 1),
    ]
    cells: dict[tuple[str, int], dict[float, str]] = {}
    for row in sweep["grid"]:
        mark = " *" if row["best"] else ""
        cells.setdefault((row["name"], row["seed"]), {})[row["bucket_cap_mb"]] = (
            f"{1e3 * row['step_s']:.1f} / {row['final_val_loss']:.4f} / {row['bytes_per_step'] / 1e6:.3f}{mark}"
        )
    for (name, seed), by_cap in cells.items():
        lines.append(f"| {name}-s{seed} | " + " | ".join(by_cap.get(cap, "-") for cap in caps) + " |")
    lines += [
        "",
        "each method at its best bucket size (lowest mean step time), against the tuned allreduce:",
        "",
        "| run | best bucket (MB) | step (ms) | step / tuned allreduce | final val loss | time to target (s) "
        "| time to target / tuned allreduce | bytes/step (MB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in sweep["best"]:
        lines.append(
            f"| {row['label']} | {row['best_bucket_mb']:g} | {1e3 * row['step_s']:.1f} "
            f"| {fmt(row['step_vs_tuned_allreduce'], '.3f')} | {row['final_val_loss']:.4f} "
            f"| {fmt(row['time_to_target_s'], '.1f')} | {fmt(row['time_to_target_vs_tuned_allreduce'], '.3f')} "
            f"| {row['bytes_per_step'] / 1e6:.3f} |"
        )
    if sweep["comparisons"]:
        lines += ["", "| tuned run vs tuned baseline | val loss diff | step saving measured (ms) | predicted (ms) |"]
        lines.append("|---|---|---|---|")
        for c in sweep["comparisons"]:
            predicted = None if c["predicted_saving_s"] is None else 1e3 * c["predicted_saving_s"]
            lines.append(
                f"| {c['label']} vs {c['baseline']} | {c['val_loss_diff']:+.4f} "
                f"| {1e3 * c['measured_saving_s']:+.1f} | {fmt(predicted, '+.1f')} |"
            )
    return "\n".join(lines)
