"""The accuracy study behind ``cerar study``: data first, figures second.

Every function here returns plain JSON-ready dicts so that other modes of the command (e.g. a
later ``--gradients`` mode measuring real gradients) can reuse the pieces: the input generators
(:func:`iid_inputs`, :func:`gradient_like_inputs`), the per-method error measurement
(:func:`method_error`, :func:`ring_error`) and the plotting helpers. Pure numpy/scipy; matplotlib is
imported only by the plotting functions (:func:`cerar.experiments._extras.pyplot`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cerar.coding import codes
from cerar.coding.linear_code import Code
from cerar.coding.precision import ITEMSIZE, precision_name, rounder
from cerar.experiments._extras import pyplot
from cerar.protocol.simulate import simulate

__all__ = [
    "DESIGNS",
    "fit_slope",
    "gradient_like_inputs",
    "iid_inputs",
    "method_error",
    "plot_slopes",
    "plot_tradeoff",
    "ring_error",
    "slope_study",
    "tradeoff_study",
]


#: The trade-off study's code designs, by name: each a construction of
#: :data:`cerar.coding.codes.CONSTRUCTIONS` and its options: the plain perturbed construction,
#: the same with its seam spread (:mod:`cerar.coding.seam`), and
#: :func:`cerar.coding.codes.optimized` (spread-seam designs).
DESIGNS: dict[str, tuple[str, dict[str, Any]]] = {
    "perturbed": ("perturbed", {}),
    "perturbed-spread": ("perturbed", {"spread_seam": True}),
    "optimized": ("optimized", {}),
}


# --------------------------------------------------------------------------------------------
# Inputs and error measurements
def iid_inputs(world_size: int, size: int, seed: int) -> np.ndarray:
    """``(N, size)`` i.i.d. standard normal inputs."""
    return np.random.default_rng(seed).standard_normal((world_size, size))


def gradient_like_inputs(world_size: int, size: int, seed: int, shared: float = 3.0) -> np.ndarray:
    """``X_i = shared * g + noise_i``: a part all ranks share plus i.i.d. noise, as gradients have."""
    rng = np.random.default_rng(seed)
    return shared * rng.standard_normal((1, size)) + rng.standard_normal((world_size, size))


def method_error(code: Code, inputs: np.ndarray, precision: Any) -> float:
    """Simulated worst-rank relative error ``max_j ||S_hat_j - S|| / ||S||`` of ``code``
    (:func:`cerar.protocol.simulate`; codes that spread their seam run as the collective runs them)."""
    return simulate(code, inputs, precision).worst_relative_error


def ring_error(inputs: np.ndarray, precision: Any) -> float:
    """Relative error of a plain ring all-reduce whose packets travel in ``precision``.

    Each rank's input is cast to the precision and the running sum is rounded after every add,
    as the reduce-scatter of a ring does; the all-gather then copies the rounded sums exactly,
    so every rank has the same error.
    """
    cast = rounder(precision_name(precision))
    total = cast(inputs[0]).astype(np.float64)
    for row in inputs[1:]:
        total = cast(total + cast(row).astype(np.float64)).astype(np.float64)
    exact = inputs.sum(axis=0)
    return float(np.linalg.norm(total - exact) / np.linalg.norm(exact))


def fit_slope(x: Sequence[float], y: Sequence[float]) -> float:
    """Least-squares slope of ``log y`` against ``log x``."""
    return float(np.polyfit(np.log(np.asarray(x)), np.log(np.asarray(y)), 1)[0])


# --------------------------------------------------------------------------------------------
# Study 1: error and cond against the construction's parameter
def _slope_series(world_size: int) -> dict[str, tuple[Callable[[float], Code], np.ndarray, int]]:
    """Label -> (build from eps, eps grid, predicted r). The grids keep float64 decoding well
    inside its accuracy (the float64 decoder loses about ``1e-16 cond^2``, see the study's
    README note), so the fitted slopes are those of the exact-arithmetic error."""
    n = world_size
    # The sweeps run into codes the default error limit refuses (fp32 is their recorded precision,
    # the study simulates fp64): they are the point of the figure, so no limit (max_error=None).
    return {
        f"perturbed c={2 * n}": (
            lambda v: codes.perturbed(n, 2 * n, v, max_error=None), np.geomspace(1e-4, 1e-2, 9), 1
        ),
        f"perturbed c={3 * n}": (
            lambda v: codes.perturbed(n, 3 * n, v, max_error=None), np.geomspace(1e-3, 3e-2, 9), 2
        ),
        # The seam-spread variant: the same slopes, a smaller constant (about sqrt(3) at equal eps).
        f"perturbed-spread c={3 * n}": (
            lambda v: codes.perturbed(n, 3 * n, v, spread_seam=True, max_error=None), np.geomspace(1e-3, 3e-2, 9), 2
        ),
        f"vandermonde c={n + 1}": (
            lambda v: codes.vandermonde(n, n + 1, v, max_error=None), np.geomspace(1e-2, 1e-1, 7), n
        ),
    }


def slope_study(world_size: int = 4, size: int = 4096, seed: int = 0) -> dict[str, Any]:
    """Worst-rank error (simulated, float64 packets, i.i.d. inputs) and worst-rank cond against
    each construction's parameter ``eps``, with fitted log-log slopes next to the predicted
    ``1`` and ``-r`` (``r = ceil(c/N) - 1`` for perturbed, ``c - 1`` for Vandermonde)."""
    sizes = (world_size + 1, 2 * world_size, 3 * world_size)
    inputs = {c: iid_inputs(world_size, size * c, seed) for c in sizes}
    series = {}
    for label, (build, grid, r) in _slope_series(world_size).items():
        errors, conds = [], []
        for value in grid:
            code = build(float(value))
            errors.append(method_error(code, inputs[code.components], "fp64"))
            conds.append(float(np.max(code.cond)))
        series[label] = {
            "parameter": grid.tolist(),
            "error": errors,
            "cond": conds,
            "error_slope": fit_slope(grid, errors),
            "cond_slope": fit_slope(grid, conds),
            "predicted_error_slope": 1.0,
            "predicted_cond_slope": -float(r),
        }
    return {"world_size": world_size, "size_per_component": size, "seed": seed, "series": series}


# --------------------------------------------------------------------------------------------
# Study 2: bytes per element against worst-rank error
def tradeoff_study(
    world_sizes: Sequence[int] = (4, 8, 16),
    multiples: Sequence[float] = (1.5, 2, 3, 4),
    precisions: Sequence[str] = ("fp32", "fp64"),
    size_per_component: int = 256,
    seed: int = 0,
    designs: Sequence[str] = tuple(DESIGNS),
) -> dict[str, Any]:
    """For each ``N``, packet precision and ``c = multiple * N``: bytes per gradient element
    (``itemsize * (1 + (N-2)/c)``) and simulated worst-rank error on i.i.d. inputs, per design
    (see :data:`DESIGNS`); plus the 16-bit ring references (error and bytes) and the exact
    ring's bytes."""
    points: list[dict[str, Any]] = []
    references: dict[str, Any] = {}
    for n_ranks in world_sizes:
        ring_inputs = iid_inputs(n_ranks, 65536, seed)
        ring_rate = 2 * (n_ranks - 1) / n_ranks
        references[str(n_ranks)] = {
            name: {"error": ring_error(ring_inputs, name), "bytes": ITEMSIZE[name] * ring_rate}
            for name in ("fp16", "bf16", "fp32")
        }
        for precision in precisions:
            for multiple in multiples:
                c = round(multiple * n_ranks)
                inputs = iid_inputs(n_ranks, size_per_component * c, seed + 1)
                for design in designs:
                    code = _design(design, n_ranks, c, precision)
                    points.append({
                        "world_size": n_ranks,
                        "components": c,
                        "precision": precision,
                        "design": design,
                        "bytes_per_element": ITEMSIZE[precision] * code.comm_rate,
                        "error": method_error(code, inputs, precision),
                        "cond": float(np.max(code.cond)),
                    })
    return {
        "points": points,
        "references": references,
        "size_per_component": size_per_component,
        "seed": seed,
    }


