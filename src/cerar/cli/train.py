"""``cerar train``: the Pythia-style training experiment, every method on the same data.

This module parses and checks the arguments into a
:class:`~cerar.experiments.train.campaign.Campaign` (:func:`plan_runs`: the runs;
:func:`check_launch`: what the launches need) and calls
:func:`~cerar.experiments.train.campaign.run_campaign`, which launches the runs and writes
``runs/<label>.json``, ``summary.json``, ``loss.png`` and ``breakdown.png`` under ``--out``.
``--methods`` takes the route table's row names (``exact``, ``torch-fp16``, ``ring-int8``,
``cerar-fp16:8``...) and the training methods' own names as their aliases (``allreduce``,
``fp16``, ``int8``, ``cerar:8:fp16``...): :data:`cerar.experiments.train.methods.ROW_NAMES`.
The same worker runs under ``torchrun`` directly (see :mod:`cerar.experiments.train.worker`).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from cerar._checks import check_float
from cerar.experiments.train.campaign import DEFAULT_METHODS, Campaign, run_campaign, run_label
from cerar.experiments.train.config import ModelConfig, TrainConfig, add_config_arguments, config_from_args
from cerar.experiments.train.methods import method_names
from cerar.experiments.train.schedules import USAGE
from cerar.harness import resources

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
        help=f"methods: the route table's rows, each '= its alias' (the training method's own name, which the "
        f"run labels and results keep whichever was typed): {method_names()}; settings: cerar[-fp16|-bf16]:c or "
        ":kN (default 2N; cerar-fp16:8 = cerar:8:fp16), hier-cerar:c or :kM, auto:max_error, "
        f"powersgd:r[:startK]; schedules around one (<method>, default exact): {', '.join(USAGE.values())}; "
        "through cerar's process group instead of a hook: group:<method> (DDP) and hsdp:<method> (FSDP2 HSDP on "
        f"--nodes, cerar between them), <method> one of {method_names(grouped=True)} (there fp16 is cerar's "
        "16-bit ring, not torch's cast); list several settings (diloco:10 diloco:25) to tune "
        "(default: %(default)s)",
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
        help="exact (allreduce) runs with seeds seed..seed+k-1: their spread is the noise yardstick (default 2)",
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
        first = config_from_args(args, spec, args.seed, args.world_size, args.nodes)
        # DDP's exact all-reduce (exact, allreduce) runs noise_seeds seeds: the noise yardstick.
        seeds = range(args.seed, args.seed + (args.noise_seeds if first.name == "allreduce" else 1))
        for seed in seeds:
            config = config_from_args(args, spec, seed, args.world_size, args.nodes)
            configs += [config.at_bucket(cap) for cap in config.bucket_caps]
    labels = [run_label(c, configs) for c in configs]
    duplicated = sorted({label for label in labels if labels.count(label) > 1})
    if duplicated:
        raise ValueError(f"Argument 'methods' must not repeat a run, not {duplicated}.")
    return configs


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
    campaign = Campaign(
        configs=tuple(configs), world_size=args.world_size, nodes=args.nodes, ranks_per_node=args.ranks_per_node,
        regime=args.regime, rate=args.rate, delay=args.delay, target_loss=args.target_loss, out=args.out,
        timeout_s=args.timeout_s, no_plots=args.no_plots, reuse=args.reuse, print_json=args.json,
    )  # fmt: skip
    return run_campaign(campaign)
