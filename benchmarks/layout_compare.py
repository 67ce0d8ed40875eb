"""Per-parameter error on captured gradients: components that take every c-th value (the
library's layout) against contiguous components (the layout before), same codes, same data.

    cerar study --gradients --steps 60 --out results/study      # writes gradients_capture.npz
    python benchmarks/layout_compare.py results/study/gradients_capture.npz

The old layout is reproduced exactly by permuting the input: contiguous component ``k`` of ``x``
is every-c-th component ``k`` of ``x.reshape(c, m).T``, so simulating the permuted input and
permuting the output back is what the old transport computed.
"""

from __future__ import annotations

import argparse

import numpy as np

from cerar import codes, simulate
from cerar.experiments.study import capture as gradient_capture
from cerar.experiments.study.gradients import parameter_errors


def contiguous_layout_outputs(code, inputs: np.ndarray, packet: str) -> np.ndarray:
    """Every rank's decoded sum with contiguous components (the layout before)."""
    n, d = inputs.shape
    c = code.components
    m = -(-d // c)
    padded = np.zeros((n, c * m))
    padded[:, :d] = inputs
    permuted = padded.reshape(n, c, m).transpose(0, 2, 1).reshape(n, -1)
    outputs = simulate(code, permuted, packet).outputs
    return outputs.reshape(n, m, c).transpose(0, 2, 1).reshape(n, -1)[:, :d]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("capture", help="a gradients_capture.npz written by `cerar study --gradients`")
    parser.add_argument("-c", "--components", type=int, default=8)
    args = parser.parse_args(argv)
    capture = gradient_capture.load_capture(args.capture)
    if capture.parameters is None:
        raise SystemExit("layout_compare: the capture has no parameter layout (re-capture with this version)")
    n = capture.gradients.shape[1]
    print(
        "| code | packets | step | bucket | per-param worst (now) | per-param worst (before) "
        "| zero-sum values: largest output now / before |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, packet in (("perturbed", "fp32"), ("optimized", "fp32"), ("optimized", "fp16")):
        code = codes.build(name, n, args.components, packet)
        for index, step in enumerate(capture.steps):
            x = capture.gradients[index].astype(np.float32).astype(np.float64)
            now = simulate(code, x, packet)
            before = contiguous_layout_outputs(code, x, packet)
            errors_now = parameter_errors(now.outputs, now.exact, capture.parameters)
            errors_before = parameter_errors(before, now.exact, capture.parameters)
            zero_now, zero_before = errors_now["zero_values"]["worst_abs"], errors_before["zero_values"]["worst_abs"]
            print(
                f"| {name} c={args.components} | {packet} | {step} | {now.worst_relative_error:.2e} | "
                f"{errors_now['worst']:.2e} | {errors_before['worst']:.2e} | {zero_now:.1e} / {zero_before:.1e} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