def _design(design: str, world_size: int, components: int, precision: str) -> Code:
    if design not in DESIGNS:
        raise ValueError(f"Argument 'designs' must hold names from {tuple(DESIGNS)}, not {design!r}.")
    construction, options = DESIGNS[design]
    # The trade-off is charted out to its useless end: no error limit here.
    return codes.build(construction, world_size, components, precision, max_error=None, **options)


# --------------------------------------------------------------------------------------------
# Figures
def plot_slopes(study: dict[str, Any], path: Path) -> None:
    """Two log-log panels, error and cond against the parameter, slopes in the legend."""
    plt = pyplot("bench", needed_by="cerar study")
    fig, (ax_e, ax_c) = plt.subplots(1, 2, figsize=(10, 4))
    for name, s in study["series"].items():
        ax_e.loglog(s["parameter"], s["error"], "o-",
                    label=f"{name}: slope {s['error_slope']:.2f} (theory {s['predicted_error_slope']:.0f})")
        ax_c.loglog(s["parameter"], s["cond"], "o-",
                    label=f"{name}: slope {s['cond_slope']:.2f} (theory {s['predicted_cond_slope']:.0f})")
    title = f"N = {study['world_size']}, float64 packets, i.i.d. inputs"
    ax_e.set(xlabel="eps (delta or Vandermonde spacing)", ylabel="worst-rank relative error", title=title)
    ax_c.set(xlabel="eps", ylabel="worst-rank cond(W_j)", title=title)
    for ax in (ax_e, ax_c):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_tradeoff(study: dict[str, Any], path: Path) -> None:
    """One panel per ``N``: worst-rank error against bytes per element, with the 16-bit ring
    errors as horizontal lines and the fp32/fp16 exact ring's bytes as vertical lines."""
    plt = pyplot("bench", needed_by="cerar study")
    world_sizes = sorted({p["world_size"] for p in study["points"]})
    fig, axes = plt.subplots(1, len(world_sizes), figsize=(5 * len(world_sizes), 4.2), squeeze=False)
    markers = {"perturbed": "o", "perturbed-spread": "^", "optimized": "s"}
    for ax, n_ranks in zip(axes[0], world_sizes, strict=True):
        mine = [p for p in study["points"] if p["world_size"] == n_ranks]
        for precision in sorted({p["precision"] for p in mine}):
            for design in sorted({p["design"] for p in mine}):
                pts = sorted((p["bytes_per_element"], max(p["error"], 1e-17)) for p in mine
                             if p["precision"] == precision and p["design"] == design)
                ax.semilogy(*zip(*pts, strict=True), marker=markers.get(design, "x"), linestyle="-",
                            label=f"{design} {precision}")
        refs = study["references"][str(n_ranks)]
        for name, style in (("fp16", "--"), ("bf16", ":")):
            ax.axhline(refs[name]["error"], color="grey", linestyle=style, label=f"{name} ring error")
        for name, color in (("fp32", "black"), ("fp16", "tab:red")):
            ax.axvline(refs[name]["bytes"], color=color, alpha=0.5, label=f"exact ring {name} bytes")
        ax.set(title=f"N = {n_ranks}", xlabel="bytes sent per gradient element per rank",
               ylabel="worst-rank relative error (i.i.d.)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
