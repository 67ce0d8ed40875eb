"""``cerar bench``: all-reduce time of builtin, ring and CERAR on a fast and a slow network.

Launches the ranks itself, or with ``--launcher torchrun`` one torchrun agent per (emulated)
node. Prints a table, writes the JSON document and two plots to ``--out`` (default
``results/bench/``), and ``--json PATH`` if asked.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cerar._checks import format_size
from cerar.cli._paths import output_file, output_folder
from cerar.experiments._flags import add_flags, given_flags
from cerar.experiments.bench.config import QUICK_PRESET, BenchConfig
from cerar.experiments.bench.run import json_safe, run_bench
from cerar.harness import resources

DEFAULT_OUT = "results/bench"
#: A rank's working memory per byte of the largest message: the input and its working copy, the
#: exact float64 sum and its temporaries, the method's packets (measured: 1.1 GB resident per
#: rank at 64 MiB, N = 2, its fixed part included), rounded up.
RANK_BYTES_PER_MESSAGE_BYTE = 16


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="time all-reduce methods on fast (loopback) and slow (rate-limited) networks",
        description=(
            "Launch N local ranks and time exact (Gloo's all-reduce; results call it builtin, also accepted), the "
            "ring with float16, bfloat16, int8 and int4 wires, "
            "cerar (per c) with float32 and float16 packets and auto (method='auto', its calibration "
            "untimed; ring, cerar-bf16 on request) for each size, every method but auto with no error "
            "budget (max_error=None: the bench measures each one's error), the methods of a size taking turns "
            "call by call, on loopback (fast) and on "
            "namespaces with tc-limited links (slow, needs root, ip and tc; otherwise fast only). "
            "--nodes M --ranks-per-node G emulates M nodes: one namespace per node holding its G ranks "
            "(fast loopback inside), its one link limited to --rate, and adds hier-ring and hier-cerar "
            "(exact inside nodes, the ring or CERAR between them). --launcher torchrun starts one "
            "torchrun --nnodes M --nproc-per-node G agent per node (in its namespace) with a c10d "
            "rendezvous at node 0, instead of every rank."
        ),
    )
    add_flags(p, BenchConfig)  # the measurement's settings: BenchConfig's fields
    p.add_argument("--quick", action="store_true", help="tiny sizes, 2 iterations: a smoke test")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the JSON document here")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--cleanup", action="store_true", help="remove namespaces left by killed runs, then exit")
    resources.add_override_flag(p)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The :class:`BenchConfig` the command line asks for (checked when built): the flags
    given, over ``--quick``'s preset, over the defaults."""
    preset = QUICK_PRESET if args.quick else {}
    return BenchConfig(**{**preset, **given_flags(args, BenchConfig)})


def run(args: argparse.Namespace) -> int:
    if args.cleanup:
        from cerar.harness.netem import cleanup_stale

        removed = cleanup_stale()
        print(f"removed {len(removed)} stale namespace(s)" + (f": {', '.join(removed)}" if removed else ""))
        return 0
    allow = args.allow_oversubscribe
    # Before the config: building a large N's codes takes seconds, and their refusal names c, not N.
    resources.check_ranks("world_size", _world_size_given(args), allow=allow)
    config = config_from_args(args)
    resources.check_ranks("world_size", config.world_size, allow=allow)
    largest = max(config.sizes_bytes)
    needed = config.world_size * (resources.RANK_PROCESS_BYTES + RANK_BYTES_PER_MESSAGE_BYTE * largest)
    what = f"{config.world_size} ranks at {format_size(largest)}"
    resources.check_memory("sizes", format_size(largest), needed, what, allow=allow)
    out = output_folder("out", args.out)  # before the runs: an unwritable path should not cost them
    if args.json:
        output_file("json", args.json)
    _require_extras(args)  # before the runs: a missing extra should not cost minutes of measuring
    try:
        doc = json_safe(run_bench(config, progress=not args.no_progress))
    except KeyboardInterrupt:  # the launcher has already stopped the ranks and removed the network
        print("cerar bench: interrupted; ranks stopped and network removed", file=sys.stderr)
        return 130

    from cerar.experiments.bench.report import format_table, plot

    print(format_table(doc))
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


def _world_size_given(args: argparse.Namespace) -> int:
    """The world size the arguments ask for (``--nodes`` x ``--ranks-per-node``, else ``-N``,
    else the default), before the config checks them."""
    if args.nodes is not None:
        return args.nodes * (args.ranks_per_node if args.ranks_per_node is not None else 1)
    return args.world_size if args.world_size is not None else BenchConfig.world_size


def _require_extras(args: argparse.Namespace) -> None:
    from cerar.experiments._extras import require

    if not args.no_progress:
        require("tqdm", "bench", needed_by="cerar bench's progress bar (or --no-progress)")
    if not args.no_plots:
        require("matplotlib", "bench", needed_by="cerar bench's plots (or --no-plots)")
