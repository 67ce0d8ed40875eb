"""Summaries of training runs: per-run figures, the noise yardstick, the summary table.

A run's JSON (written by :mod:`cerar.experiments.train.worker`) holds every rank's record; figures here are
means over ranks (ranks move in lock-step, so their step times agree closely) and over steps,
leaving out the first :data:`SKIP_STEPS` steps (DDP's bucket rebuild and first-touch costs).

The noise yardstick is the spread (max - min) of the final validation loss over the
``allreduce`` runs with different seeds: a method whose final loss differs from
``allreduce``'s by less than that is indistinguishable from it in this experiment.

Predicted saving per step of a method against ``allreduce`` (or ``ring``) in the slow regime:
``(bytes_baseline - bytes_method) / link_rate``, from the bytes each rank sends per step and
the link rate measured by the launcher's probe. The issue's goal is a measured step-time
saving of at least 70% of that.

A bucket sweep (``--bucket-cap-mb 1,4,16``) runs every method at every bucket size; each method
(with its parameter, e.g. ``cerar-c8``) is then also reported at its *best* bucket size, the one
with the lowest mean step time over its seeds (:func:`best_buckets`), which is how a user would
tune it. The target validation loss is the tuned exact baseline's (:func:`default_target`:
``allreduce`` at its best bucket size), so "time to target" is time to quality against a tuned
uncompressed baseline. With one bucket size all of this is the plain per-run report.

Every method trains on the same tokens per optimizer step (``N x batch_size x seq_len``; ``accum:K``
splits them into micro-batches), so bytes per token are bytes per step over the rank's
``batch_size x seq_len``. ``localsgd``/``diloco``'s averages block after the optimizer step: their
time (``sync_s``) counts as exposed communication (and not as optimizer time), and the replica
divergence measured right after each of them is :attr:`RunSummary.post_sync_divergence`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from cerar.experiments.train.config import TrainConfig

__all__ = [
    "RunSummary",
    "at_best",
    "baseline_bucket",
    "best_buckets",
    "compare",
    "default_target",
    "fmt",
    "format_table",
    "noise_spread",
    "summarize_run",
]

SKIP_STEPS = 2


@dataclass(frozen=True)
class RunSummary:
    """Figures of one run (per step: means over ranks and over steps after the first two)."""

    label: str
    method: str
    name: str
    bucket_cap_mb: float
    seed: int
    world_size: int
    description: str
    final_val_loss: float
    time_to_target_s: float | None
    train_time_s: float
    step_s: float
    forward_s: float
    backward_compute_s: float
    exposed_comm_s: float
    backward_rest_s: float
    optimizer_s: float
    bytes_per_step: float
    bytes_measured: bool
    collectives_per_step: float
    encode_s_per_step: float
    decode_s_per_step: float
    cpu_s_per_step: float | None
    max_divergence: float
    final_divergence: float
    exact_final_divergence: float | None
    divergence_where: str
    load_average: float | None
    nonfinite_events: int
    fallbacks: int
    resyncs: int
    rescales: int
    skipped_steps: int
    parameters: int
    family: str
    setting: str
    tokens_per_step: int
    tokens: int
    bytes_per_token: float
    syncs_per_step: float
    sync_s: float
    averages: int
    post_sync_divergence: float | None
    peak_rss_bytes: int | None = None  # the largest rank's peak resident memory
    feedback_bytes: int = 0  # error feedback's residuals on the rank holding most

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def summarize_run(run: dict[str, Any], target: float | None) -> RunSummary:
    """Summarise one run's JSON; ``target`` is the validation loss for :attr:`time_to_target_s`."""
    ranks = run["ranks"]
    first = ranks[0]

    def per_step(key: str) -> float:
        return _mean([_mean([s[key] for s in r["steps"][SKIP_STEPS:] or r["steps"]]) for r in ranks])

    def all_steps(key: str, missing: float = 0.0) -> float:
        return _mean([_mean([s.get(key, missing) for s in r["steps"]]) for r in ranks])

    def per_step_or(key: str, missing: float) -> float:  # figures that older records lack
        return _mean([_mean([s.get(key, missing) for s in r["steps"][SKIP_STEPS:] or r["steps"]]) for r in ranks])

    evals = first["evals"]  # validation loss and divergence are the same on every rank
    time_to_target = None
    if target is not None:
        reached = [e for e in evals if e["val_loss"] <= target]
        time_to_target = _mean([_time_at(r["evals"], reached[0]["step"]) for r in ranks]) if reached else None
    backward = per_step("backward_s")
    compute = per_step("backward_compute_s")
    exposed = per_step("exposed_comm_s")
    sync_s = per_step_or("sync_s", 0.0)
    counters = [r["counters"] for r in ranks]
    config = TrainConfig.from_dict(run["config"])
    bytes_per_step = all_steps("bytes_sent")
    averages = (first.get("method_info") or {}).get("syncs") or []
    return RunSummary(
        label=run["label"],
        method=first["method"],
        name=config.name,
        bucket_cap_mb=float(config.bucket_cap_mb),  # type: ignore[arg-type]  # one run: one size
        seed=int(run["config"]["seed"]),
        world_size=int(run["world_size"]),
        description=first["description"],
        final_val_loss=evals[-1]["val_loss"],
        time_to_target_s=time_to_target,
        train_time_s=_mean([r["train_time_s"] for r in ranks]),
        step_s=per_step("step_s"),
        forward_s=per_step("forward_s"),
        backward_compute_s=compute,
        exposed_comm_s=exposed + sync_s,
        backward_rest_s=max(0.0, backward - compute - exposed),
        optimizer_s=max(0.0, per_step("optimizer_s") - sync_s),
        bytes_per_step=bytes_per_step,
        bytes_measured=bool(first["bytes_measured"]),
        collectives_per_step=all_steps("collectives"),
        encode_s_per_step=all_steps("encode_s"),
        decode_s_per_step=all_steps("decode_s"),
        cpu_s_per_step=per_step("cpu_s") if all("cpu_s" in s for r in ranks for s in r["steps"]) else None,
        max_divergence=max(e["divergence"] for e in evals),
        final_divergence=evals[-1]["divergence"],
        exact_final_divergence=(first.get("final_divergence") or {}).get("exact"),
        divergence_where=", ".join(
            f"{d['name']} {d['share']:.1e}" for d in (first.get("final_divergence") or {}).get("largest", [])[:2]
        ),
        load_average=_load(run),
        nonfinite_events=int(max(c["nonfinite_events"] for c in counters)),
        fallbacks=int(max(c["fallbacks"] for c in counters)),
        resyncs=int(max(c["resyncs"] for c in counters)),
        rescales=int(max(c.get("rescales", 0) for c in counters)),
        skipped_steps=int(max(r["skipped_steps"] for r in ranks)),
        parameters=int(first["parameters"]),
        family=config.family,
        setting=config.setting,
        tokens_per_step=int(run["world_size"]) * config.batch_size * config.model.seq_len,
        tokens=int(run["world_size"]) * config.batch_size * config.model.seq_len * config.steps,
        bytes_per_token=bytes_per_step / (config.batch_size * config.model.seq_len),
        syncs_per_step=all_steps("syncs", 1.0),  # a DDP hook: one per step
        sync_s=sync_s,
        averages=len(averages),
        post_sync_divergence=max((a["divergence"] for a in averages), default=None),
        peak_rss_bytes=max((r["memory"]["peak_rss_bytes"] for r in ranks if "memory" in r), default=None),
        feedback_bytes=max((r["memory"]["feedback_bytes"] for r in ranks if "memory" in r), default=0),
    )


