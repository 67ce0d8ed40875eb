"""The closing-note table: measured worst-rank error and cond of ``codes.perturbed(N, c)``.

float32 packets, float64 decoding (the simulator), the automatic delta for fp32 and the default
mixed-reference decoder, for N = 4, 8, 16 and c = 2N, 3N, 4N; next to the reference figures of
docs/protocol.md. Two input models: i.i.d. standard normal, and ``X_i = 3 g + noise_i`` (a shared part,
as gradients have), both of ``d = 2048 c`` values per rank. The error is relative, worst rank:
``max_j ||S_hat_j - S|| / ||S||``. "iid/shared" is the ratio of the two relative errors; "abs
shared/iid" the ratio of the worst absolute errors ``||S_hat_j - S||`` (the shared part makes
``||S||`` about ``sqrt(9N+1)`` times larger, and the packets' rounding with it).

Usage: python benchmarks/core_table.py [--size-per-component 2048] [--seed 0]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from cerar import codes, simulate

#: The design's reference figures (docs/protocol.md, "Reference figures"; mixed decoder): (worst-rank error, cond).
DESIGN: dict[tuple[int, int], tuple[float, float]] = {
    (4, 8): (2.6e-4, 5.8e3),
    (4, 12): (4.4e-3, 7.3e4),
    (4, 16): (1.8e-2, 2.6e5),
    (8, 16): (3.4e-4, 5.1e3),
    (8, 24): (5.4e-3, 5.7e4),
    (8, 32): (2.3e-2, 1.8e5),
    (16, 32): (4.0e-4, 4.5e3),
    (16, 48): (6.4e-3, 4.5e4),
}


def _fmt(value: float | None, spec: str = ".2g") -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--size-per-component", type=int, default=2048, help="d / c (default 2048)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    header = (
        f"| {'N':>2} | {'c':>2} | {'rate/ring':>9} | {'delta':>7} | {'cond':>7} | {'DESIGN cond':>11} "
        f"| {'error iid':>9} | {'DESIGN err':>10} | {'predicted':>9} | {'err 3g+noise':>12} "
        f"| {'iid/shared':>10} | {'abs shared/iid':>14} |"
    )
    print(header)
    print("|" + "|".join("-" * (len(cell)) for cell in header.split("|")[1:-1]) + "|")
    started = time.perf_counter()
    for n_ranks in (4, 8, 16):
        for c in (2 * n_ranks, 3 * n_ranks, 4 * n_ranks):
            rng = np.random.default_rng([args.seed, n_ranks, c])
            d = args.size_per_component * c
            code = codes.perturbed(n_ranks, c, precision="fp32")
            iid = rng.standard_normal((n_ranks, d))
            shared = 3 * rng.standard_normal(d) + rng.standard_normal((n_ranks, d))
            result_iid = simulate(code, iid, "fp32")
            result_shared = simulate(code, shared, "fp32")
            err_iid = result_iid.worst_relative_error
            err_shared = result_shared.worst_relative_error
            absolute = float(np.max(result_shared.errors) / np.max(result_iid.errors))
            ref_err, ref_cond = DESIGN.get((n_ranks, c), (None, None))
            print(
                f"| {n_ranks:>2} | {c:>2} | {code.comm_rate / code.ring_comm_rate:>9.3f} "
                f"| {code.params['delta']:>7.2g} | {np.max(code.cond):>7.2g} | {_fmt(ref_cond):>11} "
                f"| {err_iid:>9.2g} | {_fmt(ref_err):>10} | {code.predicted_worst_error('fp32'):>9.2g} "
                f"| {err_shared:>12.2g} | {err_iid / err_shared:>10.1f} | {absolute:>14.1f} |"
            )
    print()
    print(
        f"float32 packets, float64 decoding, d = {args.size_per_component} c per rank, seed {args.seed}; "
        f"cond = max over ranks of cond(W_j^-1); predicted = Code.predicted_worst_error('fp32'); "
        f"{time.perf_counter() - started:.1f} s."
    )


if __name__ == "__main__":
    main()
