"""``cerar plan``: ``method="auto"``'s fitted cost model and the method it picks per size, from a
short probe on this machine (about 20-30 s) or a ``cerar bench`` JSON; with ``--world-size``,
``--rate``, ``--coding-rate`` or ``--latency``, predicted for a described cluster instead."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cerar.coding.code import MAX_ERROR
from cerar.harness.launch import DEFAULT_RATE


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="method='auto''s fitted cost model and its choice per size (here, or predicted for a cluster)",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--from", dest="source", type=Path, default=None, metavar="BENCH_JSON",
                   help="fit a cerar bench JSON instead of probing (e.g. results/bench/bench.json)")  # fmt: skip
    p.add_argument("--regime", choices=("fast", "slow"), default=None,
                   help="the regime to fit (probe default fast; with --from: slow if it ran, else fast)")  # fmt: skip
    p.add_argument("--probe-ranks", type=int, default=4, help="the probe's local ranks (default 4)")
    p.add_argument("--probe-rate", default=DEFAULT_RATE, help=f"the probe's slow link (default {DEFAULT_RATE})")
    p.add_argument("--max-error", type=float, default=MAX_ERROR,
                   help=f"the error budget (default {MAX_ERROR}, as method='auto')")  # fmt: skip
    p.add_argument("--margin", type=float, default=0.03,
                   help="CERAR must beat the best exact/16-bit ring by this fraction (default 0.03)")  # fmt: skip
    cluster = p.add_argument_group("a described cluster (predicted, not measured)")
    cluster.add_argument("--world-size", "-N", type=int, default=None, help="ranks N (default: as fitted)")
    cluster.add_argument("--rate", default=None, help="link rate per rank, tc notation: 10gbit, 400mbit")
    cluster.add_argument("--coding-rate", default=None,
                         help="coding speed, memory bytes per second: 2000GB/s (benchmarks/gpu_check.py)")  # fmt: skip
    cluster.add_argument("--latency", default=None, help="seconds per round, e.g. 20us (default: the fitted alpha)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the text")


def run(args: argparse.Namespace) -> int:
    from cerar.experiments import plan as planning
    from cerar.harness import netem

    if args.max_error is not None and not args.max_error > 0:
        raise ValueError(f"Argument 'max_error' must be positive, not {args.max_error}.")
    if not 0 <= args.margin < 1:
        raise ValueError(f"Argument 'margin' must be in [0, 1), not {args.margin}.")
    describes = any(v is not None for v in (args.world_size, args.rate, args.coding_rate, args.latency))
    if args.world_size is not None and args.world_size < 2:
        raise ValueError(f"Argument 'world_size' must be at least 2, not {args.world_size}.")
    rate = netem.rate_bytes_per_s(args.rate) if args.rate is not None else None  # checked before any probe
    coding = planning.parse_coding_rate(args.coding_rate) if args.coding_rate is not None else None
    latency = planning.parse_latency(args.latency) if args.latency is not None else None
    if args.source is not None:
        doc, source = json.loads(args.source.read_text()), str(args.source)
    else:
        if args.probe_ranks < 2:
            raise ValueError(f"Argument 'probe_ranks' must be at least 2, not {args.probe_ranks}.")
        regime = args.regime or "fast"
        print(f"cerar plan: probing {args.probe_ranks} local ranks ({regime} regime)...", file=sys.stderr)
        doc = planning.probe(args.probe_ranks, regime, args.probe_rate)
        source = f"a probe of {args.probe_ranks} local ranks"
    plan = planning.plan_from_doc(doc, args.regime, args.max_error, source)
    out = {"fitted": _as_json(plan, planning.plan_table(plan, args.margin))}
    text = planning.format_plan(plan, planning.plan_table(plan, args.margin), args.margin, args.max_error)
    if describes:
        here = plan.model
        cluster = planning.cluster_model(
            plan,
            args.world_size or plan.world_size,
            rate if rate is not None else 1.0 / max(here.beta_s_per_byte, 1e-15),
            coding if coding is not None else _coding_rate_here(plan),
            latency,
            args.max_error,
        )
        table = planning.plan_table(cluster, args.margin)
        out["predicted"] = _as_json(cluster, table)
        text += "\n\n" + planning.format_plan(cluster, table, args.margin, args.max_error)
    print(json.dumps(out, indent=1) if args.json else text)
    return 0


def _coding_rate_here(plan: object) -> float:
    """This machine's coding speed as the fit sees it: the float32 CERAR candidate's measured
    gamma against its coding bytes per value (else 10 GB/s, a CPU core's copy rate)."""
    from cerar.experiments.plan import Plan, coding_bytes_per_value

    assert isinstance(plan, Plan)
    for shown, modelled in zip(plan.candidates, plan.modelled, strict=True):
        gamma = plan.model.gamma_s_per_value.get(modelled.label, 0.0)
        if shown.components is not None and gamma > 0:
            return coding_bytes_per_value(shown) / gamma
    return 10e9


def _as_json(plan: object, table: dict[str, object]) -> dict[str, object]:
    from cerar.experiments.plan import Plan

    assert isinstance(plan, Plan)
    return {
        "source": plan.source,
        "predicted": plan.predicted,
        "regime": plan.regime,
        "world_size": plan.world_size,
        "formula": plan.formula,
        "model": plan.model.as_dict(),
        "candidates": [c.describe() for c in plan.candidates],
        "refused": [c.describe() for c in plan.refused],
        "table": table,
    }