def _load(run: dict[str, Any]) -> float | None:
    launch = run.get("launch") or {}
    values = [launch[k] for k in ("load_average_before", "load_average_after") if k in launch]
    return _mean(values) if values else None


def _time_at(evals: list[dict[str, float]], step: float) -> float:
    return next(e["train_time_s"] for e in evals if e["step"] == step)


def noise_spread(summaries: Sequence[RunSummary], method: str = "allreduce") -> float | None:
    """max - min final validation loss over ``method``'s seeds (None with fewer than two)."""
    losses = [s.final_val_loss for s in summaries if s.method == method]
    return max(losses) - min(losses) if len(losses) >= 2 else None


def best_buckets(summaries: Sequence[RunSummary]) -> dict[str, float]:
    """Each method's (:attr:`RunSummary.name`) best bucket size: the lowest step time averaged
    over its seeds (ties: the smaller size). With one size, that size."""
    times: dict[str, dict[float, list[float]]] = {}
    for s in summaries:
        times.setdefault(s.name, {}).setdefault(s.bucket_cap_mb, []).append(s.step_s)
    return {name: min(by_cap, key=lambda cap: (_mean(by_cap[cap]), cap)) for name, by_cap in times.items()}


def at_best(summaries: Sequence[RunSummary], best: dict[str, float]) -> list[RunSummary]:
    """The runs at their method's best bucket size (every seed of it)."""
    return [s for s in summaries if best.get(s.name) == s.bucket_cap_mb]


