"""``cerar bench``: all-reduce time of builtin, ring and CERAR on a fast and a slow network.

Launches the ranks itself (no torchrun). Prints a table, writes the JSON document and two
plots to ``--out`` (default ``results/bench/``), and ``--json PATH`` if asked.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cerar.experiments.bench.methods import METHODS
from cerar.experiments.bench.run import (
    CONSTRUCTIONS,
    DEFAULT_SIZES,
    QUICK_SIZES,
    REGIME_CHOICES,
    BenchConfig,
    format_size,
    json_safe,
    parse_size,
    run_bench,
)
from cerar.harness.launch import DEFAULT_RATE

DEFAULT_OUT = "results/bench"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="time all-reduce methods on fast (loopback) and slow (rate-limited) networks",
        description=(
            "Launch N local ranks and time builtin (Gloo), ring (cerar's exact ring), the ring with "
            "float16 and bfloat16 wires, and cerar (per c) for each size, on loopback (fast) and on "
            "namespaces with tc-limited links (slow, needs root, ip and tc; otherwise fast only)."
        ),
    )
    p.add_argument("--world-size", "-N", type=int, default=4, help="ranks (default 4)")
    p.add_argument(
        "--sizes",
        default=None,
        help=f"message sizes, e.g. 1M,4M,16M (default {','.join(format_size(s) for s in DEFAULT_SIZES)})",
    )
    p.add_argument("--components", "-c", default=None, help="c values for cerar, e.g. 4,8 (default N,2N)")
    p.add_argument("--construction", default="perturbed", help=f"comma list of {', '.join(CONSTRUCTIONS)}")
    p.add_argument(
        "--methods",
        default=",".join(BenchConfig.methods),
        help=f"comma list of {', '.join(METHODS)} (default: all)",
    )
    p.add_argument("--regime", default="both", choices=REGIME_CHOICES, help="network regime(s) (default both)")
    p.add_argument("--rate", default=DEFAULT_RATE, help=f"slow: per-rank link rate (default {DEFAULT_RATE})")
    p.add_argument("--delay", default="0ms", help="slow: added latency per link (needs netem; default 0ms)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default 5; --quick 2)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up iterations (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny sizes, 2 iterations: a smoke test")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the JSON document here")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--timeout", type=float, default=None, help="seconds per regime (default: from the sizes)")
    p.add_argument("--cleanup", action="store_true", help="remove namespaces left by killed runs, then exit")


def _ints(name: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"Argument '{name}' must be a comma list of integers, not {text!r}.") from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The :class:`BenchConfig` the command line asks for (checked)."""
    if args.sizes is not None:
        sizes = tuple(parse_size(s) for s in args.sizes.split(",") if s.strip())
    else:
        sizes = QUICK_SIZES if args.quick else DEFAULT_SIZES
    iters = args.iters if args.iters is not None else (2 if args.quick else 5)
    warmup = args.warmup if args.warmup is not None else 1
    return BenchConfig(
        world_size=args.world_size,
        sizes_bytes=sizes,
        components=_ints("components", args.components) if args.components else None,
        constructions=_names(args.construction),
        methods=_names(args.methods),
        regimes=("fast", "slow") if args.regime == "both" else (args.regime,),
        rate=args.rate,
        delay=args.delay,
        iters=iters,
        warmup=warmup,
        seed=args.seed,
        timeout_s=args.timeout,
    ).validated()


def run(args: argparse.Namespace) -> int:
    if args.cleanup:
        from cerar.harness.netem import cleanup_stale

        removed = cleanup_stale()
        print(f"removed {len(removed)} stale namespace(s)" + (f": {', '.join(removed)}" if removed else ""))
        return 0
    config = config_from_args(args)
    try:
        doc = json_safe(run_bench(config, progress=not args.no_progress))
    except KeyboardInterrupt:  # the launcher has already stopped the ranks and removed the network
        print("cerar bench: interrupted; ranks stopped and network removed", file=sys.stderr)
        return 130

    from cerar.experiments.bench.report import format_table, plot

    print(format_table(doc))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "bench.json"]
    text = json.dumps(doc, indent=1)
    written[0].write_text(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text)
        written.append(Path(args.json))
    if not args.no_plots and doc["results"]:
        written += plot(doc, out)
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    failed = [regime for regime, info in doc["regimes"].items() if info.get("error")]
    return 1 if failed else 0
