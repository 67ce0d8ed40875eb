"""``cerar plan``: ``method="auto"``'s fitted cost model and the method it picks per size, from a
short probe on this machine (about 20-30 s) or a ``cerar bench`` JSON; with ``--world-size``,
``--rate``, ``--coding-rate`` or ``--latency``, predicted for a described cluster instead."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from cerar._checks import check_float
from cerar.coding.constructions import MAX_COMPONENTS
from cerar.coding.linear_code import MAX_ERROR
from cerar.coding.optimize import OPTIMIZED_MAX_COMPONENTS
from cerar.harness import resources
from cerar.harness.launch import DEFAULT_RATE

if TYPE_CHECKING:
    from cerar.comm.auto.candidates import Candidate

#: The largest described cluster: its CERAR candidates are ``perturbed(N, 2N)``, ``c <= 256``.
MAX_CLUSTER_RANKS = MAX_COMPONENTS // 2
#: The largest fitted bench: auto's 16-bit candidates are ``optimized(N, 2N)``, ``c <= 64``.
MAX_FITTED_RANKS = OPTIMIZED_MAX_COMPONENTS // 2
#: What each record of a bench JSON needs for the fit, and the types it may have.
RECORD_FIELDS: dict[str, tuple[type, ...]] = {
    "method": (str,),
    "components": (int, type(None)),
    "size_bytes": (int, float),
    "regime": (str,),
    "time_median_s": (int, float),
}
BENCH_JSON = "a cerar bench JSON file (results/bench/bench.json)"


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
    resources.add_override_flag(p)


def run(args: argparse.Namespace) -> int:
    from cerar.experiments import plan as planning
    from cerar.harness import netem

    check_float("max_error", args.max_error, positive=True)  # finite too: auto's candidates refuse inf
    if not 0 <= args.margin < 1:
        raise ValueError(f"Argument 'margin' must be in [0, 1), not {args.margin}.")
    describes = any(v is not None for v in (args.world_size, args.rate, args.coding_rate, args.latency))
    if args.world_size is not None and args.world_size < 2:
        raise ValueError(f"Argument 'world_size' must be at least 2, not {args.world_size}.")
    if args.world_size is not None and args.world_size > MAX_CLUSTER_RANKS:
        raise ValueError(
            f"Argument 'world_size' must be at most {MAX_CLUSTER_RANKS} (a described cluster's CERAR codes have "
            f"c = 2N, at most {MAX_COMPONENTS} components), not {args.world_size}."
        )
    rate = netem.rate_bytes_per_s(args.rate) if args.rate is not None else None  # checked before any probe
    coding = planning.parse_coding_rate(args.coding_rate) if args.coding_rate is not None else None
    latency = planning.parse_latency(args.latency) if args.latency is not None else None
    if args.source is not None:
        source = str(args.source)
        doc = check_bench_doc(_read_json(args.source), source)
    else:
        if args.probe_ranks < 2:
            raise ValueError(f"Argument 'probe_ranks' must be at least 2, not {args.probe_ranks}.")
        resources.check_ranks("probe_ranks", args.probe_ranks, allow=args.allow_oversubscribe)
        try:
            netem.check_rate(args.probe_rate)
        except ValueError:
            raise ValueError(
                f"Argument 'probe_rate' must be a tc rate such as '400mbit' or '1gbit', not {args.probe_rate!r}."
            ) from None
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


def _read_json(path: Path) -> object:
    from cerar.cli._paths import input_text

    text = input_text("from", path, BENCH_JSON)
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ValueError(f"Argument 'from' must be {BENCH_JSON}, not {str(path)!r} (not JSON: {exc}).") from None


def check_bench_doc(doc: object, source: str) -> dict[str, object]:
    """``doc`` after checking it holds what the fit reads: ``world_size`` (2 to
    :data:`MAX_FITTED_RANKS`) and ``results``, a list of records with :data:`RECORD_FIELDS`."""
    where = f"in {source!r}"
    if not isinstance(doc, dict):
        raise ValueError(f"Argument 'from' must hold a JSON object (a cerar bench JSON), not {_kind(doc)} {where}.")
    missing = [key for key in ("results", "world_size") if key not in doc]
    if missing:
        raise ValueError(
            f"Argument 'from' must hold a cerar bench JSON with 'results' and 'world_size', not one lacking "
            f"{' and '.join(repr(k) for k in missing)} {where}."
        )
    n = doc["world_size"]
    if isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= MAX_FITTED_RANKS:
        raise ValueError(
            f"Argument 'from' must hold a 'world_size' from 2 to {MAX_FITTED_RANKS} (auto's 16-bit candidates are "
            f"optimized codes of c = 2N, at most {OPTIMIZED_MAX_COMPONENTS}), not {n!r} {where}."
        )
    results = doc["results"]
    if not isinstance(results, list):
        raise ValueError(f"Argument 'from' must hold 'results' as a list of records, not {_kind(results)} {where}.")
    for index, record in enumerate(results):
        bad = _bad_fields(record)
        if bad:
            raise ValueError(
                f"Argument 'from' must hold records with {', '.join(RECORD_FIELDS)} (sizes and times positive), "
                f"not record {index} with bad or missing {', '.join(bad)} {where}."
            )
    return doc


def _kind(value: object) -> str:
    """What a parsed JSON value is, in JSON's words (``an array``, ``a number``)."""
    if isinstance(value, bool):
        return "a boolean"
    kinds = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number"}
    return kinds.get(type(value), "null")


def _bad_fields(record: object) -> list[str]:
    """The fields of :data:`RECORD_FIELDS` that ``record`` lacks or holds a wrong value in."""
    if not isinstance(record, dict):
        return list(RECORD_FIELDS)
    bad = [
        key
        for key, types in RECORD_FIELDS.items()
        if key not in record or isinstance(record[key], bool) or not isinstance(record[key], types)
    ]
    for key in ("size_bytes", "time_median_s"):
        if key not in bad and not (math.isfinite(record[key]) and record[key] > 0):
            bad.append(key)
    return bad


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
        "candidates": [_describe(c) for c in plan.candidates],
        "refused": [_describe(c) for c in plan.refused],
        "table": table,
    }


def _describe(candidate: Candidate) -> dict[str, object]:
    """A candidate's figures, and its rounds as the cost model counts them."""
    from cerar.experiments.bench.model import rounds

    return {**candidate.describe(), "rounds": rounds(candidate)}