def _tuned_exact(summaries: Sequence[RunSummary]) -> list[RunSummary]:
    """The ``allreduce`` runs at allreduce's best bucket size (DDP's, ``hsdp:``'s or ``group:``'s:
    their names differ, their method is the same)."""
    return [s for s in at_best(summaries, best_buckets(summaries)) if s.method == "allreduce"]


def baseline_bucket(summaries: Sequence[RunSummary]) -> float | None:
    """The tuned exact baseline's bucket size; None without an ``allreduce`` run."""
    tuned = _tuned_exact(summaries)
    return tuned[0].bucket_cap_mb if tuned else None


def default_target(summaries: Sequence[RunSummary]) -> float | None:
    """The tuned exact baseline's quality: mean final validation loss of the ``allreduce`` runs
    at allreduce's best bucket size plus their seed spread (at least 0.01 nats), i.e. "as good
    as a tuned allreduce, within noise". ``None`` without allreduce runs."""
    finals = [s.final_val_loss for s in _tuned_exact(summaries)]
    if not finals:
        return None
    return _mean(finals) + max(0.01, max(finals) - min(finals))


def compare(
    summaries: Sequence[RunSummary],
    link_rate_bytes_per_s: float | None,
    baseline: str = "allreduce",
    only: Sequence[str] | None = None,
    same_bucket: bool = True,
) -> list[dict[str, Any]]:
    """Each run (of the methods in ``only``, default all) against ``baseline``'s run with the
    same seed (and, with ``same_bucket``, the same bucket size; pass the runs at their best
    buckets and ``same_bucket=False`` for tuned against tuned): loss difference, measured and
    predicted step-time saving, and their ratio (``None`` where there is no link rate)."""
    rows = []

    def key(s: RunSummary) -> tuple[int, float | None]:
        return (s.seed, s.bucket_cap_mb if same_bucket else None)

    base_by_seed = {key(s): s for s in summaries if s.method == baseline}
    for s in summaries:
        base = base_by_seed.get(key(s))
        if base is None or s.method == baseline or (only is not None and s.method not in only):
            continue
        measured = base.step_s - s.step_s
        predicted = None
        if link_rate_bytes_per_s:
            predicted = (base.bytes_per_step - s.bytes_per_step) / link_rate_bytes_per_s
        ratio = measured / predicted if predicted and abs(predicted) > 1e-12 else None
        rows.append(
            {
                "label": s.label,
                "baseline": base.label,
                "val_loss_diff": s.final_val_loss - base.final_val_loss,
                "byte_ratio": s.bytes_per_step / base.bytes_per_step if base.bytes_per_step else None,
                "measured_saving_s": measured,
                "predicted_saving_s": predicted,
                "saving_ratio": ratio,
            }
        )
    return rows


