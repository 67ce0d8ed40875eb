"""The closing table of issue 6: plain perturbed vs spread-seam perturbed vs optimized.

For N in {4, 8, 16} and c in {2N, 3N, 4N}, float32 packets: simulated worst-rank relative error
on i.i.d. standard normal inputs and on gradient-like inputs (``3 g + noise``), worst-rank cond,
the gain of ``optimized`` over plain ``perturbed``, the time to optimise, and a check of the
error model: predicted / simulated worst-rank error on i.i.d. inputs for each design. Run from
the repository root:

    .venv/bin/python benchmarks/optimize_table.py [--size 512] [--json results/optimize_table.json]

Designs are cached (``$CERAR_CACHE_DIR``); set it to an empty folder to time the optimisation.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from cerar.coding import codes
from cerar.experiments.study.synthetic import gradient_like_inputs, iid_inputs, method_error

TARGETS = {2: 1e-4, 3: 1e-3, 4: 5e-3}
DESIGNS = ("perturbed", "spread", "optimized")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=512, help="values per component (default 512)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    print(f"{'N':>3} {'c':>3} | {'pert iid':>9} {'spread iid':>10} {'opt iid':>9} | {'pert grad':>9} "
          f"{'opt grad':>9} | {'cond pert':>9} {'cond opt':>9} | {'target':>6} {'gain iid':>8} "
          f"{'gain grad':>9} | {'pred/sim: pert':>14} {'spread':>6} {'opt':>5} | {'opt s':>5}")
    for n in (4, 8, 16):
        for multiple in (2, 3, 4):
            c = multiple * n
            started = time.perf_counter()
            opt = codes.optimized(n, c, "fp32")
            seconds = time.perf_counter() - started
            designs = {
                "perturbed": codes.perturbed(n, c, None, "fp32"),
                "spread": codes.perturbed(n, c, None, "fp32", spread_seam=True),
                "optimized": opt,
            }
            iid = iid_inputs(n, args.size * c, args.seed)
            grad = gradient_like_inputs(n, args.size * c, args.seed)
            row: dict = {"N": n, "c": c, "target": TARGETS[multiple], "optimize_seconds": seconds,
                         "optimized_start": opt.params.get("start"), "optimized_spread_seam": opt.spread_seam}
            for name, code in designs.items():
                row[f"cond_{name}"] = float(np.max(code.cond))
                row[f"predicted_{name}"] = code.predicted_worst_error("fp32")
                for label, inputs in (("iid", iid), ("grad", grad)):
                    row[f"{name}_{label}"] = method_error(code, inputs, "fp32")
                row[f"model_ratio_{name}"] = row[f"predicted_{name}"] / row[f"{name}_iid"]
            row["gain_iid"] = row["perturbed_iid"] / row["optimized_iid"]
            row["gain_grad"] = row["perturbed_grad"] / row["optimized_grad"]
            rows.append(row)
            print(f"{n:>3} {c:>3} | {row['perturbed_iid']:>9.3g} {row['spread_iid']:>10.3g} "
                  f"{row['optimized_iid']:>9.3g} | {row['perturbed_grad']:>9.3g} {row['optimized_grad']:>9.3g} | "
                  f"{row['cond_perturbed']:>9.3g} {row['cond_optimized']:>9.3g} | {row['target']:>6.0e} "
                  f"{row['gain_iid']:>8.2f} {row['gain_grad']:>9.2f} | {row['model_ratio_perturbed']:>14.2f} "
                  f"{row['model_ratio_spread']:>6.2f} {row['model_ratio_optimized']:>5.2f} | {seconds:>5.1f}",
                  flush=True)
    ratios = [r[f"model_ratio_{d}"] for r in rows for d in DESIGNS]
    print(f"model predicted/simulated (i.i.d., worst rank): min {min(ratios):.2f}, "
          f"median {float(np.median(ratios)):.2f}, max {max(ratios):.2f}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
