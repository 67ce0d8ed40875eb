"""The training campaign behind ``cerar train``: every method on the same data, then the report.

For each run of a :class:`Campaign` (each method and, for ``allreduce``, each noise seed; each
at every bucket size of a sweep) :func:`run_campaign` launches ``N`` local ranks of
:mod:`cerar.experiments.train.worker` on a fast (loopback; forked from one process that imported
the model) or slow (rate-limited network namespaces) network, then writes under ``out``:

* ``runs/<label>.json``: every rank's per-step and per-evaluation record;
* ``summary.json``: the per-run summaries, comparisons, link rate and settings;
* ``loss.png`` (validation loss vs step and vs training time) and ``breakdown.png``;

and prints the summary table and each method family at its best tried setting
(:mod:`cerar.experiments.train.tuning`: ``diloco:10 diloco:25`` are two settings of ``diloco``).
A bucket sweep is reported as the full grid and, beside it, each method at its best size
against the tuned allreduce (:mod:`cerar.experiments.train.sweep`).

Runs are named by their method's own name (``allreduce-s0``, ``int8-s0``), whichever of its
names ``--methods`` gave (:data:`cerar.experiments.train.methods.ROW_NAMES`). The command
(:mod:`cerar.cli.train`) parses and checks the arguments into a :class:`Campaign` and calls
:func:`run_campaign`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cerar.experiments.train.config import TrainConfig

if TYPE_CHECKING:
    from cerar.harness.forked import Zygote

__all__ = ["DEFAULT_METHODS", "Campaign", "run_all", "run_campaign", "run_label", "summarize", "target_rule"]

#: ``cerar train``'s methods unless ``--methods`` is given: the exact baseline, CERAR at two
#: ``c``, torch's fp16 hook, the int8 ring and the 4-bit direct shape (the methods for slow
#: links) and PowerSGD.
DEFAULT_METHODS = ("exact", "cerar:2N", "cerar:3N", "torch-fp16", "ring-int8", "direct-int4", "powersgd")


@dataclass(frozen=True)
class Campaign:
    """What ``cerar train`` runs, its arguments checked (:func:`cerar.cli.train.plan_runs` and
    ``check_launch``): the runs in order and the network and outputs they share.

    Attributes:
        configs: every run, in order (a sweep's: one per bucket size).
        world_size, nodes, ranks_per_node: ``N = M x G`` ranks, ``G`` to an emulated node.
        regime, rate, delay: the network (``"fast"``: loopback; ``"slow"``: ``rate`` per link).
        target_loss: the validation loss of "time to target" (None: the tuned allreduce's).
        out: the output folder.
        timeout_s: the limit of each run.
        no_plots: skip the PNG figures.
        reuse: reuse ``runs/<label>.json`` from an earlier run with the same settings.
        print_json: print the summary JSON instead of the tables.
    """

    configs: tuple[TrainConfig, ...]
    world_size: int
    nodes: int
    ranks_per_node: int
    regime: str
    rate: str
    delay: str
    target_loss: float | None
    out: Path
    timeout_s: float
    no_plots: bool = False
    reuse: bool = False
    print_json: bool = False


def run_label(config: TrainConfig, configs: list[TrainConfig] | tuple[TrainConfig, ...]) -> str:
    """``config.label``, or in a bucket sweep (several sizes among ``configs``) ``bucket_label``."""
    sweep = len({c.bucket_cap_mb for c in configs}) > 1
    return config.bucket_label if sweep else config.label


def run_campaign(campaign: Campaign) -> int:
    """Run every run of ``campaign``, write ``summary.json`` (and the figures), print the report;
    return the command's exit status."""
    _require_extras(campaign)  # before any run: a missing extra should not cost a run's time
    if campaign.regime == "slow":
        from cerar.harness.netem import unavailable_reason

        reason = unavailable_reason()
        if reason is not None:
            raise ValueError(f"Argument 'regime' 'slow' is unavailable here: {reason}.")
    configs = list(campaign.configs)
    started = time.perf_counter()
    runs, link_rates, reused_wall_s = run_all(configs, campaign)
    wall_s = time.perf_counter() - started + reused_wall_s  # reused runs count their own time
    summary, summaries = summarize(campaign, configs, runs, link_rates, wall_s)
    (campaign.out / "summary.json").write_text(json.dumps(summary, indent=2))
    if not campaign.no_plots:
        from cerar.experiments.train.plots import plot_breakdown, plot_loss

        plot_loss(runs, campaign.out / "loss.png", target=summary["target_val_loss"])
        plot_breakdown(summaries, campaign.out / "breakdown.png")
    if campaign.print_json:
        print(json.dumps(summary, indent=2))
        return 0
    _print_summary(campaign, configs[0], summary, summaries)
    _print_tables(summary, summaries)
    print(f"\nwrote {campaign.out / 'summary.json'}" + ("" if campaign.no_plots else ", loss.png, breakdown.png"))
    return 0


def summarize(
    campaign: Campaign, configs: list[TrainConfig], runs: list[dict[str, Any]], link_rates: list[float],
    wall_s: float,
) -> tuple[dict[str, Any], list[Any]]:  # fmt: skip
    """The summary JSON and the per-run summaries: the target loss is the (tuned) allreduce's
    unless given, the noise spread over the tuned allreduce's seeds; a sweep adds ``sweep``."""
    from cerar.experiments.train import report
    from cerar.experiments.train.tuning import family_rows

    link_rate = sum(link_rates) / len(link_rates) if link_rates else None
    untimed = [report.summarize_run(r, None) for r in runs]
    target = campaign.target_loss if campaign.target_loss is not None else report.default_target(untimed)
    summaries = [report.summarize_run(r, target) for r in runs]
    best = report.best_buckets(summaries)
    caps = sorted({s.bucket_cap_mb for s in summaries})
    # Against allreduce (the baseline) and, for cerar, against the exact ring on the same
    # transport (isolates the coding gain from the transport's own cost); same bucket size.
    comparisons = report.compare(summaries, link_rate) + report.compare(
        summaries, link_rate, baseline="ring", only=("cerar",)
    )
    summary: dict[str, Any] = {
        "world_size": campaign.world_size,
        "regime": campaign.regime,
        "rate": campaign.rate if campaign.regime == "slow" else None,
        "link_rate_bytes_per_s": link_rate,
        "target_val_loss": target,
        "target_rule": target_rule(campaign, report.baseline_bucket(summaries), len(caps) > 1),
        "noise_spread": report.noise_spread(report.at_best(summaries, best)),  # the tuned allreduce's seeds
        "bucket_caps_mb": caps,
        "total_wall_s": wall_s,
        "runs": [s.as_dict() for s in summaries],
        "comparisons": comparisons,
        "families": family_rows(summaries),
        "configs": [c.to_dict() for c in configs],
    }
    if len(caps) > 1:
        from cerar.experiments.train.sweep import sweep_summary

        summary["sweep"] = sweep_summary(summaries, best, link_rate)
    return summary, summaries


def _print_tables(summary: dict[str, Any], summaries: list[Any]) -> None:
    from cerar.experiments.train import report

    print(
        report.format_table(
            summaries,
            target=summary["target_val_loss"],
            spread=summary["noise_spread"],
            comparisons=summary["comparisons"],
            link_rate_bytes_per_s=summary["link_rate_bytes_per_s"],
            target_rule=summary["target_rule"],
        )
    )
    from cerar.experiments.train.tuning import format_families

    print("\n" + format_families(summary["families"], summary["target_val_loss"]))
    if "sweep" in summary:
        from cerar.experiments.train.sweep import format_sweep

        print("\n" + format_sweep(summary["sweep"]))


def target_rule(campaign: Any, baseline_cap: float | None, sweep: bool) -> str:
    """How the target validation loss was chosen, for the report (``campaign``: anything with
    a ``target_loss``)."""
    if campaign.target_loss is not None:
        return "given by --target-loss"
    if baseline_cap is None:
        return "none: no allreduce run; give --target-loss"
    rule = "allreduce's mean final loss plus its seed spread"
    return f"{rule}, at allreduce's best bucket size, {baseline_cap:g} MB: the tuned baseline" if sweep else rule


def _require_extras(campaign: Campaign) -> None:
    from cerar.experiments._extras import require

    require("tqdm", "train")
    require("transformers", "train")
    if not campaign.no_plots:
        require("matplotlib", "train")


def run_all(configs: list[TrainConfig], campaign: Campaign) -> tuple[list[dict[str, Any]], list[float], float]:
    """Every run in turn (or its record with ``reuse``) under one progress bar; return the
    records, the link rates the launcher measured, and the reused runs' wall time."""
    from tqdm import tqdm

    from cerar.experiments.train.model import RANK_IMPORTS
    from cerar.harness.forked import Zygote

    runs_dir = campaign.out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    interval = 0.2 if sys.stderr.isatty() else 10.0  # a log file gets a line now and then
    bar = tqdm(total=sum(c.steps for c in configs), unit="step", file=sys.stderr, dynamic_ncols=True,
               mininterval=interval)  # fmt: skip
    runs: list[dict[str, Any]] = []
    reused_wall_s = 0.0
    with contextlib.ExitStack() as stack:
        zygote: Zygote | None = None  # on loopback, one forks every run's ranks (cerar.harness.forked)
        for config in configs:
            label = run_label(config, configs)
            out_path = runs_dir / f"{label}.json"
            record = _reusable(out_path, config, campaign) if campaign.reuse else None
            if record is not None:
                reused_wall_s += float((record.get("launch") or {}).get("wall_s", 0.0))
                bar.update(config.steps)
                runs.append(record)
                continue  # no zygote started for a run that is reused
            if zygote is None and campaign.regime == "fast":
                zygote = stack.enter_context(Zygote(RANK_IMPORTS))
            bar.set_description(label)
            record = _launch_run(config, runs_dir / f"{label}.config.json", out_path, campaign, bar, zygote)
            if record.get("label") != label:  # the worker names a run by its config alone
                record["label"] = label
                out_path.write_text(json.dumps(record))
            runs.append(record)
    bar.close()
    rates = [rate for r in runs if (rate := (r.get("launch") or {}).get("link_rate_bytes_per_s"))]
    return runs, rates, reused_wall_s


def _launch_run(
    config: TrainConfig, config_path: Path, out_path: Path, campaign: Campaign, bar: Any, zygote: Zygote | None
) -> dict[str, Any]:
    """Launch the ranks of one run on the chosen network; return rank 0's record with the
    launch's figures added (also written back to ``out_path``)."""
    from cerar.experiments.train.worker import PROGRESS_KIND
    from cerar.harness.launch import launch
    from cerar.harness.progress import parse_progress

    config_path.write_text(config.to_json())
    lock = threading.Lock()
    done = {"steps": 0}

    def follow(rank: int, stream: str, line: str, done: dict[str, int] = done) -> None:
        # Rank 0's progress lines drive the bar (from the launcher's reader thread).
        progress = parse_progress(line, PROGRESS_KIND) if rank == 0 and stream == "stdout" else None
        if progress is not None:
            step = progress.done
            with lock:
                bar.update(step - done["steps"])
                done["steps"] = step

    command = [sys.executable, "-m", "cerar.experiments.train.worker", "--config", str(config_path)]
    command += ["--out", str(out_path), "--progress", "lines"]
    load_before = os.getloadavg()[0]
    network = {
        "regime": campaign.regime, "rate": campaign.rate, "delay": campaign.delay,
        "ranks_per_node": campaign.ranks_per_node,
    }  # fmt: skip
    result = launch(
        command, campaign.world_size, timeout_s=campaign.timeout_s, on_line=follow, preload=zygote or (), **network
    )
    record = json.loads(out_path.read_text())
    # The machine may be shared: the load average says how much others competed for the CPUs.
    record["launch"] = {
        "world_size": campaign.world_size,
        "ranks_per_node": campaign.ranks_per_node,
        "regime": result.regime,
        "rate": result.rate,
        "congestion_control": result.congestion_control,
        "wall_s": result.wall_s,
        "link_rate_bytes_per_s": result.link_rate_bytes_per_s,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg()[0],
    }
    out_path.write_text(json.dumps(record))
    return record


def _print_summary(campaign: Campaign, first: TrainConfig, summary: dict[str, Any], summaries: list[Any]) -> None:
    regime = f"slow, {campaign.rate}" if campaign.regime == "slow" else "fast (loopback)"
    if campaign.ranks_per_node > 1:
        regime += f", {campaign.nodes} nodes x {campaign.ranks_per_node} ranks"
    print(
        f"cerar train: N = {campaign.world_size}, {regime}, {first.steps} steps x {first.batch_size} seq x "
        f"{first.model.seq_len} bytes per rank, GPT-NeoX {first.model.layers}L/{first.model.hidden}H "
        f"({summaries[0].parameters / 1e6:.2f} M parameters); total {summary['total_wall_s']:.0f} s"
    )


def _reusable(path: Path, config: TrainConfig, campaign: Campaign) -> dict[str, Any] | None:
    """An earlier run's record if it exists and matches this run's settings, else None."""
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    launch = record.get("launch") or {}
    same = (
        record.get("config") == config.to_dict()
        and record.get("world_size") == campaign.world_size
        and launch.get("ranks_per_node", 1) == campaign.ranks_per_node
        and launch.get("regime") == campaign.regime
        and (campaign.regime == "fast" or launch.get("rate") == campaign.rate)
    )
    return record if same else None
