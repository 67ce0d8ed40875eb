"""``cerar train``: the Pythia-style training experiment, every method on the same data.

For each method (and, for ``allreduce``, each noise seed) it launches ``N`` local ranks of
:mod:`cerar.experiments.train.worker` on a fast (loopback; forked from one process that imported
the model) or slow (rate-limited network namespaces) network, then writes under ``--out``:

* ``runs/<label>.json``: every rank's per-step and per-evaluation record;
* ``summary.json``: the per-run summaries, comparisons, link rate and settings;
* ``loss.png`` (validation loss vs step and vs training time) and ``breakdown.png``;

and prints the summary table and each method family at its best tried setting
(:mod:`cerar.experiments.train.tuning`: ``diloco:10 diloco:25`` are two settings of ``diloco``).
``--bucket-cap-mb 1,4,16`` sweeps DDP's bucket size: every run at every size (labels
``cerar-c8-b4-s0``), reported as the full grid and, beside it, each method at its best size
against the tuned allreduce (:mod:`cerar.experiments.train.sweep`).
The same worker runs under ``torchrun`` directly (see :mod:`cerar.experiments.train.worker`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cerar._checks import check_float
from cerar.experiments.train.config import ModelConfig, TrainConfig, add_config_arguments, config_from_args
from cerar.experiments.train.methods import HOOKS
from cerar.experiments.train.schedules import USAGE
from cerar.harness import resources

if TYPE_CHECKING:
    from cerar.harness.forked import Zygote

DEFAULT_METHODS = ("allreduce", "cerar:2N", "cerar:3N", "fp16", "powersgd")
DEFAULT_WORLD_SIZE = 4


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train a small Pythia (GPT-NeoX) on Shakespeare with each method and compare",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument(
        "--methods",
        nargs="+",
        default=list(DEFAULT_METHODS),
        help=f"methods: {', '.join(h.usage for h in HOOKS.values())}; schedules around one (<method>, default "
        f"allreduce): {', '.join(USAGE.values())}; through cerar's process group instead of a hook: "
        "group:<method> (DDP) and hsdp:<method> (FSDP2 HSDP on --nodes, cerar between them), <method> one of "
        "allreduce, ring, fp16, int8, fp8, cerar[:c|:kN][:fp16], auto[:budget]; list several settings "
        "(diloco:10 diloco:25) to tune (default: %(default)s)",
    )
    p.add_argument("--world-size", "-N", type=int, default=DEFAULT_WORLD_SIZE,
                   help=f"ranks (default {DEFAULT_WORLD_SIZE}; set by --nodes x --ranks-per-node)")  # fmt: skip
    p.add_argument(
        "--nodes",
        type=int,
        default=None,
        help="emulated nodes M, each one network namespace of G ranks with one link (default: N / G)",
    )
    p.add_argument(
        "--ranks-per-node",
        type=int,
        default=1,
        help="ranks per emulated node G (default 1: a namespace per rank); hier-* methods run exact inside a node",
    )
    p.add_argument("--regime", choices=("fast", "slow"), default="slow", help="network (default slow)")
    p.add_argument(
        "--rate", default="400mbit", help="slow: each rank's (with nodes: each node's) link rate (default 400mbit)"
    )
    p.add_argument("--delay", default="0ms", help="slow: added one-way delay (default 0ms)")
    p.add_argument("--seed", type=int, default=0, help="seed of every method's run (default 0)")
    p.add_argument(
        "--noise-seeds",
        type=int,
        default=2,
        help="allreduce runs with seeds seed..seed+k-1: their spread is the noise yardstick (default 2)",
    )
    p.add_argument(
        "--target-loss",
        type=float,
        default=None,
        help="validation loss for 'time to target' (default: the tuned allreduce's, i.e. at its best bucket "
        "size: mean final loss + its seed spread, at least 0.01)",
    )
    p.add_argument("--out", type=Path, default=Path("results/train"), help="output folder (default results/train)")
    p.add_argument("--timeout-s", type=float, default=1200.0, help="limit per run (default 1200)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG figures")
    p.add_argument(
        "--reuse",
        action="store_true",
        help="reuse runs/<label>.json from an earlier run with the same settings, N and regime",
    )
    p.add_argument("--json", action="store_true", help="print the summary JSON instead of the table")
    resources.add_override_flag(p)
    add_config_arguments(p)


def _resolve_nodes(args: argparse.Namespace) -> None:
    """``--nodes M`` sets ``world_size = M x G``; ``--ranks-per-node G`` must divide it."""
    if args.ranks_per_node < 1:
        raise ValueError(f"Argument 'ranks_per_node' must be at least 1, not {args.ranks_per_node}.")
    if args.nodes is not None:
        if args.nodes < 1:
            raise ValueError(f"Argument 'nodes' must be at least 1, not {args.nodes}.")
        args.world_size = args.nodes * args.ranks_per_node
    if args.world_size % args.ranks_per_node:
        raise ValueError(
            f"Argument 'ranks_per_node' must divide world_size {args.world_size}, not {args.ranks_per_node}."
        )
    args.nodes = args.world_size // args.ranks_per_node


def plan_runs(args: argparse.Namespace) -> list[TrainConfig]:
    """The runs, in order: each method once with ``--seed``, plus extra allreduce seeds; each of
    them at every bucket size of ``--bucket-cap-mb`` (same data, same seeds)."""
    _resolve_nodes(args)
    if args.world_size < 2:
        raise ValueError(f"Argument 'world_size' must be at least 2, not {args.world_size}.")
    if args.noise_seeds < 1:
        raise ValueError(f"Argument 'noise_seeds' must be at least 1, not {args.noise_seeds}.")
    configs: list[TrainConfig] = []
    for spec in args.methods:
        seeds = range(args.seed, args.seed + (args.noise_seeds if spec == "allreduce" else 1))
        for seed in seeds:
            config = config_from_args(args, spec, seed, args.world_size, args.nodes)
            configs += [config.at_bucket(cap) for cap in config.bucket_caps]
    labels = [run_label(c, configs) for c in configs]
    duplicated = sorted({label for label in labels if labels.count(label) > 1})
    if duplicated:
        raise ValueError(f"Argument 'methods' must not repeat a run, not {duplicated}.")
    return configs


def run_label(config: TrainConfig, configs: list[TrainConfig]) -> str:
    """``config.label``, or in a bucket sweep (several sizes among ``configs``) ``bucket_label``."""
    sweep = len({c.bucket_cap_mb for c in configs}) > 1
    return config.bucket_label if sweep else config.label


def check_launch(args: argparse.Namespace, configs: list[TrainConfig]) -> None:
    """What the launches need, checked before the first: the timeout, the network, the ranks
    this machine can start and hold (``--allow-oversubscribe``: more), the output folder."""
    from cerar.cli._paths import output_folder
    from cerar.experiments.train.memory import rank_bytes
    from cerar.harness import netem

    check_float("timeout_s", args.timeout_s, positive=True)
    check_float("target_loss", args.target_loss, positive=True, optional=True)
    netem.check_rate(args.rate)
    netem.check_delay(args.delay)
    resources.check_ranks("world_size", args.world_size, allow=args.allow_oversubscribe)
    largest = max(configs, key=lambda c: rank_bytes(c.model, c.batch_size))
    needed = args.world_size * (resources.RANK_PROCESS_BYTES + rank_bytes(largest.model, largest.batch_size))
    model = largest.model
    what = (
        f"{args.world_size} ranks of a {model.layers}-layer, hidden {model.hidden} model on {largest.batch_size} x "
        f"{model.seq_len} tokens"
    )
    # The message names the setting that grew the most over its default: the likely culprit.
    given = {"world_size": args.world_size, "batch_size": largest.batch_size, "layers": model.layers,
             "hidden": model.hidden, "seq_len": model.seq_len}  # fmt: skip
    defaults = {"world_size": DEFAULT_WORLD_SIZE, "batch_size": TrainConfig.batch_size}
    defaults.update(dataclasses.asdict(ModelConfig()))
    name = max(given, key=lambda key: given[key] / defaults[key])
    resources.check_memory(name, given[name], needed, what, allow=args.allow_oversubscribe)
    output_folder("out", args.out)


def run(args: argparse.Namespace) -> int:
    configs = plan_runs(args)
    check_launch(args, configs)
    _require_extras(args)  # before any run: a missing extra should not cost a run's time
    if args.regime == "slow":
        from cerar.harness.netem import unavailable_reason

        reason = unavailable_reason()
        if reason is not None:
            raise ValueError(f"Argument 'regime' 'slow' is unavailable here: {reason}.")
    started = time.perf_counter()
    runs, link_rates, reused_wall_s = _run_all(configs, args)
    wall_s = time.perf_counter() - started + reused_wall_s  # reused runs count their own time
    summary, summaries = _summarize(args, configs, runs, link_rates, wall_s)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    if not args.no_plots:
        from cerar.experiments.train.plots import plot_breakdown, plot_loss

        plot_loss(runs, args.out / "loss.png", target=summary["target_val_loss"])
        plot_breakdown(summaries, args.out / "breakdown.png")
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    _print_summary(args, configs[0], summary, summaries)
    _print_tables(summary, summaries)
    print(f"\nwrote {args.out / 'summary.json'}" + ("" if args.no_plots else ", loss.png, breakdown.png"))
    return 0


def _summarize(
    args: argparse.Namespace, configs: list[TrainConfig], runs: list[dict[str, Any]], link_rates: list[float],
    wall_s: float,
) -> tuple[dict[str, Any], list[Any]]:  # fmt: skip
    """The summary JSON and the per-run summaries: the target loss is the (tuned) allreduce's
    unless given, the noise spread over the tuned allreduce's seeds; a sweep adds ``sweep``."""
    from cerar.experiments.train import report
    from cerar.experiments.train.tuning import family_rows

    link_rate = sum(link_rates) / len(link_rates) if link_rates else None
    untimed = [report.summarize_run(r, None) for r in runs]
    target = args.target_loss if args.target_loss is not None else report.default_target(untimed)
    summaries = [report.summarize_run(r, target) for r in runs]
    best = report.best_buckets(summaries)
    caps = sorted({s.bucket_cap_mb for s in summaries})
    # Against allreduce (the baseline) and, for cerar, against the exact ring on the same
    # transport (isolates the coding gain from the transport's own cost); same bucket size.
    comparisons = report.compare(summaries, link_rate) + report.compare(
        summaries, link_rate, baseline="ring", only=("cerar",)
    )
    summary: dict[str, Any] = {
        "world_size": args.world_size,
        "regime": args.regime,
        "rate": args.rate if args.regime == "slow" else None,
        "link_rate_bytes_per_s": link_rate,
        "target_val_loss": target,
        "target_rule": _target_rule(args, report.baseline_bucket(summaries), len(caps) > 1),
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


def _target_rule(args: argparse.Namespace, baseline_cap: float | None, sweep: bool) -> str:
    """How the target validation loss was chosen, for the report."""
    if args.target_loss is not None:
        return "given by --target-loss"
    if baseline_cap is None:
        return "none: no allreduce run; give --target-loss"
    rule = "allreduce's mean final loss plus its seed spread"
    return f"{rule}, at allreduce's best bucket size, {baseline_cap:g} MB: the tuned baseline" if sweep else rule


def _require_extras(args: argparse.Namespace) -> None:
    from cerar.experiments._extras import require

    require("tqdm", "train")
    require("transformers", "train")
    if not args.no_plots:
        require("matplotlib", "train")


def _run_all(configs: list[TrainConfig], args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[float], float]:
    """Every run in turn (or its record with ``--reuse``) under one progress bar; return the
    records, the link rates the launcher measured, and the reused runs' wall time."""
    from tqdm import tqdm

    from cerar.experiments.train.model import RANK_IMPORTS
    from cerar.harness.forked import Zygote

    runs_dir = args.out / "runs"
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
            record = _reusable(out_path, config, args) if args.reuse else None
            if record is not None:
                reused_wall_s += float((record.get("launch") or {}).get("wall_s", 0.0))
                bar.update(config.steps)
                runs.append(record)
                continue  # no zygote started for a run that is reused
            if zygote is None and args.regime == "fast":
                zygote = stack.enter_context(Zygote(RANK_IMPORTS))
            bar.set_description(label)
            record = _launch_run(config, runs_dir / f"{label}.config.json", out_path, args, bar, zygote)
            if record.get("label") != label:  # the worker names a run by its config alone
                record["label"] = label
                out_path.write_text(json.dumps(record))
            runs.append(record)
    bar.close()
    rates = [rate for r in runs if (rate := (r.get("launch") or {}).get("link_rate_bytes_per_s"))]
    return runs, rates, reused_wall_s


def _launch_run(
    config: TrainConfig, config_path: Path, out_path: Path, args: argparse.Namespace, bar: Any, zygote: Zygote | None
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
    network = {"regime": args.regime, "rate": args.rate, "delay": args.delay, "ranks_per_node": args.ranks_per_node}
    result = launch(command, args.world_size, timeout_s=args.timeout_s, on_line=follow, preload=zygote or (), **network)
    record = json.loads(out_path.read_text())
    # The machine may be shared: the load average says how much others competed for the CPUs.
    record["launch"] = {
        "world_size": args.world_size,
        "ranks_per_node": args.ranks_per_node,
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


def _print_summary(args: argparse.Namespace, first: TrainConfig, summary: dict[str, Any], summaries: list[Any]) -> None:
    regime = f"slow, {args.rate}" if args.regime == "slow" else "fast (loopback)"
    if args.ranks_per_node > 1:
        regime += f", {args.nodes} nodes x {args.ranks_per_node} ranks"
    print(
        f"cerar train: N = {args.world_size}, {regime}, {first.steps} steps x {first.batch_size} seq x "
        f"{first.model.seq_len} bytes per rank, GPT-NeoX {first.model.layers}L/{first.model.hidden}H "
        f"({summaries[0].parameters / 1e6:.2f} M parameters); total {summary['total_wall_s']:.0f} s"
    )


def _reusable(path: Path, config: TrainConfig, args: argparse.Namespace) -> dict[str, Any] | None:
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
        and record.get("world_size") == args.world_size
        and launch.get("ranks_per_node", 1) == args.ranks_per_node
        and launch.get("regime") == args.regime
        and (args.regime == "fast" or launch.get("rate") == args.rate)
    )
    return record if same else None
