"""The tuning budget of each method family: the settings tried, and the best of them.

A family is a method without its tuned settings
(:attr:`~cerar.experiments.train.config.TrainConfig.family`: ``diloco-h10`` and
``diloco-h25-lr0.5`` are both ``diloco``; ``diloco-h10-cerar-c8-fp16`` is ``diloco-cerar-c8-fp16``);
a setting is one method name at one bucket size, a full run with every seed it ran. So the budget
is what the command lists: ``--methods diloco:10 diloco:25 diloco:25:lr0.5`` tries three settings
of ``diloco``, and the table says so beside the best.

The best setting is the one that reaches the target validation loss soonest (mean time to
target over its seeds, every one of which must reach it); where none does, the one with the
lowest mean final validation loss (marked "not reached").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cerar.experiments.train.report import RunSummary, fmt

__all__ = ["family_rows", "format_families"]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def family_rows(summaries: Sequence[RunSummary]) -> list[dict[str, Any]]:
    """A row per family, in the order the families first appear: ``tried`` (settings), the
    ``settings``' names, the best one's figures (means over its seeds) and ``reached``."""
    families: dict[str, dict[tuple[str, float], list[RunSummary]]] = {}
    for s in summaries:
        families.setdefault(s.family, {}).setdefault((s.name, s.bucket_cap_mb), []).append(s)
    sweep = len({s.bucket_cap_mb for s in summaries}) > 1
    rows = []
    for family, settings in families.items():

        def score(key: tuple[str, float], settings: dict[tuple[str, float], list[RunSummary]] = settings) -> tuple:
            runs = settings[key]
            times = [r.time_to_target_s for r in runs]
            if all(t is not None for t in times):
                return (0, _mean(times))  # type: ignore[arg-type]
            return (1, _mean([r.final_val_loss for r in runs]))

        best = min(settings, key=score)
        runs = settings[best]
        reached = score(best)[0] == 0
        divergences = [r.post_sync_divergence for r in runs if r.post_sync_divergence is not None]
        rows.append(
            {
                "family": family,
                "tried": len(settings),
                "settings": [_setting_label(name, cap, sweep) for name, cap in settings],
                "best": _setting_label(*best, sweep),
                "best_labels": [r.label for r in runs],
                "setting": runs[0].setting,
                "reached": reached,
                "time_to_target_s": score(best)[1] if reached else None,
                "final_val_loss": _mean([r.final_val_loss for r in runs]),
                "tokens": runs[0].tokens,
                "step_s": _mean([r.step_s for r in runs]),
                "bytes_per_step": _mean([r.bytes_per_step for r in runs]),
                "bytes_per_token": _mean([r.bytes_per_token for r in runs]),
                "syncs_per_step": _mean([r.syncs_per_step for r in runs]),
                "exposed_comm_s": _mean([r.exposed_comm_s for r in runs]),
                "post_sync_divergence": max(divergences) if divergences else None,
            }
        )
    return rows


def _setting_label(name: str, cap: float, sweep: bool) -> str:
    return f"{name} @ {cap:g} MB" if sweep else name


def format_families(rows: Sequence[dict[str, Any]], target: float | None) -> str:
    """The family table as text (also valid Markdown)."""
    lines = [
        f"each method family at its best tried setting (soonest to the target {fmt(target, '.4f')}; "
        "else the lowest final loss):",
        "",
        "| family | settings tried | best | time to target (s) | final val loss | step (ms) | bytes/step (MB) "
        "| bytes/token | syncs/step | exposed comm (ms) | post-sync divergence |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        time_to_target = fmt(row["time_to_target_s"], ".1f") if row["reached"] else "not reached"
        setting = "" if row["setting"] == "-" else f" ({row['setting']})"
        lines.append(
            f"| {row['family']} | {row['tried']} | {row['best']}{setting} | {time_to_target} "
            f"| {row['final_val_loss']:.4f} | {1e3 * row['step_s']:.1f} | {row['bytes_per_step'] / 1e6:.3f} "
            f"| {row['bytes_per_token']:.1f} | {row['syncs_per_step']:.3f} | {1e3 * row['exposed_comm_s']:.1f} "
            f"| {fmt(row['post_sync_divergence'], '.2e')} |"
        )
    tried = "; ".join(f"{row['family']}: {', '.join(row['settings'])}" for row in rows if row["tried"] > 1)
    if tried:
        lines += ["", f"settings tried (each a full run): {tried}"]
    return "\n".join(lines)
