"""Error feedback on the block wires, in numpy, and the study behind ``cerar study --feedback``.

**The reference.** :func:`ring_feedback` and :func:`direct_feedback` are one call of the ring
(:func:`cerar.comm.algorithms.ring.program.run_ring`) and of the direct shape
(:func:`cerar.comm.algorithms.ring.direct.run_direct`) with error feedback
(:mod:`cerar.comm.algorithms.ring.feedback`): from every rank's input and residual they return
the sum every rank ends with and every rank's updated residual, bitwise what the collective
computes (tests/multirank/test_feedback_reference.py holds them to it). Each rank's residual has
the padded size ``N * ceil(d / N)``; its chunk ``j`` is what the rank's quantization of a value
for chunk ``j`` rounded away last time. Whenever a rank quantizes a value ``v`` for chunk ``j`` it
quantizes ``w = v + residual[j]`` (float32) and keeps ``residual[j] = -(decode(packet) - w)``
(the collective's order of operations, down to the sign of a zero):

* the ring, chunk ``j`` at hop ``t = 1 .. N`` on rank ``(j + t - 1) % N``: ``v`` is the rank's own
  chunk at hop 1 and ``decode(arrived) + own`` (the partial sum) after; hop ``N``'s packet, the
  owner's full sum, is what every rank ends with;
* the direct shape: every rank ``i != j`` sends its own chunk ``j`` (``v = x_i[j]``); the owner
  ``j`` sums its own chunk, unrounded, with the decoded packets in order of distance (peer
  ``j - 1``, ``j - 2``, ...) and quantizes that sum once; its packet is what every rank ends with.

The values are divided by ``2**scale_exponent`` before (inputs and residuals) and multiplied back
after, as the collective's prescale does (0 for any ordinary gradient).

**The study** (:func:`feedback_study`): ``N`` ranks, each with one fixed gradient, all-reduce it
``calls`` times, with and without error feedback, on every block wire and both shapes. After
``k`` calls the running sum's relative error is
``err(k) = ||sum_{i<=k} out_i - k S|| / (k ||S||)``, ``S`` the exact sum (float64). Without
feedback every call returns the same values (the calls are deterministic: one call is run and
repeated), so ``err(k) = err(1)``; with it the rounding telescopes, the sum over ``k`` calls
errs by a bounded amount and ``err(k)`` falls like ``1/k``, down to what float32's own rounding
of the sums leaves. Pure numpy; matplotlib only in :func:`plot_feedback`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cerar.coding.blocks import WIRES, BlockFormat, direct_round_trip, round_trip
from cerar.experiments._extras import pyplot
from cerar.experiments.study.frontier import inputs as study_inputs
from cerar.experiments.study.synthetic import fit_slope
from cerar.protocol.simulate_ring import ring_bytes_per_value, simulate_ring

__all__ = [
    "INPUTS",
    "SHAPES",
    "SLOPE_FROM",
    "direct_feedback",
    "feedback_call",
    "feedback_study",
    "feedback_table",
    "plain_call",
    "plot_feedback",
    "ring_feedback",
    "running_errors",
    "zero_residuals",
]

#: The two shapes of the block rows: ``ring-<wire>`` and ``direct-<wire>``.
SHAPES: tuple[str, ...] = ("ring", "direct")
#: The study's inputs (:func:`cerar.experiments.study.frontier.inputs`): Gaussian and heavy-tailed.
INPUTS: tuple[str, ...] = ("gaussian", "student-t3")
#: The first call of the fitted slope of ``log err`` against ``log k`` (to the last call).
SLOPE_FROM = 10

_STEP = 126  # the largest power-of-two step a float32 scalar holds (scale_by_power_of_two's)


def zero_residuals(world_size: int, values: int) -> np.ndarray:
    """The residuals of a stream's first call: ``(N, N * ceil(d / N))`` float32 zeros."""
    return np.zeros((world_size, world_size * -(-values // world_size)), dtype=np.float32)


def _scale(x: np.ndarray, exponent: int) -> None:
    """``x *= 2**exponent`` in place, in float32 steps, as the collective's prescale does."""
    while exponent:
        step = max(-_STEP, min(_STEP, exponent))
        x *= np.float32(math.ldexp(1.0, step))
        exponent -= step


def _prepare(
    inputs: Any, fmt: BlockFormat, residuals: Any, scale_exponent: int
) -> tuple[np.ndarray, np.ndarray, int, int, int]:
    """The inputs padded to ``(N, N, chunk)`` [rank, chunk, value] and a copy of the residuals the
    same way, both divided by ``2**scale_exponent``; ``N``, ``d``, ``chunk``."""
    if not isinstance(fmt, BlockFormat):
        raise TypeError(f"Argument 'fmt' must be a cerar BlockFormat, not {type(fmt).__name__}.")
    x = np.asarray(inputs, dtype=np.float32)
    if x.ndim != 2 or x.shape[0] < 2 or x.shape[1] < 1:
        raise ValueError(f"Argument 'inputs' must be N x d with N >= 2 and d >= 1, not of shape {x.shape}.")
    n, d = x.shape
    chunk = -(-d // n)
    res = np.asarray(residuals)
    if res.shape != (n, n * chunk) or res.dtype != np.float32:
        raise ValueError(
            f"Argument 'residuals' must be float32 of shape {(n, n * chunk)} (N x N ceil(d / N)), "
            f"not {res.dtype} of shape {res.shape}."
        )
    padded = np.zeros((n, n * chunk), dtype=np.float32)
    padded[:, :d] = x
    res = res.copy()
    _scale(padded, -scale_exponent)
    _scale(res, -scale_exponent)
    return padded.reshape(n, n, chunk), res.reshape(n, n, chunk), n, d, chunk


def _fed(value: np.ndarray, residual: np.ndarray, fmt: BlockFormat) -> tuple[np.ndarray, np.ndarray]:
    """:func:`cerar.comm.algorithms.ring.feedback.feedback_encode`: ``w = value + residual`` is
    quantized; returns what the packet decodes to and the new residual ``-(decode - w)``."""
    w = value + residual
    packet = round_trip(w, fmt)
    return packet, -(packet - w)


def _finish(
    out: np.ndarray, res: np.ndarray, n: int, d: int, scale_exponent: int
) -> tuple[np.ndarray, np.ndarray]:
    out = np.ascontiguousarray(out.reshape(-1)[:d])
    res = np.ascontiguousarray(res.reshape(n, -1))
    _scale(out, scale_exponent)
    _scale(res, scale_exponent)
    return out, res


def ring_feedback(
    inputs: Any, fmt: BlockFormat, residuals: Any, scale_exponent: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """One call of the block ring with error feedback (see the module doc).

    Args:
        inputs: ``(N, d)`` float32, rank ``i``'s input in row ``i``.
        fmt: the wire's :class:`BlockFormat`.
        residuals: ``(N, N * ceil(d / N))`` float32, rank ``i``'s residual in row ``i`` (not changed).
        scale_exponent: the collective's prescale (0 for an ordinary gradient).

    Returns:
        ``(out, residuals)``: the ``(d,)`` float32 sum every rank ends with, and the updated
        ``(N, N * ceil(d / N))`` residuals.
    """
    x, res, n, d, _ = _prepare(inputs, fmt, residuals, scale_exponent)
    chunks = np.arange(n)
    packet = np.empty(0, dtype=np.float32)
    for t in range(1, n + 1):  # hop t: chunk j on rank j + t - 1
        ranks = (chunks + t - 1) % n
        value = x[ranks, chunks] if t == 1 else packet + x[ranks, chunks]  # decode(arrived) + own
        packet, res[ranks, chunks] = _fed(value, res[ranks, chunks], fmt)
    return _finish(packet, res, n, d, scale_exponent)  # hop N's packets: the owners', chunk j in row j


def direct_feedback(
    inputs: Any, fmt: BlockFormat, residuals: Any, scale_exponent: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """One call of the direct shape with error feedback (see the module doc); the arguments and
    returns as :func:`ring_feedback`'s."""
    x, res, n, d, _ = _prepare(inputs, fmt, residuals, scale_exponent)
    ranks = np.arange(n)
    # 1. Every rank's chunk j to its owner j (the diagonal, each owner's own chunk, is not sent).
    sent, fed = _fed(x, res, fmt)
    others = ranks[:, None] != ranks[None, :]
    res[others] = fed[others]
    # 2. The owner's sum: its own chunk, unrounded, plus peer j - 1, j - 2, ... in float32.
    own = x[ranks, ranks].copy()
    for k in range(1, n):
        own = own + sent[(ranks - k) % n, ranks]
    # 3. The sum quantized once; every rank decodes that packet.
    out, res[ranks, ranks] = _fed(own, res[ranks, ranks], fmt)
    return _finish(out, res, n, d, scale_exponent)


def feedback_call(
    shape: str, inputs: Any, fmt: BlockFormat, residuals: Any, scale_exponent: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`ring_feedback` or :func:`direct_feedback`, by ``shape``."""
    if shape not in SHAPES:
        raise ValueError(f"Argument 'shape' must be one of {SHAPES}, not {shape!r}.")
    run = ring_feedback if shape == "ring" else direct_feedback
    return run(inputs, fmt, residuals, scale_exponent)


def plain_call(shape: str, inputs: Any, fmt: BlockFormat) -> np.ndarray:
    """One call without error feedback, the sum every rank ends with (float32): the ring's
    :func:`cerar.protocol.simulate_ring.simulate_ring`, the direct shape's
    :func:`cerar.coding.blocks.direct_round_trip`."""
    if shape not in SHAPES:
        raise ValueError(f"Argument 'shape' must be one of {SHAPES}, not {shape!r}.")
    x = np.asarray(inputs, dtype=np.float32)
    if shape == "direct":
        return direct_round_trip(x, fmt)
    return simulate_ring(x, fmt.wire, block_format=fmt).outputs[0].astype(np.float32)


def running_errors(outputs: Sequence[np.ndarray], exact: np.ndarray) -> list[float]:
    """``err(k) = ||sum_{i<=k} out_i - k S|| / (k ||S||)`` for ``k = 1 .. len(outputs)``, in float64."""
    exact = np.asarray(exact, dtype=np.float64)
    norm = float(np.linalg.norm(exact))
    total = np.zeros_like(exact)
    errors = []
    for k, out in enumerate(outputs, start=1):
        total += np.asarray(out, dtype=np.float64)
        errors.append(float(np.linalg.norm(total - k * exact)) / (k * norm))
    return errors


def _slope(errors: Sequence[float]) -> float | None:
    """The fitted slope of ``log err(k)`` against ``log k`` from call :data:`SLOPE_FROM` (half the
    calls where fewer) to the last; None where fewer than 2 calls or an error is 0."""
    calls = len(errors)
    first = min(SLOPE_FROM, max(1, calls // 2))
    ks = np.arange(first, calls + 1)
    ys = np.asarray(errors[first - 1 :])
    if len(ks) < 2 or not np.all(ys > 0):
        return None
    return fit_slope(ks, ys)


def _series(x: np.ndarray, fmt: BlockFormat, shape: str, calls: int) -> dict[str, Any]:
    n, d = x.shape
    exact = x.astype(np.float64).sum(axis=0)
    plain = running_errors([plain_call(shape, x, fmt)] * calls, exact)  # deterministic: every call the same
    residuals = zero_residuals(n, d)
    outputs = []
    for _ in range(calls):
        out, residuals = feedback_call(shape, x, fmt, residuals)
        outputs.append(out)
    fed = running_errors(outputs, exact)
    rms = float(np.sqrt(np.mean(residuals.astype(np.float64) ** 2)))
    return {
        "wire": fmt.wire, "shape": shape, "block": fmt.block, "scale": fmt.scale,
        "bytes_per_value": ring_bytes_per_value(n, fmt.wire, fmt),
        "plain": plain, "fed": fed, "slope": _slope(fed),
        "residual_rms": rms, "input_rms": float(np.sqrt(np.mean(x.astype(np.float64) ** 2))),
    }  # fmt: skip


def feedback_study(
    world_size: int = 4,
    values: int = 1 << 16,
    calls: int = 100,
    seed: int = 0,
    kinds: Sequence[str] = INPUTS,
    wires: Sequence[str] = WIRES,
    shapes: Sequence[str] = SHAPES,
) -> dict[str, Any]:
    """The running sum's error over ``calls`` calls of one fixed gradient per rank (``world_size``
    ranks, ``values`` each, :func:`cerar.experiments.study.frontier.inputs` of each kind of
    ``kinds``), with and without error feedback, for every wire of ``wires`` (each at its default
    :class:`BlockFormat`) and shape of ``shapes``: one series each, ``plain`` and ``fed`` the
    ``err(k)`` lists and ``slope`` the fitted slope of ``log err`` (with feedback) against
    ``log k`` from :data:`SLOPE_FROM` calls on."""
    if calls < 1 or values < 1 or world_size < 2:
        raise ValueError(
            f"Arguments 'calls', 'values' and 'world_size' must be at least 1, 1 and 2, not {calls}, {values}, "
            f"{world_size}."
        )
    for wire in wires:
        if wire not in WIRES:
            raise ValueError(f"Argument 'wires' must hold wires of {WIRES}, not {wire!r}.")
    for shape in shapes:
        if shape not in SHAPES:
            raise ValueError(f"Argument 'shapes' must hold shapes of {SHAPES}, not {shape!r}.")
    series = []
    for kind in kinds:
        x = study_inputs(kind, world_size, values, seed)
        for wire in wires:
            for shape in shapes:
                series.append({"input": kind, **_series(x, BlockFormat(wire), shape, calls)})
    return {"world_size": world_size, "values": values, "calls": calls, "seed": seed, "slope_from": SLOPE_FROM,
            "series": series}  # fmt: skip


def feedback_table(study: dict[str, Any]) -> str:
    """The study's table: per input, wire and shape, ``err(1)``, ``err(calls)`` without and with
    error feedback, and the fitted slope with it."""
    calls = study["calls"]
    first = min(study.get("slope_from", SLOPE_FROM), max(1, calls // 2))
    head = (f"{'input':<11} {'wire':<5} {'shape':<6} {'err(1)':>9} {f'err({calls}) no EF':>14} "
            f"{f'err({calls}) EF':>11} {f'slope EF k={first}..{calls}':>20}")  # fmt: skip
    lines = [head]
    for s in study["series"]:
        slope = "-" if s["slope"] is None else f"{s['slope']:.2f}"
        lines.append(f"{s['input']:<11} {s['wire']:<5} {s['shape']:<6} {s['plain'][0]:>9.2e} "
                     f"{s['plain'][-1]:>14.2e} {s['fed'][-1]:>11.2e} {slope:>20}")  # fmt: skip
    return "\n".join(lines)


def plot_feedback(study: dict[str, Any], path: Path) -> None:
    """One panel per input: ``err(k)`` against ``k``, log-log, a line per wire and shape, solid
    with error feedback and dashed without, and a ``1/k`` guide."""
    plt = pyplot("bench", needed_by="cerar study --feedback")
    kinds = list(dict.fromkeys(s["input"] for s in study["series"]))
    fig, axes = plt.subplots(1, len(kinds), figsize=(6.0 * len(kinds), 4.8), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ks = np.arange(1, study["calls"] + 1)
    for ax, kind in zip(axes[0], kinds, strict=True):
        mine = [s for s in study["series"] if s["input"] == kind]
        for i, s in enumerate(mine):
            color, label = colors[i % len(colors)], f"{s['shape']} {s['wire']}"
            ax.loglog(ks, s["fed"], "-", color=color, label=f"{label} + EF")
            ax.loglog(ks, s["plain"], "--", color=color, alpha=0.7, label=label)
        top = max(s["fed"][0] for s in mine)
        ax.loglog(ks, top / ks, ":", color="grey", label="1/k")
        ax.set(title=f"N = {study['world_size']}, {kind}, {study['values']} values per rank", xlabel="calls k",
               ylabel="relative error of the sum over k calls")  # fmt: skip
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
