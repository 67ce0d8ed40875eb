"""``cerar design``: inspect one code: rates, per-rank cond and error bound, predicted and
simulated worst-rank error. It shows codes the library's error limit refuses too (built with
``max_error=None``), flagged as such: inspecting them is how one sees why."""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

import numpy as np

from cerar._checks import check_int
from cerar.coding import codes
from cerar.coding.constructions import MAX_COMPONENTS
from cerar.coding.linear_code import MAX_ERROR, Code
from cerar.coding.optimize import OPTIMIZED_MAX_COMPONENTS
from cerar.coding.precision import precision_name
from cerar.harness import resources
from cerar.protocol.simulate import simulate

CONSTRUCTIONS = tuple(codes.CONSTRUCTIONS)
#: The simulation's working memory per value of each rank: the inputs, their padded and scaled
#: copies, the packets and the outputs (measured 61 bytes at N = 8 and 16, d = 1M and 4M).
SIMULATION_BYTES_PER_VALUE = 64


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("design", help="inspect a CERAR code (no torch needed)")
    p.add_argument("--world-size", "-N", type=int, default=8, help="ranks on the ring (default 8)")
    p.add_argument("--components", "-c", type=int, default=None, help="components c (default 2N)")
    p.add_argument("--construction", default="perturbed", choices=CONSTRUCTIONS)
    p.add_argument("--precision", default="fp32", choices=("fp32", "fp64"), help="packet precision")
    p.add_argument("--delta", type=float, default=None, help="perturbed: cluster spacing (default: best)")
    p.add_argument("--eps", type=float, default=None, help="vandermonde: node spacing (default: best)")
    p.add_argument("--reference", default="mixed", choices=("mixed", "A"), help="decoder")
    p.add_argument("--size", type=int, default=None, help="values per rank to simulate (default 2048 c)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    resources.add_override_flag(p)


def build_code(args: argparse.Namespace) -> Code:
    n_ranks = args.world_size
    components = _components(args)
    # --delta and --eps tune one construction each: given to another, build() names the mistake.
    tuning = {name: value for name, value in (("delta", args.delta), ("eps", args.eps)) if value is not None}
    return codes.build(
        args.construction, n_ranks, components, args.precision, reference=args.reference, max_error=None, **tuning
    )


def _components(args: argparse.Namespace) -> int:
    """``--components``, else the default: ``2N`` (exact: ``N``, the only ``c`` it has)."""
    if args.components is not None:
        return int(args.components)
    return args.world_size if args.construction == "exact" else 2 * args.world_size


def describe(code: Code, precision: str, size: int, seed: int) -> dict[str, Any]:
    """Every figure ``cerar design`` shows, as a JSON-ready dict."""
    rng = np.random.default_rng(seed)
    inputs = rng.standard_normal((code.world_size, size))
    started = time.perf_counter()
    result = simulate(code, inputs, packet_dtype=precision)
    simulate_s = time.perf_counter() - started
    predicted = code.predicted_error(precision)
    return {
        "code": code.to_dict(),
        "repr": repr(code),
        "world_size": code.world_size,
        "components": code.components,
        "construction": code.construction,
        "params": code.params,
        "reference": code.reference,
        "precision": precision,
        "rounds": code.rounds,
        "comm_rate": code.comm_rate,
        "ring_comm_rate": code.ring_comm_rate,
        "comm_ratio_to_ring": code.comm_rate / code.ring_comm_rate,
        "storage_rate": code.storage_rate,
        "cond": code.cond.tolist(),
        "error_bound": code.error_bound.tolist(),
        "predicted_error": predicted.tolist(),
        "predicted_worst_error": float(np.max(predicted)),
        # The constructions refuse such a code unless called with max_error=None.
        "above_error_limit": not float(np.max(predicted)) <= MAX_ERROR,
        "simulated_error": result.relative_errors.tolist(),
        "simulated_worst_error": result.worst_relative_error,
        "simulation": {
            "size": size,
            "inputs": "i.i.d. standard normal",
            "seed": seed,
            "packet_values": result.packet_values,
            "values_sent_per_rank": int(result.values_sent[0]),
            "peak_working_packets": int(np.max(result.peak_working_packets)),
            "seconds": simulate_s,
        },
    }


def format_table(info: dict[str, Any]) -> str:
    lines = [
        info["repr"],
        f"  rounds L = c + N - 2      {info['rounds']}",
        f"  comm rate (values sent per value)  {info['comm_rate']:.3f}   ring all-reduce "
        f"{info['ring_comm_rate']:.3f}   ratio {info['comm_ratio_to_ring']:.3f}",
        f"  storage rate 1 + N/c      {info['storage_rate']:.3f}",
        f"  worst-rank error at {info['precision']}: predicted {info['predicted_worst_error']:.3g}, "
        f"simulated {info['simulated_worst_error']:.3g} "
        f"(d = {info['simulation']['size']}, i.i.d. normal, seed {info['simulation']['seed']})",
        *(
            [f"  above the error limit {MAX_ERROR:g}: the constructions refuse this code unless max_error=None"]
            if info.get("above_error_limit")
            else []
        ),
        "",
        f"  {'rank':>4}  {'cond':>10}  {'error bound':>11}  {'predicted':>10}  {'simulated':>10}",
    ]
    for j in range(info["world_size"]):
        lines.append(
            f"  {j:>4}  {info['cond'][j]:>10.3g}  {info['error_bound'][j]:>11.3g}  "
            f"{info['predicted_error'][j]:>10.3g}  {info['simulated_error'][j]:>10.3g}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    precision = precision_name(args.precision)
    if args.size is not None and args.size < 1:
        raise ValueError(f"Argument 'size' must be at least 1, not {args.size}.")
    check_int("seed", args.seed, minimum=0)  # numpy's own refusal names no argument
    _check_default_components(args)
    _check_memory(args)  # before the build: a large N's code takes a while to build too
    code = build_code(args)
    size = args.size if args.size is not None else 2048 * code.components
    info = describe(code, precision, size, args.seed)
    if args.json:
        print(json.dumps(info, indent=2, default=_json_default))
    else:
        print(format_table(info))
    return 0


def _check_default_components(args: argparse.Namespace) -> None:
    """With ``c`` left to its default ``2N``, a too large ``N`` is the argument to name (the
    construction's own refusal names ``components``, which the command line did not give)."""
    if args.components is not None or args.construction == "exact":
        return
    limit = OPTIMIZED_MAX_COMPONENTS if args.construction == "optimized" else MAX_COMPONENTS
    if 2 * args.world_size > limit:
        raise ValueError(
            f"Argument 'world_size' must be at most {limit // 2} for construction {args.construction!r} with the "
            f"default c = 2N (at most {limit} components; -c N or less gives an exact code), not {args.world_size}."
        )


def _check_memory(args: argparse.Namespace) -> None:
    """Refuse a simulation that cannot fit this machine's memory (``--allow-oversubscribe``: try)."""
    n_ranks = args.world_size
    size = args.size if args.size is not None else 2048 * _components(args)  # run's default
    if n_ranks < 1 or size < 1:
        return  # build_code and run name the bad value
    name, value = ("size", args.size) if args.size is not None else ("world_size", n_ranks)
    needed = SIMULATION_BYTES_PER_VALUE * n_ranks * size
    what = f"the simulation's {n_ranks} ranks x {size} values"
    resources.check_memory(name, value, needed, what, allow=args.allow_oversubscribe)


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)
