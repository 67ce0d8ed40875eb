"""Timings of the numpy core: building and checking codes, and the all-rank simulator.

Targets (issue 2): building and checking a code up to N = 64, c = 256 takes under 2 s; the
simulator handles N = 8, c = 32, d = 1e6 in seconds. A benchmark, not a test: it prints and
asserts nothing.

"Build" is ``codes.perturbed(N, c)`` with the automatic delta (a search over ~50 candidate codes
on the predicted error); "check" is everything a user looks at afterwards on a fresh code of that
delta: every rank's decoder, ``cond``, ``error_bound`` and ``predicted_error``.

Usage: python benchmarks/core_perf.py [--repeat 3] [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np

from cerar import Code, codes, simulate


def timed(function: Callable[[], object], repeat: int) -> tuple[float, float, object]:
    """(best, median) seconds over ``repeat`` runs, and the last result."""
    times = []
    result: object = None
    for _ in range(repeat):
        started = time.perf_counter()
        result = function()
        times.append(time.perf_counter() - started)
    return min(times), statistics.median(times), result


def check(code: Code) -> tuple[float, float, float]:
    for j in range(code.world_size):
        code.decoder(j)
    return float(np.max(code.cond)), float(np.max(code.error_bound)), float(np.max(code.predicted_error()))


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="fewer sizes")
    args = parser.parse_args()

    print(f"python {platform.python_version()}, numpy {np.__version__}, {os.cpu_count()} CPUs")
    print()
    print(
        "Building and checking codes.perturbed(N, c), automatic delta (fp32); best / median of", args.repeat
    )
    print(
        f"{'N':>4} {'c':>5} {'build s':>16} {'check s':>16} {'total s':>8} {'max cond':>10} {'max bound':>10}"
    )
    sizes = [(8, 16), (8, 32), (16, 64), (32, 128), (64, 128), (64, 256)]
    if args.quick:
        sizes = [(8, 32), (64, 256)]
    for n_ranks, c in sizes:
        build_best, build_med, code = timed(lambda n=n_ranks, k=c: codes.perturbed(n, k), args.repeat)
        assert isinstance(code, Code)
        delta = code.params["delta"]
        check_best, check_med, figures = timed(
            lambda n=n_ranks, k=c, d=delta: check(codes.perturbed(n, k, d)), args.repeat
        )
        cond, bound, _ = figures  # type: ignore[misc]
        print(
            f"{n_ranks:>4} {c:>5} {build_best:>7.3f} / {build_med:>6.3f} "
            f"{check_best:>7.3f} / {check_med:>6.3f} "
            f"{build_med + check_med:>8.3f} {cond:>10.3g} {bound:>10.3g}"
        )
    # The generic (row-table) route on the largest code, for comparison with the node route.
    big = codes.perturbed(64, 256, 1e-2)
    _, rows_med, _ = timed(lambda: check(Code(64, big.rows)), 1)
    print(f"generic rows route, N=64 c=256, check: {rows_med:.3f} s (node route above)")

    print()
    print("simulate(code, inputs): all ranks in one process; best / median of", args.repeat)
    print(f"{'N':>4} {'c':>5} {'d':>9} {'packets':>8} {'seconds':>16} {'worst rel. error':>17}")
    rng = np.random.default_rng(0)
    cases = [(8, 32, 10**6, "fp32"), (8, 32, 10**6, "fp64")]
    if not args.quick:
        cases += [(4, 8, 10**6, "fp32"), (16, 32, 10**6, "fp32")]
    for n_ranks, c, d, precision in cases:
        code = codes.perturbed(n_ranks, c)
        inputs = rng.standard_normal((n_ranks, d)).astype(np.float32)
        best, med, result = timed(lambda k=code, x=inputs, p=precision: simulate(k, x, p), args.repeat)
        error = result.worst_relative_error  # type: ignore[attr-defined]
        print(f"{n_ranks:>4} {c:>5} {d:>9} {precision:>8} {best:>7.3f} / {med:>6.3f} {error:>17.3g}")


if __name__ == "__main__":
    main()