def fmt(value: float | None, spec: str) -> str:
    """``value`` formatted with ``spec``, or ``-`` for None and NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def format_table(
    summaries: Sequence[RunSummary],
    *,
    target: float | None,
    spread: float | None,
    comparisons: Sequence[dict[str, Any]] = (),
    link_rate_bytes_per_s: float | None = None,
    target_rule: str = "allreduce's mean final loss plus its seed spread",
) -> str:
    """The summary table as text (also valid Markdown)."""
    header = (
        "| run | final val loss | time to target (s) | train time (s) | step (ms) | exposed comm (ms) "
        "| CPU/step (ms) | coding/step (ms) | bytes/step (MB) | bytes/token | syncs/step | max divergence "
        "| non-finite | resyncs | rescales |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for s in summaries:
        kind = "measured" if s.bytes_measured else "computed"
        lines.append(
            f"| {s.label} | {s.final_val_loss:.4f} | {fmt(s.time_to_target_s, '.1f')} | {s.train_time_s:.1f} "
            f"| {1e3 * s.step_s:.1f} | {1e3 * s.exposed_comm_s:.1f} | {fmt(_ms(s.cpu_s_per_step), '.1f')} "
            f"| {1e3 * (s.encode_s_per_step + s.decode_s_per_step):.1f} | {s.bytes_per_step / 1e6:.3f} ({kind}) "
            f"| {s.bytes_per_token:.1f} | {s.syncs_per_step:.3f} "
            f"| {s.max_divergence:.2e} | {s.nonfinite_events} | {s.resyncs} | {s.rescales} |"
        )
    notes = [
        "",
        f"target validation loss: {fmt(target, '.4f')} ({target_rule})",
        f"noise yardstick (allreduce, spread of final val loss over seeds): {fmt(spread, '.4f')}",
        _tokens_note(summaries),
    ]
    if link_rate_bytes_per_s:
        notes.append(f"link rate measured by the launcher's probe: {link_rate_bytes_per_s / 1e6:.1f} MB/s per rank")
    loads = [s.load_average for s in summaries if s.load_average is not None]
    if loads:
        notes.append(
            f"load average during the runs: {min(loads):.1f} .. {max(loads):.1f} on this machine's CPUs "
            "(above the ranks' own count, others competed for the CPUs and timings are noisier)"
        )
    drifting = [s for s in summaries if s.max_divergence > 0]
    for s in drifting:
        notes.append(
            f"replica divergence of {s.label}: exact at the end {fmt(s.exact_final_divergence, '.2e')}"
            f" (sketch {s.final_divergence:.2e}); largest in {s.divergence_where or '-'}"
        )
    for s in summaries:
        if s.averages:
            notes.append(
                f"replica divergence right after each of {s.label}'s {s.averages} averages: at most "
                f"{fmt(s.post_sync_divergence, '.2e')}"
            )
    for s in summaries:
        if s.peak_rss_bytes:
            held = ""
            if s.feedback_bytes:
                per_parameter = s.feedback_bytes / s.parameters
                held = f"; error feedback's residuals {s.feedback_bytes / 1e6:.2f} MB ({per_parameter:.2f} B/parameter)"
            peak = s.peak_rss_bytes / 2**20
            notes.append(f"memory of {s.label}: peak resident {peak:.0f} MiB per rank (largest){held}")
    if comparisons:
        notes += [
            "",
            "| run vs baseline | val loss diff | bytes ratio | step saving measured (ms) | predicted (ms) "
            "| measured/predicted |",
            "|---|---|---|---|---|---|",
        ]
        for c in comparisons:
            predicted = None if c["predicted_saving_s"] is None else 1e3 * c["predicted_saving_s"]
            notes.append(
                f"| {c['label']} vs {c['baseline']} | {c['val_loss_diff']:+.4f} | {fmt(c['byte_ratio'], '.3f')} "
                f"| {1e3 * c['measured_saving_s']:+.1f} | {fmt(predicted, '+.1f')} "
                f"| {fmt(c['saving_ratio'], '.2f')} |"
            )
    return "\n".join(lines + notes)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def _tokens_note(summaries: Sequence[RunSummary]) -> str:
    """How many tokens the runs trained on: one line if they all agree, else per run."""
    counts = {(s.tokens_per_step, s.tokens) for s in summaries}
    if len(counts) == 1:
        per_step, total = counts.pop()
        return f"tokens: {per_step:,} per optimizer step, {total:,} per run, the same for every run"
    return "tokens per step / per run: " + ", ".join(
        f"{s.label} {s.tokens_per_step:,} / {s.tokens:,}" for s in summaries
    )
